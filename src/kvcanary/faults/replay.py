"""Replays: publicly reported kinds of KV-corruption bugs re-enacted as named bug modes of the
simulated engine, each with a clean twin (same seed, same forwards, no bug).

A bug mode is a sim injector (`kvcanary.faults.sim`) placed where the real bug strikes. A replay
runs a seeded engine, warms it, fires the mode once, runs a detection window and reports the first
violation that names the injected slot or request with an expected reason (`account`). ``caught``
also requires the violation to be charged to the injected request when the ledger names one.

``source`` names the public report a mode re-enacts when this project read the thread; other modes
re-enact a bug *class* described in issue 11's candidate list and say so (docs/replays.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.faults.accounting import Outcome, account
from kvcanary.faults.ledger import FaultLedger
from kvcanary.faults.sim import (STRUCTURE, CopyCorruption, CrossContextHit, DoubleAlloc, KvFlipUsed, PositionShift,
                                 PrefixCollision, SimInjector, SwaWindowStale, TokenSwap, UseAfterFree,
                                 running_requests, unique_cached_positions)
from kvcanary.faults.sim_campaign import SimCampaignConfig, SimDriver
from kvcanary.faults.sim_hooks import redirect_slot


class PrefixFreedWhileCached(SimInjector):
    """A prefix block is freed (abort/retract during chunked prefill) while the radix cache still
    holds it; the pages are reallocated, then a new request hits the cached prefix."""

    fault = "use_after_free"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        nodes = [n for n in e.cache.nodes() if n.lock_ref == 0 and not n.children]
        if not nodes:
            return None
        node = self.rng.choice(nodes)
        for s in node.full_slots:
            e.full_alloc.force_free(s)
        for _ in range(8):  # the freed pages are handed out and overwritten
            e.step()
            if all(e.full_alloc.in_use[s] for s in node.full_slots):
                break
        keys, n = [], node
        while n is not None and n is not e.cache.root:
            keys.insert(0, n.key)
            n = n.parent
        prompt = [t for k in keys for t in k] + [self.rng.randrange(1, 32000) for _ in range(4)]
        req = e.add_request(prompt, 4)
        e.waiting.insert(0, e.waiting.pop())  # admitted next: the hit happens in the window
        if self.t.register is not None:
            self.t.register(req.rid, prompt)
        return self.record(group="full", slot=node.full_slots[-1], position=len(keys) * e.config.block_size - 1,
                           request_id=req.rid,
                           expected=STRUCTURE + ("verify_real_kv_hash",),
                           detail=f"cached block freed and reused; {req.rid} hits it")


class BlockBoundaryOffByOne(SimInjector):
    """A request whose cached prefix ends exactly on a block boundary maps the boundary position to
    the slot of the position before it (off by one where the cached and new blocks meet)."""

    fault = "slot_redirect"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        cands = [r for r in running_requests(e) if r.own_from >= 2]
        if not cands:
            return None
        req = self.rng.choice(cands)
        p = req.own_from - 1
        to = req.full_slots[p - 1]
        redirect_slot(e, req.rid, p, to)
        return self.record(group="full", slot=to, position=p, request_id=req.rid, expected=STRUCTURE,
                           detail=f"boundary position {p} of {req.rid} maps to the slot of position {p - 1}")


class LockedPrefixEvicted(SimInjector):
    """The prefix cache evicts a block a running request still uses (a lock refcount off by one):
    its slots go back to the allocator and the next allocation overwrites them."""

    fault = "use_after_free"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        cands = [(r, i) for r in e.running if r.state == "running" and r.max_new - r.generated >= 2
                 for i in range(len(r.path))]
        if not cands:
            return None
        req, i = self.rng.choice(cands)
        for s in req.path[i].full_slots:
            e.full_alloc.force_free(s)
        b = e.config.block_size
        return self.record(group="full", slot=req.path[i].full_slots[0], position=i * b, request_id=req.rid,
                           expected=STRUCTURE + ("verify_real_kv_hash",),
                           detail=f"block {i} of {req.rid}'s cached prefix evicted while locked")


class ZeroBlockTransfer(SimInjector):
    """A KV transfer (disaggregated prefill -> decode) delivers an all-zero block for a request."""

    fault = "copy_corruption"

    def fire(self):
        e = self.t.engine
        cands = unique_cached_positions(e)
        if not cands:
            return None
        req, p = self.rng.choice(cands)
        b = e.config.block_size
        lo = (p // b) * b
        slots = [req.full_slots[q] for q in range(lo, min(lo + b, req.num_computed))]
        for key, (k, v) in e.kv.items():
            if key[0] == "full":
                k[slots] = 0
                v[slots] = 0
        return self.record(group="full", slot=slots[0], position=lo, request_id=req.rid, expected=("verify_real_kv_hash",),
                           detail=f"block at positions {lo}.. of {req.rid} arrives all zero")


class _BatchHookInjector(SimInjector):
    """Base for bugs that corrupt the next forward's batch (one shot)."""

    def install(self, hook) -> None:
        e = self.t.engine
        fired = []

        def once(batch):
            if fired:
                return batch
            fired.append(True)
            return hook(batch)

        e.batch_hooks.insert(0, once)


