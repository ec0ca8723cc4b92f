"""Fault injectors for the simulated engine, one per fault class (`FAULT_CLASSES`).

An injector is called between two forwards: ``fire()`` damages the engine the way a real bug does
and returns the `Injection` it appended to the ledger (None when the engine offers no target yet:
the runner steps on and tries again); ``after_forward()`` runs after the next forward (one-forward
faults restore the table there); ``repair()`` runs at the end of the detection window and undoes
what would keep corrupting later windows (flipped bits flipped back, copied bytes restored).

Injectors whose damage cannot be undone without corrupting the engine's own accounting
(``fresh_engine = True``: a freed-while-used slot, a shifted write, a wrong prefix block) get a
fresh engine per injection from the runner. Each injector draws from its own seeded generator.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvcanary.engines.sim.engine import SimEngine
from kvcanary.faults.ledger import FaultLedger, Injection
from kvcanary.faults.sim_hooks import (cached_idle_slots, flip_kv_bit, free_and_reuse, keep_rejected_slot, on_rejection,
                                       redirect_slot, redirect_write, shift_positions)
from kvcanary.runtime import Canary

ENGINE = "sim"
STRUCTURE = ("verify_position", "verify_chain_hash", "verify_token")


@dataclass
class SimTarget:
    """What an injector works on: the engine, its canary and the shared ledger."""

    engine: SimEngine
    canary: Canary
    ledger: FaultLedger
    oracle_on: bool = True
    register: Optional[Callable[[str, list], None]] = None  # tell the token oracle about a new request's prompt


def hashed_layers(target: SimTarget, group: str) -> tuple[int, ...]:
    """The model layers of ``group`` whose K/V feed the canary's fingerprints (empty when hashing is off)."""
    cfg = target.canary.config
    if cfg.real_kv_hash == "none":
        return ()
    c = target.engine.config
    layers = c.full_layers if group == "full" else c.swa_layers
    return tuple(sorted({layers[i] for i in cfg.real_kv_layers if -len(layers) <= i < len(layers)}))


def byte_hashed(target: SimTarget, group: str, layer: int, byte: int) -> bool:
    """Whether a flip of ``byte`` of ``layer``'s K or V changes a fingerprint the canary checks (the TAIL
    fingerprints of the picked layers, or — deep fingerprints, on by default — every byte of every layer,
    checked by the sweep within one pass)."""
    cfg = target.canary.config
    if cfg.real_kv_hash == "none":
        return False
    if cfg.deep_fingerprints:
        return True
    if layer not in hashed_layers(target, group):
        return False
    return cfg.real_kv_hash == "all" or byte < 16


def running_requests(engine, *, tokens_left: int = 2) -> list:
    """Running requests that will still run for at least ``tokens_left`` more forwards (the injection can
    then be read, and detected, before they finish)."""
    return [r for r in engine.running if r.state == "running" and r.max_new - r.generated >= tokens_left]


def slot_writer(canary: Canary, group: str, slot: int) -> Optional[str]:
    """The request that last wrote ``slot`` (from the runtime's slot records), or None."""
    from kvcanary.runtime.owners import split_owner

    owner = int(canary.groups[group].records.owner[slot])
    if owner < 0:
        return None
    step, row = split_owner(owner)
    entry = canary.step_log.get(step)
    if entry is None or entry.request_ids is None or row >= len(entry.request_ids):
        return None
    return entry.request_ids[row]


def unique_cached_positions(engine: SimEngine, *, min_computed: int = 4, own_only: bool = False):
    """(request, position) pairs of running requests whose slot no other running request reads,
    among positions already computed; requests that still have work (so they are in the next forward)."""
    count: dict[int, int] = {}
    for r in engine.running:
        for s in r.full_slots[: r.num_computed]:
            count[s] = count.get(s, 0) + 1
    out = []
    for r in engine.running:
        if r.state != "running" or r.num_computed < min_computed or r.max_new - r.generated < 2:
            continue
        lo = r.own_from if own_only else 0
        out += [(r, p) for p in range(lo, r.num_computed) if count[r.full_slots[p]] == 1]
    return out


