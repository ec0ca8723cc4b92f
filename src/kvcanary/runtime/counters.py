"""Device-side launch counters, one slot per launch tag, kept apart for verify and write; and the timing jitter's
two counters (stalls, cycles drawn: docs/design.md §4.9).

The ops bump a context's ``slot_run_counter`` / ``kernel_run_counter`` in place; each context gets
one-element views into these arrays, so a whole step's counts are read with one copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvcanary.ops import CanaryLaunchTag

NUM_TAGS = len(CanaryLaunchTag)


@dataclass(frozen=True)
class CounterSnapshot:
    """Host copy of the counters: per op (``verify`` / ``write``), per tag, slots and launches."""

    verify_slots: tuple[int, ...]
    verify_kernels: tuple[int, ...]
    write_slots: tuple[int, ...]
    write_kernels: tuple[int, ...]
    jitter: tuple[int, ...] = ()  # the jitter row: (stalls, cycles drawn, 0, ...)

    @property
    def jitter_stalls(self) -> int:
        """HEAD / TAIL entries the timing jitter stalled (0 when it is off)."""
        return self.jitter[0] if self.jitter else 0

    @property
    def jitter_cycles(self) -> int:
        """SM clock cycles the timing jitter drew for those stalls (the sum of the draws)."""
        return self.jitter[1] if self.jitter else 0

    @property
    def kernel_launches(self) -> int:
        return sum(self.verify_kernels) + sum(self.write_kernels)

    def slots_verified(self, phase: str | None = None) -> int:
        return sum(n for tag, n in zip(CanaryLaunchTag, self.verify_slots) if phase in (None, tag.phase))

    def slots_written(self, phase: str | None = None) -> int:
        return sum(n for tag, n in zip(CanaryLaunchTag, self.write_slots) if phase in (None, tag.phase))


class LaunchCounters:
    """int64 [5, NUM_TAGS] on the device: rows verify-slots, verify-kernels, write-slots, write-kernels, and the
    jitter row (column 0 stalls, column 1 cycles drawn; `jitter_counters`)."""

    _ROWS = {("verify", "slots"): 0, ("verify", "kernels"): 1, ("write", "slots"): 2, ("write", "kernels"): 3}
    JITTER_ROW = 4
    ROW_WIDTH = NUM_TAGS
    SHAPE = (5, NUM_TAGS)

    def __init__(self, device: torch.device, table: Optional[torch.Tensor] = None) -> None:
        """``table``: a zeroed int64 ``SHAPE`` tensor to count into (e.g. a view of `PolledWords`), or None."""
        self.table = torch.zeros(self.SHAPE, dtype=torch.int64, device=device) if table is None else table

    def views(self, op: str, tag: CanaryLaunchTag) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot_run_counter, kernel_run_counter)`` one-element views for ``op`` under ``tag``."""
        t = int(tag)
        slots = self.table[self._ROWS[(op, "slots")], t : t + 1]
        kernels = self.table[self._ROWS[(op, "kernels")], t : t + 1]
        return slots, kernels

    def jitter_counters(self) -> torch.Tensor:
        """The int64 [2] view ``[stalls, cycles drawn]`` a `kvcanary.ops.KernelJitter` counts into."""
        return self.table[self.JITTER_ROW, 0:2]

    def snapshot(self) -> CounterSnapshot:
        """Read the counters on the host (a device sync: call it periodically, not per forward)."""
        rows = self.table.cpu().tolist()
        return CounterSnapshot(*(tuple(r) for r in rows))

    @classmethod
    def from_words(cls, words: list[int]) -> CounterSnapshot:
        """The snapshot held in ``SHAPE``'s words flattened row by row (a copy read back earlier: no device read)."""
        width = cls.ROW_WIDTH
        return CounterSnapshot(*(tuple(words[r * width:(r + 1) * width]) for r in range(cls.SHAPE[0])))

    def memory_bytes(self) -> int:
        return self.table.numel() * self.table.element_size()