class KvWriteSkipped(_BatchHookInjector):
    """A token's KV store is skipped (its write slot dropped from the forward) although the table
    maps its position: the slot keeps a previous occupant's KV."""

    fault = "use_after_free"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        cands = [r for r in running_requests(e, tokens_left=3) if r.num_computed >= 2]
        if not cands:
            return None
        req = self.rng.choice(cands)
        rid = req.rid

        def hook(batch):
            r = batch.request_ids.index(rid)
            start = int(batch.extend_lens[:r].sum())
            gb = batch.groups["full"]
            loc = gb.out_cache_loc.clone()
            loc[start] = -1
            return dataclasses.replace(batch, groups={**batch.groups, "full": dataclasses.replace(gb, out_cache_loc=loc)})

        if rid not in [r.rid for r in e.running]:
            return None
        self.install(hook)
        return self.record(group="full", slot=-1, position=req.num_computed, request_id=rid,
                           expected=STRUCTURE + ("verify_real_kv_hash",),
                           detail=f"{rid}: KV of position {req.num_computed} not stored")


class WriteToForeignSlot(_BatchHookInjector):
    """A fork shares a block without copy-on-write: one request's new token is stored into a slot
    another running request still reads."""

    fault = "double_alloc"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        cands = unique_cached_positions(e, own_only=True)
        writers = running_requests(e)
        pairs = [(w, v, p) for w in writers for v, p in cands if v is not w]
        if not pairs:
            return None
        w, victim, p = self.rng.choice(pairs)
        slot = victim.full_slots[p]

        def hook(batch):
            if w.rid not in batch.request_ids:
                return batch
            r = batch.request_ids.index(w.rid)
            start = int(batch.extend_lens[:r].sum())
            gb = batch.groups["full"]
            loc = gb.out_cache_loc.clone()
            loc[start] = slot
            return dataclasses.replace(batch, groups={**batch.groups, "full": dataclasses.replace(gb, out_cache_loc=loc)})

        self.install(hook)
        return self.record(group="full", slot=slot, position=p, request_id=victim.rid,
                           expected=STRUCTURE + ("verify_real_kv_hash",),
                           detail=f"{w.rid} stores a token into slot {slot} (position {p} of {victim.rid})")


class SwaSlotFreedInWindow(SimInjector):
    """Sliding-window group: a slot still inside the window is freed early (eviction ignores the
    window size) and reused by the next allocation."""

    fault = "swa_window_stale"
    fresh_engine = True
    needs_swa = True

    def fire(self):
        e = self.t.engine
        w = e.config.sliding_window
        cands = [(r, q) for r in e.running if r.state == "running" and r.max_new - r.generated >= 3
                 for q in range(max(r.own_from, r.num_computed - w + 2), r.num_computed) if r.swa_slots[q] != 0]
        if not cands:
            return None
        req, q = self.rng.choice(cands)
        slot = req.swa_slots[q]
        e.swa_alloc.force_free(slot)
        return self.record(group="swa", slot=slot, position=q, request_id=req.rid,
                           expected=STRUCTURE + ("verify_real_kv_hash",),
                           detail=f"swa slot {slot} (position {q} of {req.rid}, inside the window) freed early")


