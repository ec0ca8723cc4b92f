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


def _one_shot(rid: str, edit) -> BatchHook:
    """A batch hook that applies ``edit(batch, row, start)`` once, to the first batch holding request ``rid``
    (``row``: its batch row, ``start``: its first token's index)."""
    fired = []

    def hook(batch: BatchDescription) -> BatchDescription:
        if fired or rid not in (batch.request_ids or ()):
            return batch
        fired.append(True)
        r = batch.request_ids.index(rid)
        return edit(batch, r, int(batch.extend_lens[:r].sum()))

    return hook


def shift_positions(rid: str, delta: int) -> BatchHook:
    """A one-shot batch hook adding ``delta`` to request ``rid``'s positions."""

    def edit(batch: BatchDescription, r: int, start: int) -> BatchDescription:
        pos = batch.positions.clone()
        pos[start : start + int(batch.extend_lens[r])] += delta
        return dataclasses.replace(batch, positions=pos)

    return _one_shot(rid, edit)


def on_rejection(engine: SimEngine, rid: str, then) -> None:
    """Once: when request ``rid``'s verify forward rejects a draft, run the engine's rollback and then
    ``then(req, first_rejected_position, first_rejected_full_slot, first_rejected_swa_slot)``."""
    original = engine._commit_verify

    def commit(req) -> None:
        if req.rid != rid or req.accepted >= len(req.drafts):
            return original(req)
        pos = len(req.tokens) + req.accepted
        full, swa = req.full_slots[pos], req.swa_slots[pos]
        del engine._commit_verify  # the class's rollback from now on
        original(req)
        then(req, pos, full, swa)

    engine._commit_verify = commit


def keep_rejected_slot(engine: SimEngine, req, position: int, full: int, swa: int) -> None:
    """A rejection handled one iteration late: the first rejected draft's slot stays the request's KV for
    ``position`` (where the bonus token now sits) and the position counts as computed; the request samples on."""
    engine.full_alloc.take(full)
    req.full_slots.append(full)
    if engine.swa_alloc:
        engine.swa_alloc.take(swa)
        engine.full_to_swa[full] = swa
        req.swa_slots.append(swa)
    req.num_computed = position + 1
    engine._sample_next(req)


def redirect_write(rid: str, entry: int, to_slot: int) -> BatchHook:
    """A one-shot batch hook: request ``rid``'s ``entry``-th written token goes to ``to_slot`` (full group; the
    sliding-window copy is not stored)."""

    def edit(batch: BatchDescription, r: int, start: int) -> BatchDescription:
        groups = {}
        for name, gb in batch.groups.items():
            loc = gb.out_cache_loc.clone()
            loc[start + entry] = to_slot if name == "full" else -1
            groups[name] = dataclasses.replace(gb, out_cache_loc=loc)
        return dataclasses.replace(batch, groups=groups)

    return _one_shot(rid, edit)
