"""`Sweeper`: every N forwards, verify every live cached slot — also idle prefix-cache slots
that no forward reads.

The engine adapter says which slots are live; the runtime knows, from its own slot records, the
position each slot was written at and the slot it chained from. A predecessor that has been
rewritten since (freed and reused — normal once a sliding window moves on or a prefix is evicted)
is passed as unreachable (0), so only the slot's own record and real KV are judged. Live slots the
canary never wrote (attached mid-run) are skipped and counted, never verified against garbage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from kvcanary.ops import TOKEN_TO_KV_SLOT_PADDING, CanaryLaunchTag, VerifyPlan, launch_canary_verify_kernel
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.counters import LaunchCounters
from kvcanary.runtime.groups import NEVER_WRITTEN, CanaryGroup
from kvcanary.runtime.violations import Attribution, ViolationDrain


@dataclass(frozen=True)
class SweepReport:
    """One sweep: per group, live slots given, slots verified, live slots never written."""

    step: int
    live: dict[str, int] = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)
    unrecorded: dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True when every live slot was verified."""
        return all(self.verified.get(g, 0) == n for g, n in self.live.items())


class _SweepRecord:
    """Attributes SWEEP rows to the slot's last writer, from the runtime's slot records."""

    def __init__(self, groups: dict[str, CanaryGroup], owners, step: int) -> None:
        self.groups, self.owners, self.step = groups, owners, step

    def attribute(self, *, tag: CanaryLaunchTag, op: str, rows: list[list[int]]) -> list[Attribution]:
        rec = self.groups[tag.group].records
        slots = torch.tensor([r[1] for r in rows], dtype=torch.int64, device=rec.owner.device)
        owners = rec.owner[slots].tolist()
        positions = rec.position[slots].tolist()
        out = []
        for code, pos in zip(owners, positions):
            rid, row = self.owners.owner(code) if code >= 0 else (None, None)
            out.append(Attribution(rid, row, pos, self.step, "sweep"))
        return out


class Sweeper:
    """Runs sweeps (SWEEP_K / SWEEP_V over each group's TAIL buffers)."""

    def __init__(
        self, groups: dict[str, CanaryGroup], *, config: CanaryConfig, drain: ViolationDrain,
        counters: LaunchCounters, owners,
    ) -> None:
        self.groups = groups
        self.interval = config.sweep_interval
        self.drain = drain
        self.counters = counters
        self.owners = owners
        self.sweeps = 0
        self.last: SweepReport | None = None
        self._no_assert = torch.zeros(1, dtype=torch.int32, device=next(iter(groups.values())).device)

    def due(self, step: int) -> bool:
        return self.interval > 0 and step > 0 and step % self.interval == 0

    def run(self, live: Mapping[str, torch.Tensor], *, step: int) -> SweepReport:
        """Verify the live slots of each group named in ``live``."""
        report = SweepReport(step=step)
        for name, slots in live.items():
            g = self.groups[name]
            slots = slots.to(g.device, torch.int64).flatten()
            slots = slots[slots != TOKEN_TO_KV_SLOT_PADDING]
            if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= g.num_slots):
                raise ValueError(
                    f"kv-canary: live slots of group {name!r} must be in [1, {g.num_slots}), got "
                    f"[{int(slots.min())}, {int(slots.max())}]"
                )
            plan = self._plan(g, slots)
            n = plan.capacity if plan is not None else 0
            report.live[name] = int(slots.numel())
            report.verified[name] = n
            report.unrecorded[name] = int(slots.numel()) - n
            if plan is None:
                continue
            for side in g.tail_sides:
                ctx = g.context(
                    "sweep", side, "verify", drain=self.drain, counters=self.counters, chain_assert=self._no_assert
                )
                launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=False)
        self.drain.register(
            [t for g in self.groups.values() for t in g.tags() if t.phase == "sweep"],
            _SweepRecord(self.groups, self.owners, step),
        )
        self.sweeps += 1
        self.last = report
        return report

    @staticmethod
    def _plan(g: CanaryGroup, slots: torch.Tensor) -> VerifyPlan | None:
        rec = g.records
        written_at = rec.step[slots]
        slots = slots[written_at != NEVER_WRITTEN]
        if slots.numel() == 0:
            return None
        written_at = rec.step[slots]
        prev = rec.prev_slot[slots]
        safe_prev = torch.clamp(prev, min=0)
        intact = (prev >= 0) & (rec.step[safe_prev] <= written_at) & (rec.step[safe_prev] != NEVER_WRITTEN)
        # The link is checkable only while the predecessor still holds the previous position.
        intact &= rec.position[safe_prev] == rec.position[slots] - 1
        prev = torch.where(prev < 0, prev, torch.where(intact, prev, torch.zeros_like(prev)))
        n = int(slots.numel())
        dev = slots.device
        return VerifyPlan(
            verify_slot_indices=slots.contiguous(),
            verify_expected_tokens=torch.full((n,), -1, dtype=torch.int64, device=dev),
            verify_expected_positions=rec.position[slots].contiguous(),
            verify_prev_slot_indices=prev.contiguous(),
            verify_num_valid=torch.tensor([n], dtype=torch.int32, device=dev),
            enable=torch.ones(1, dtype=torch.int32, device=dev),
        )