class SimInjector:
    """Base class. ``fault``: the class name; ``fresh_engine``: a new engine per injection."""

    fault = ""
    fresh_engine = False
    needs_swa = False
    needs_spec = False  # the engine runs speculative decoding (verify forwards)

    def __init__(self, target: SimTarget, seed: int) -> None:
        self.t = target
        self.rng = random.Random(f"{self.fault}:{seed}")
        self._undo: list = []

    @property
    def next_step(self) -> int:
        return self.t.canary.step + 1

    def record(self, **kw) -> Injection:
        return self.t.ledger.add(Injection(fault=self.fault, engine=ENGINE, step=self.next_step, **kw))

    def fire(self) -> Optional[Injection]:
        raise NotImplementedError

    def after_forward(self) -> None:
        pass

    def repair(self) -> None:
        while self._undo:
            self._undo.pop()()

    def settled(self, injection: Injection, *, detected: bool) -> Injection:
        """``injection`` as it stands once its window is over (after `repair`; ``detected``: whether the canary
        reported it); by default unchanged."""
        return injection


class KvFlipUsed(SimInjector):
    """A bit flips in the K/V of a slot a running request reads (inside the hashed window: a hashed
    layer, and the first 16 bytes in ``partial``) — bad DMA, a kernel writing out of bounds."""

    fault = "kv_flip_used"

    def fire(self):
        e = self.t.engine
        cands = unique_cached_positions(e)
        if not cands:
            return None
        req, p = self.rng.choice(cands)
        slot = req.full_slots[p]
        layers = hashed_layers(self.t, "full") or e.config.full_layers
        layer, side = self.rng.choice(layers), self.rng.choice("kv")
        span = e.config.kv_bytes if self.t.canary.config.real_kv_hash == "all" else 16
        byte, bit = self.rng.randrange(span), self.rng.randrange(8)
        flip_kv_bit(e, "full", slot, layer=layer, side=side, byte=byte, bit=bit)
        self._undo.append(lambda: flip_kv_bit(e, "full", slot, layer=layer, side=side, byte=byte, bit=bit))
        ok = byte_hashed(self.t, "full", layer, byte)
        return self.record(group="full", slot=slot, position=p, request_id=req.rid, expected=("verify_real_kv_hash",),
                           expected_detectable=ok, why_not="" if ok else "real-KV hashing is off",
                           detail=f"layer {layer} {side.upper()} byte {byte} bit {bit}")


class KvFlipCached(SimInjector):
    """A bit flips anywhere (any layer, any byte) in an idle prefix-cache slot no forward reads —
    only the sweep can see it, and only if the byte is fingerprinted."""

    fault = "kv_flip_cached"

    def fire(self):
        e = self.t.engine
        idle = cached_idle_slots(e)
        if not idle:
            return None
        slot = self.rng.choice(idle)
        layer, side = self.rng.choice(e.config.full_layers), self.rng.choice("kv")
        byte, bit = self.rng.randrange(e.config.kv_bytes), self.rng.randrange(8)
        flip_kv_bit(e, "full", slot, layer=layer, side=side, byte=byte, bit=bit)
        # an idle slot may be evicted and handed to a new request at once (LIFO free list): the engine then
        # writes fresh KV over the flip — nothing damaged is left to read or sweep, and nothing to undo
        self._rewritten = False

        def watch(batch):
            self._rewritten |= bool((batch.groups["full"].out_cache_loc == slot).any())
            return batch

        self._undo.append(lambda: None if self._rewritten else flip_kv_bit(e, "full", slot, layer=layer, side=side,
                                                                            byte=byte, bit=bit))
        e.batch_hooks.append(watch)
        self._undo.append(lambda: e.batch_hooks.remove(watch))
        ok = byte_hashed(self.t, "full", layer, byte)
        return self.record(group="full", slot=slot, position=int(self.t.canary.groups["full"].records.position[slot]),
                           request_id=slot_writer(self.t.canary, "full", slot), expected=("verify_real_kv_hash",),
                           expected_detectable=ok,
                           why_not="" if ok else f"layer {layer} byte {byte} is outside the fingerprinted bytes",
                           detail=f"idle cached slot, layer {layer} {side.upper()} byte {byte} bit {bit}")

    def settled(self, injection: Injection, *, detected: bool) -> Injection:
        if detected or not self._rewritten:  # seen before the overwrite, or still there: as fired
            return injection
        return self.t.ledger.amend(injection, expected_detectable=False,
                                   why_not="the engine evicted the idle slot and wrote new KV over the flip "
                                           "before any forward or sweep read it")


