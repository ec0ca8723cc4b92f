"""Low-level fault hooks on the simulated engine: each breaks one piece of the engine's own
bookkeeping the way a real engine bug does (the injectors in `kvcanary.faults.sim` build on them).

They touch only the engine's tables, allocators and KV pools, never the canary.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from kvcanary.engines.sim.engine import BatchHook, SimEngine
from kvcanary.runtime import BatchDescription


def redirect_slot(engine: SimEngine, rid: str, position: int, to_slot: int, *, group: str = "full") -> int:
    """Point (request, position) at ``to_slot`` in the position->slot table (full) or the LUT (swa).
    Returns the slot it pointed at before (in that group's space)."""
    req = engine.request(rid)
    full = int(engine.table.req_to_token[req.row, position])
    if group == "full":
        engine.table.req_to_token[req.row, position] = to_slot
        return full
    old = int(engine.full_to_swa[full])
    engine.full_to_swa[full] = to_slot
    return old


def free_and_reuse(engine: SimEngine, rid: str, position: int) -> int:
    """Free (request, position)'s full slot while the request still uses it, so the next allocation
    hands it out again. Returns the slot."""
    req = engine.request(rid)
    slot = int(engine.table.req_to_token[req.row, position])
    engine.full_alloc.force_free(slot)
    return slot


def flip_kv_bit(engine: SimEngine, group: str, slot: int, *, layer: Optional[int] = None, side: str = "k",
                byte: int = 0, bit: int = 0) -> None:
    """Flip one bit of one slot's stored K or V (default: the group's first layer). Its own inverse."""
    layers = engine.config.full_layers if group == "full" else engine.config.swa_layers
    k, v = engine.kv[(group, layers[0] if layer is None else layer)]
    t = k if side == "k" else v
    t[slot, byte] ^= 1 << bit


def cached_idle_slots(engine: SimEngine) -> list[int]:
    """Full slots held only by the prefix cache (no running request uses them)."""
    used = {s for r in engine.running for s in r.full_slots}
    return [s for n in engine.cache.nodes() for s in n.full_slots if s not in used]


def shift_positions(rid: str, delta: int) -> BatchHook:
    """A one-shot batch hook adding ``delta`` to request ``rid``'s positions."""
    fired = []

    def hook(batch: BatchDescription) -> BatchDescription:
        if fired or rid not in (batch.request_ids or ()):
            return batch
        fired.append(True)
        r = batch.request_ids.index(rid)
        start = int(batch.extend_lens[:r].sum())
        pos = batch.positions.clone()
        pos[start : start + int(batch.extend_lens[r])] += delta
        return dataclasses.replace(batch, positions=pos)

    return hook
