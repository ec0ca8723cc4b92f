"""`RecordLookup`: what the canary's own state says about a slot or a step, for attribution (drain time only).

The one object `kvcanary.runtime.attribution.Attributor` asks (its `OwnerLookup` protocol): which request rows a
step ran (the launches' short device history), who last wrote a slot (the slot records' owner codes), who owned a
rotating sweep slice's entry when it was swept (the sweeper's history), the slots live now (the engine's provider:
sweep rows of slots freed since are stale), and the real-KV fingerprints a record holds against the ones its bytes
give now. Every method reads the device: called only when ring rows exist, never per forward.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from kvcanary.ops import CANARY_FIELD_REAL_KV_HASH, CanaryLaunchTag, RealKvHashMode
from kvcanary.ops.constants import MASK64
from kvcanary.ops.reference.real_kv import fingerprint_slots
from kvcanary.runtime.deep_store import DEEP_HASH_MODE
from kvcanary.runtime.groups import CanaryGroup
from kvcanary.runtime.sweep import Sweeper

LiveSlots = Callable[[], Optional[Mapping[str, torch.Tensor]]]


class RecordLookup:
    """The canary's records, histories and live slots behind attribution (see the module docstring).

    ``groups``: name -> `CanaryGroup`; ``row_history()``: the launches' ``[H, max_rows]`` int64 device history of
    each step's request rows (row ``step % H``; a getter: it is reallocated when the batch grows); ``current_step()``: the canary's step counter; ``live_slots()``:
    name -> slot ids or a bool mask per group, or None when no provider is set.
    """

    def __init__(self, *, groups: Mapping[str, CanaryGroup], row_history: Callable[[], torch.Tensor], sweeper: Sweeper,
                 current_step: Callable[[], int], live_slots: LiveSlots, device: torch.device) -> None:
        self.groups = groups
        self.row_history = row_history
        self.sweeper = sweeper
        self.current_step = current_step
        self._live_slots = live_slots
        self.device = device

    def rows_of_step(self, step: int) -> Optional[list[int]]:
        """Request rows of ``step`` (batch order), if the device history still holds them."""
        return device_rows(self.row_history(), self.current_step, step)

    def slot_owner(self, group: str, slots: list[int]) -> tuple[list[int], list[int]]:
        """(owner codes, positions) the slot records of ``slots`` hold now."""
        rec = self.groups[group].records
        idx = torch.tensor(slots, dtype=torch.int64, device=rec.owner.device).clamp(0, rec.num_slots)
        return rec.owner[idx].tolist(), rec.position[idx].tolist()

    def sweep_owner(self, group: str, step: int, entry: int) -> Optional[int]:
        """Owner code of the slot behind ``entry`` of the slice swept at ``step`` (None once forgotten)."""
        return self.sweeper.owner_at_sweep(group, step, entry, self.current_step())

    def live_slots(self) -> Optional[dict[str, set[int]]]:
        """Slot ids live now per group, or None without a live-slots provider."""
        live = self._live_slots()
        if live is None:
            return None
        return {name: set((t.nonzero() if t.dtype == torch.bool else t).flatten().tolist()) for name, t in live.items()}

    def fingerprints(self, group: str, tag: CanaryLaunchTag, slots: list[int]) -> list[tuple[int, int, str]]:
        """(stored, recomputed, scope) real-KV fingerprints of group ``group``'s ``slots`` for ``tag``'s side: the
        TAIL record's; for a sweep row (which also checked the deep records of every byte), the first of TAIL, then
        each deep chunk, that disagrees now, else the TAIL one."""
        g = self.groups[group]
        if tag.side not in g.tail_bufs:
            return []
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        mode = RealKvHashMode(int(g.hash_mode)).name.lower()
        candidates = [(g.tail_bufs[tag.side], g.sources.get(tag.side, ()), int(g.hash_mode),
                       f"layers {list(g.hashed_layers)}, {mode}")]
        if tag.phase == "sweep":
            for (chunk, side), sources in sorted(g.deep_sources.items()):
                if side == tag.side:
                    candidates.append((g.deep_bufs[(chunk, side)], sources, int(DEEP_HASH_MODE),
                                       f"layers {list(g.deep_layers.get(chunk, ()))}, every byte"))
        pairs = []
        for buf, sources, hash_mode, scope in candidates:
            stored = buf.view(torch.int64)[idx, CANARY_FIELD_REAL_KV_HASH].tolist()
            now = fingerprint_slots(sources, hash_mode, idx, self.device).tolist()
            pairs.append([(a & MASK64, b & MASK64, scope) for a, b in zip(stored, now)])
        return [next((p for p in per_slot if p[0] != p[1]), per_slot[0]) for per_slot in zip(*pairs)]


def device_rows(history: torch.Tensor, steps_kept: Callable[[], int], step: int) -> Optional[list[int]]:
    """Request rows of ``step`` from the device history ``[H, max_rows]`` (row ``step % H``), if still kept."""
    if step < 0 or steps_kept() - step >= history.shape[0]:
        return None
    return history[step % history.shape[0]].tolist()