class KvFlipDeepLayer(SimInjector):
    """A bit flips in a layer that is not among the fingerprinted sources (a deep layer of a deep
    model: at most 4 layers are hashed) of a slot a running request reads."""

    fault = "kv_flip_deep_layer"

    def fire(self):
        e = self.t.engine
        deep = [x for x in e.config.full_layers if x not in hashed_layers(self.t, "full")] or list(e.config.full_layers)
        cands = unique_cached_positions(e)
        if not cands:
            return None
        req, p = self.rng.choice(cands)
        slot = req.full_slots[p]
        layer, side = self.rng.choice(deep), self.rng.choice("kv")
        byte, bit = self.rng.randrange(16), self.rng.randrange(8)
        flip_kv_bit(e, "full", slot, layer=layer, side=side, byte=byte, bit=bit)
        self._undo.append(lambda: flip_kv_bit(e, "full", slot, layer=layer, side=side, byte=byte, bit=bit))
        ok = byte_hashed(self.t, "full", layer, byte)
        return self.record(group="full", slot=slot, position=p, request_id=req.rid, expected=("verify_real_kv_hash",),
                           expected_detectable=ok,
                           why_not="" if ok else f"layer {layer} is not a fingerprinted source (real_kv_layers)",
                           detail=f"layer {layer} {side.upper()} byte {byte} bit {bit}")


class SlotRedirect(SimInjector):
    """For one forward, a cached position of a request maps to another live slot (a stale block
    table, an off-by-one page index)."""

    fault = "slot_redirect"

    def fire(self):
        e = self.t.engine
        cands = unique_cached_positions(e)
        if len(cands) < 2:
            return None
        req, p = self.rng.choice(cands)
        others = [(r, q) for r, q in cands if r is not req and q != p]
        if not others:
            return None
        other, q = self.rng.choice(others)
        to = other.full_slots[q]
        old = redirect_slot(e, req.rid, p, to)
        self._placed = (req, req.row, p, to)

        def undo() -> None:
            if self.in_place():  # else the engine rewrote the entry itself (a restore, a fork): leave its value
                e.table.req_to_token[req.row, p] = old

        self._undo.append(undo)
        return self.record(group="full", slot=to, position=p, request_id=req.rid, expected=STRUCTURE,
                           detail=f"position {p} of {req.rid} read from slot {to} (position {q} of {other.rid})")

    def in_place(self) -> bool:
        """Whether the redirected entry still holds the injected slot (a host offload + restore, or any rewrite of the
        request's row by the engine, replaces it: the forward then read the right slot and nothing was injected)."""
        placed = getattr(self, "_placed", None)
        if placed is None:
            return False
        req, row, p, to = placed
        return req.row == row and int(self.t.engine.table.req_to_token[row, p]) == to

    def after_forward(self):
        self.repair()


class UseAfterFree(SimInjector):
    """A slot a running request still reads is freed (a refcount dropped too early) and handed to
    the next allocation, which overwrites it."""

    fault = "use_after_free"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        cands = unique_cached_positions(e, own_only=True)
        if not cands:
            return None
        req, p = self.rng.choice(cands)
        slot = free_and_reuse(e, req.rid, p)
        return self.record(group="full", slot=slot, position=p, request_id=req.rid,
                           expected=STRUCTURE + ("verify_real_kv_hash",), detail=f"slot {slot} of {req.rid} freed at position {p}")


class DoubleAlloc(SimInjector):
    """The allocator hands out a slot the prefix cache still holds for a running request's shared
    prefix (the slot stays marked in use: two owners at once)."""

    fault = "double_alloc"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        cands = [(r, p) for r in e.running if r.state == "running" and r.max_new - r.generated >= 2
                 for p in range(r.own_from)]
        if not cands:
            return None
        req, p = self.rng.choice(cands)
        slot = req.full_slots[p]
        e.full_alloc.force_free(slot)
        e.full_alloc.in_use[slot] = True  # still counted live: the allocator's list now holds a live slot
        return self.record(group="full", slot=slot, position=p, request_id=req.rid,
                           expected=STRUCTURE + ("verify_real_kv_hash",),
                           detail=f"cached-prefix slot {slot} (position {p} of {req.rid}) allocated again")