class StaleTableAfterRetract(SimInjector):
    """After a retraction the table keeps one of the retracted request's freed slots for a position
    of a running request (a stale block-table entry not refreshed on reschedule)."""

    fault = "slot_redirect"
    fresh_engine = True

    def fire(self):
        e = self.t.engine
        cands = unique_cached_positions(e, own_only=True)
        others = [r for r in e.running if r.num_computed >= 4]
        if not cands or len(others) < 2:
            return None
        req, p = self.rng.choice(cands)
        victim = next((r for r in others if r is not req), None)
        freed = victim.full_slots[victim.own_from: victim.num_computed]
        if not freed:
            return None
        e.retract(victim)
        to = self.rng.choice(freed)
        redirect_slot(e, req.rid, p, to)
        return self.record(group="full", slot=to, position=p, request_id=req.rid, expected=STRUCTURE,
                           detail=f"position {p} of {req.rid} maps to slot {to}, freed by retracting {victim.rid}")


@dataclass(frozen=True, kw_only=True)
class BugMode:
    name: str
    injector: type
    engines: tuple[str, ...]
    source: str  # the public report, when this project read it; else the bug class it mirrors
    mechanism: str
    expect_caught: bool = True


BUG_MODES = {m.name: m for m in (
    BugMode(name="vllm-37076-uaf-under-eviction", injector=UseAfterFree, engines=("sim",),
            source="vllm-project/vllm#37076 (use-after-free in the KV block allocator under eviction pressure)",
            mechanism="a block still referenced by a running request is freed and reallocated"),
    BugMode(name="sglang-38319-chunk-radix-race", injector=PrefixFreedWhileCached, engines=("sim",),
            source="sgl-project/sglang#38319 (chunked-prefill radix insert vs retract/abort frees pages)",
            mechanism="pages inserted into the radix cache are freed on abort; a later prefix hit reads reused pages"),
    BugMode(name="sglang-22819-block-boundary", injector=BlockBoundaryOffByOne, engines=("sim",),
            source="sgl-project/sglang#22819 (corruption when prefix_len == block size; re-enacted as an off-by-one "
                   "at the cached/new boundary)",
            mechanism="the last cached position maps to its predecessor's slot"),
    BugMode(name="locked-prefix-evicted", injector=LockedPrefixEvicted, engines=("sim",),
            source="bug class: prefix-cache eviction of a block in use (refcount / lock off by one)",
            mechanism="a cached block a running request uses is evicted and reallocated"),
    BugMode(name="prefix-hash-collision", injector=PrefixCollision, engines=("sim",),
            source="bug class: prefix-cache block hash collision / wrong block reused",
            mechanism="a prefix lookup returns another cached block at the same depth"),
    BugMode(name="double-free-shared-prefix", injector=DoubleAlloc, engines=("sim",),
            source="bug class: shared prefix block freed twice, allocator hands it out while cached",
            mechanism="a cached-prefix slot is allocated to a second owner"),
    BugMode(name="fork-without-cow", injector=WriteToForeignSlot, engines=("sim",),
            source="bug class: fork / beam / parallel sampling shares a block without copy-on-write",
            mechanism="a request stores a new token into a slot another request reads"),
    BugMode(name="kv-store-skipped", injector=KvWriteSkipped, engines=("sim",),
            source="bug class: KV store skipped for a token (padding / cuda-graph batch mismatch)",
            mechanism="the table maps a position whose KV was never stored"),
    BugMode(name="stale-table-after-retract", injector=StaleTableAfterRetract, engines=("sim",),
            source="bug class: block table not refreshed after preemption / retraction",
            mechanism="a position maps to a slot freed by a retracted request"),
    BugMode(name="offload-restore-misaligned", injector=CopyCorruption, engines=("sim",),
            source="bug class: KV offload/restore copies into the wrong offset (LMCache-style connectors)",
            mechanism="a slot receives a neighbouring slot's K/V bytes"),
    BugMode(name="transfer-all-zero-block", injector=ZeroBlockTransfer, engines=("sim",),
            source="bug class: disaggregated KV transfer delivers all-zero blocks (NIXL-style)",
            mechanism="a block of a running request becomes all zeros"),
    BugMode(name="hbm-bit-flip-in-use", injector=KvFlipUsed, engines=("sim", "transformers"),
            source="bug class: a kernel / DMA flips bits of KV in use",
            mechanism="one bit of a read slot's fingerprinted bytes flips"),
    BugMode(name="sampler-row-mixup", injector=TokenSwap, engines=("sim",),
            source="bug class: sampled tokens routed to the wrong request (batch row reorder)",
            mechanism="two decoding requests' sampled tokens are swapped (caught by the token oracle)"),
    BugMode(name="position-off-by-one", injector=PositionShift, engines=("sim",),
            source="bug class: positions off by one (rope offset after a cache hit / spec-decode rollback)",
            mechanism="one forward writes a request's tokens one position too far"),
    BugMode(name="swa-evict-inside-window", injector=SwaSlotFreedInWindow, engines=("sim",),
            source="bug class: sliding-window eviction ignores the window (e.g. SGLang chunk-cache SWA eviction)",
            mechanism="a sliding-window slot inside the window is freed and reused"),
    BugMode(name="swa-lut-stale-chunk", injector=SwaWindowStale, engines=("sim",),
            source="bug class: chunk across the window edge reads a stale sliding-window slot",
            mechanism="the full->swa LUT of a position leaving the window points at a freed slot"),
    BugMode(name="lora-cross-adapter-hit", injector=CrossContextHit, engines=("sim",),
            source="bug class: prefix-cache hit across LoRA adapters / tenants / cache salts",
            mechanism="identical tokens under another context reuse the cached prefix (context keys in the chain)"),
)}


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    mode: BugMode
    outcome: Optional[Outcome]
    clean_forwards: int
    clean_violations: int

    @property
    def caught(self) -> bool:
        o = self.outcome
        return o is not None and o.detected and (o.injection.request_id is None or o.request_id == o.injection.request_id)

    def to_json(self) -> dict:
        o = self.outcome
        return {
            "bug": self.mode.name, "source": self.mode.source, "mechanism": self.mode.mechanism,
            "expect_caught": self.mode.expect_caught, "caught": self.caught,
            "injected": o.injection.to_json() if o else None,
            "reasons": list(o.reasons) if o else [], "detected_by": list(o.detected_by) if o else [],
            "forward": (o.injection.step + o.latency_forwards) if o and o.detected else None,
            "latency_forwards": o.latency_forwards if o else None,
            "request": o.request_id if o else None,
            "clean": {"forwards": self.clean_forwards, "violations": self.clean_violations},
        }