class PositionShift(SimInjector):
    """One forward writes a request's tokens one position too far (off-by-one in the positions)."""

    fault = "position_shift"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        cands = [r for r in running_requests(e) if r.num_computed >= 2]
        if not cands:
            return None
        req = self.rng.choice(cands)
        e.batch_hooks.insert(0, shift_positions(req.rid, +1))
        return self.record(group="full", slot=-1, position=req.num_computed, request_id=req.rid,
                           expected=("write_position", "verify_position"), detail=f"{req.rid} positions +1 for one forward")


class TokenSwap(SimInjector):
    """The sampled tokens of two decoding requests are swapped (sampler output routed to the wrong
    row). Self-consistent KV: only the token oracle (write-input assert) can tell."""

    fault = "token_swap"

    def fire(self):
        e = self.t.engine
        dec = [r for r in e.running if r.state == "running" and r.generated >= 1 and r.max_new - r.generated >= 1
               and r.num_computed == len(r.tokens) - 1]
        pairs = [(a, b) for i, a in enumerate(dec) for b in dec[i + 1:] if a.tokens[-1] != b.tokens[-1]]
        if not pairs:
            return None
        a, b = self.rng.choice(pairs)
        ta, tb = a.tokens[-1], b.tokens[-1]
        a.tokens[-1], b.tokens[-1] = tb, ta
        e.table.tokens[a.row, len(a.tokens) - 1] = tb
        e.table.tokens[b.row, len(b.tokens) - 1] = ta
        ok = self.t.oracle_on
        return self.record(group="full", slot=-1, position=len(a.tokens) - 1, request_id=a.rid, expected=("write_token",),
                           expected_detectable=ok, why_not="" if ok else "no token oracle: the swapped history is self-consistent",
                           detail=f"last sampled tokens of {a.rid} and {b.rid} swapped")


def _node_depths(engine: SimEngine) -> dict:
    depth, stack = {}, [(n, 0) for n in engine.cache.root.children.values()]
    while stack:
        n, d = stack.pop()
        depth[n] = d
        stack += [(c, d + 1) for c in n.children.values()]
    return depth


class PrefixCollision(SimInjector):
    """A prefix-cache lookup returns the wrong block (a hash collision): the request's table maps one
    cached block's positions to another cached block at the same depth, holding other tokens."""

    fault = "prefix_collision"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        depth = _node_depths(e)
        cands = []
        for r in e.running:
            if r.state != "running" or r.max_new - r.generated < 2:
                continue
            for i, node in enumerate(r.path):
                for other, d in depth.items():
                    if d == i and other is not node and other.key != node.key and other.full_slots:
                        cands.append((r, i, other))
        if not cands:
            return None
        req, i, other = self.rng.choice(cands)
        b = e.config.block_size
        e.table.req_to_token[req.row, i * b : (i + 1) * b] = torch.tensor(other.full_slots, dtype=torch.int32)
        return self.record(group="full", slot=other.full_slots[0], position=i * b, request_id=req.rid,
                           expected=STRUCTURE, detail=f"block {i} of {req.rid} mapped to another cached block")


class CrossContextHit(SimInjector):
    """A request of another context (LoRA adapter / tenant / cache salt) reuses a cached prefix
    written under a different context, on identical tokens. The sim engine (like the bug) ignores
    contexts in its prefix cache; the batch's context key, mixed into the chain at position 0, makes the
    hit a chain mismatch."""

    fault = "cross_context_hit"

    def fire(self):
        e = self.t.engine
        nodes = [n for n in e.cache.nodes() if n.parent is e.cache.root and n.full_slots]
        if not nodes:
            return None
        node = self.rng.choice(nodes)
        prompt = list(node.key) + [self.rng.randrange(1, 32000) for _ in range(3)]
        rid = f"ctx{len(self.t.ledger)}@adapterB"
        e.add_request(prompt, 4, rid=rid, context=0xADA97E2B)  # adapter B; the cached prefix was written with none
        e.waiting.insert(0, e.waiting.pop())  # admitted next, while the node is still cached
        if self.t.register is not None:
            self.t.register(rid, prompt)
        return self.record(group="full", slot=node.full_slots[0], position=0, request_id=rid,
                           expected=("verify_chain_hash",), expected_detectable=True, why_not="",
                           detail=f"{rid} hits a block cached under another context")


class CopyCorruption(SimInjector):
    """A KV copy (offload/restore, fork) lands misaligned: a slot a running request reads receives
    the K/V bytes of a neighbouring slot, all layers."""

    fault = "copy_corruption"

    def fire(self):
        e = self.t.engine
        cands = unique_cached_positions(e)
        if not cands:
            return None
        req, p = self.rng.choice(cands)
        slot = req.full_slots[p]
        src = req.full_slots[p - 1] if p > 0 else req.full_slots[p + 1]
        saved = {key: (k[slot].clone(), v[slot].clone()) for key, (k, v) in e.kv.items() if key[0] == "full"}
        for key, (k, v) in e.kv.items():
            if key[0] == "full":
                k[slot], v[slot] = k[src], v[src]

        def undo():
            for key, (k0, v0) in saved.items():
                e.kv[key][0][slot], e.kv[key][1][slot] = k0, v0

        self._undo.append(undo)
        ok = bool(hashed_layers(self.t, "full"))
        return self.record(group="full", slot=slot, position=p, request_id=req.rid, expected=("verify_real_kv_hash",),
                           expected_detectable=ok, why_not="" if ok else "real-KV hashing is off",
                           detail=f"slot {slot} got the K/V of slot {src}")


class SwaWindowStale(SimInjector):
    """Sliding-window group: for one forward, a chunk whose window slides during the chunk reads a
    stale sliding-window slot at a position that leaves the window (the LUT points at a freed slot)."""

    fault = "swa_window_stale"
    needs_swa = True

    def fire(self):
        e = self.t.engine
        w = e.config.sliding_window
        cands = []
        for r in e.running:
            p = r.num_computed
            n = min(e.config.chunk_size, len(r.tokens) - p)
            if r.state != "running" or n < 2 or p < 2:
                continue
            lo, hi = max(0, p - w), min(p, p + n - w)  # read by the chunk's first queries, gone by its last
            cands += [(r, q) for q in range(lo, hi) if r.swa_slots[q] != 0]
        free = (~e.swa_alloc.in_use).nonzero().flatten().tolist()
        free = [s for s in free if s != 0]
        if not cands or not free:
            return None
        req, q = self.rng.choice(cands)
        stale = self.rng.choice(free)
        old = redirect_slot(e, req.rid, q, stale, group="swa")
        full = req.full_slots[q]
        self._undo.append(lambda: e.full_to_swa.__setitem__(full, old))
        return self.record(group="swa", slot=stale, position=q, request_id=req.rid, expected=STRUCTURE,
                           detail=f"position {q} of {req.rid} (leaving the window) read from freed swa slot {stale}")

    def after_forward(self):
        self.repair()


class SpecInjector(SimInjector):
    """Base of the speculative-decoding classes. The damage happens at an engine event (a verify forward, a
    rejection), not at once: the first `fire` arms it on a request that will decode for a while, later calls return
    None until it has happened (the runner steps on), then the `Injection`, dated at the first forward that can see
    it. A request that ends before the event is dropped and another armed."""

    needs_spec = True
    fresh_engine = True
    expected: tuple[str, ...] = ()

    def __init__(self, target: SimTarget, seed: int) -> None:
        super().__init__(target, seed)
        self._req = None
        self._hit: Optional[dict] = None  # step, slot, position, request_id, detail

    def fire(self):
        e = self.t.engine
        if self._hit is not None:
            hit, self._hit = self._hit, None
            return self.t.ledger.add(Injection(fault=self.fault, engine=ENGINE, expected=self.expected, group="full",
                                               **hit))
        if self._req is not None and self._req.state == "running":
            return None
        self._disarm()
        k = e.config.spec_tokens
        cands = [r for r in e.running if r.state == "running" and r.generated >= 1 and r.max_new - r.generated > 2 * k + 2]
        if cands:
            self._req = self.rng.choice(cands)
            self._arm(self._req)
        return None

    def _arm(self, req) -> None:
        raise NotImplementedError

    def _disarm(self) -> None:
        self.repair()
        self._req = None