def run_replay(name: str, *, seed: int = 0, real_kv_hash: str = "partial") -> ReplayResult:
    """Replay bug mode ``name`` once (and its clean twin) on the simulated engine."""
    if name not in BUG_MODES:
        raise KvCanaryValueError(f"kv-canary: unknown bug mode {name!r} (known: {', '.join(BUG_MODES)})")
    mode = BUG_MODES[name]
    cfg = SimCampaignConfig(seed=seed, per_class=1, real_kv_hash=real_kv_hash, max_tries=80)
    engine_seed = seed * 1000 + sorted(BUG_MODES).index(name)
    swa = getattr(mode.injector, "needs_swa", False)
    driver = SimDriver(cfg, engine_seed, swa=swa)
    ledger = FaultLedger()
    injector = mode.injector(driver.target(ledger), seed=engine_seed)
    for _ in range(cfg.warm):
        driver.step()
    inj = None
    for _ in range(cfg.max_tries):
        inj = injector.fire()
        if inj is not None:
            break
        driver.step()
    outcome = None
    if inj is not None:
        driver.step()
        injector.after_forward()
        for _ in range(cfg.window - 1):
            driver.step()
        outcome = account(inj, driver.canary.violations())
    twin = SimDriver(cfg, engine_seed, swa=swa)
    while twin.engine.forwards < driver.engine.forwards:
        twin.step()
    return ReplayResult(mode=mode, outcome=outcome, clean_forwards=twin.engine.forwards,
                        clean_violations=len(twin.canary.violations()))