class VerifyDraftKept(SpecInjector):
    """A rejection handled one iteration late: the first rejected draft's KV stays as the context of the position
    the bonus token now holds (every later position of the request builds on it)."""

    fault = "verify_draft_kept"
    expected = ("verify_token", "verify_chain_hash")

    def _arm(self, req) -> None:
        e = self.t.engine

        def kept(r, position, full, swa):
            keep_rejected_slot(e, r, position, full, swa)
            self._hit = dict(step=self.next_step, slot=full, position=position, request_id=r.rid,
                             detail=f"{r.rid}: rejected draft kept at position {position} (slot {full})")

        on_rejection(e, req.rid, kept)
        self._undo.append(lambda: vars(e).pop("_commit_verify", None))


class VerifyRollbackOffByOne(SpecInjector):
    """After a rejection the request's position counter is one too high: its next forward writes every token one
    position further than the rollback left it."""

    fault = "verify_rollback_off_by_one"
    expected = ("write_position", "verify_position")

    def _arm(self, req) -> None:
        e = self.t.engine

        def shifted(r, position, full, swa):
            e.batch_hooks.insert(0, shift_positions(r.rid, +1))
            self._hit = dict(step=self.next_step, slot=-1, position=position, request_id=r.rid,
                             detail=f"{r.rid}: positions +1 in the forward after the rejection at {position}")

        on_rejection(e, req.rid, shifted)
        self._undo.append(lambda: vars(e).pop("_commit_verify", None))


class VerifyDraftMisdirected(SpecInjector):
    """A verify forward writes a rejected draft's KV into a slot another running request reads (a stale slot
    mapping for the draft positions): that request's context is overwritten."""

    fault = "verify_draft_misdirected"
    expected = STRUCTURE + ("verify_real_kv_hash",)

    def _arm(self, req) -> None:
        e = self.t.engine

        def hook(batch):
            r = req
            if self._hit is not None or r.state != "running" or r.accepted >= len(r.drafts) \
                    or r.rid not in (batch.request_ids or ()):
                return batch
            victims = [(v, p) for v, p in unique_cached_positions(e) if v is not r and v.rid in batch.request_ids]
            if not victims:
                return batch
            victim, p = self.rng.choice(victims)
            slot = victim.full_slots[p]
            self._hit = dict(step=self.next_step, slot=slot, position=p, request_id=victim.rid,
                             detail=f"{r.rid}'s rejected draft {r.accepted + 1} written into slot {slot} "
                                    f"(position {p} of {victim.rid})")
            return redirect_write(r.rid, 1 + r.accepted, slot)(batch)

        e.batch_hooks.insert(0, hook)
        self._undo.append(lambda: e.batch_hooks.remove(hook))


class VerifyPositionsShifted(SpecInjector):
    """A verify forward's positions are shifted by one for one request (draft and verify positions misaligned)."""

    fault = "verify_positions_shifted"
    expected = ("write_position", "verify_position")

    def _arm(self, req) -> None:
        e = self.t.engine

        def hook(batch):
            if self._hit is not None or not req.drafts or req.rid not in (batch.request_ids or ()):
                return batch
            self._hit = dict(step=self.next_step, slot=-1, position=req.num_computed, request_id=req.rid,
                             detail=f"{req.rid}: verify forward of {len(req.drafts)} drafts at positions +1")
            return shift_positions(req.rid, +1)(batch)

        e.batch_hooks.insert(0, hook)
        self._undo.append(lambda: e.batch_hooks.remove(hook))


#: the engine-level fault classes by name; the campaign's full registry (`kvcanary.faults.sim_campaign.INJECTORS`)
#: adds the producer-identity classes of `kvcanary.faults.sim_identity`, which subclass `SimInjector`
CORE_INJECTORS = {cls.fault: cls for cls in (
    KvFlipUsed, KvFlipCached, KvFlipDeepLayer, SlotRedirect, UseAfterFree, PositionShift, TokenSwap,
    PrefixCollision, CrossContextHit, DoubleAlloc, CopyCorruption, SwaWindowStale,
    VerifyDraftKept, VerifyRollbackOffByOne, VerifyDraftMisdirected, VerifyPositionsShifted,
)}
