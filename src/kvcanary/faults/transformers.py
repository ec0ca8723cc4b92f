"""Fault injectors for transformers continuous batching (the engine `kvcanary.attach` checks).

Each injector is a forward pre-hook installed *before* the canary's (``prepend=True``): it sees the
forward's kwargs and the batch processor's requests, fires once after ``after_step`` forwards, and
appends an `Injection` to its ledger. Its generator is seeded; the canary never knows about it.

* `FlipUsedBlockByte` (``kv_flip_used``) — one bit of a block a request of this forward reads (its
  own earlier tokens), inside the fingerprinted bytes (first layer, first 16 K bytes);
* `FlipSharedBlockByte` (``kv_flip_cached``) — one bit of a cached shared-prefix block, just before
  the first forward of a request that reuses it;
* `RedirectRead` (``slot_redirect``) — for one forward, one cached position's read index points at
  another live slot (group ``full`` or ``swa``);
* `StaleWindowRead` (``swa_window_stale``) — sliding-window group, one forward whose chunk slides the
  window: one position the chunk's first queries read and that leaves the window during the chunk is read
  from a freed ring block still holding an earlier request's KV;
* `SwapInputTokens` (``token_swap``) — the input tokens of two decoding requests are swapped in one
  forward's ``input_ids`` (a sampled token routed to the wrong request): the KV written is self-consistent,
  only a token oracle (`kvcanary.faults.tf_oracle`, the adapter's ``token_oracle``) can tell.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvcanary.engines.transformers_cb.forward_view import find_batch_processor
from kvcanary.engines.transformers_cb.layout import FULL_ATTENTION, SLIDING_ATTENTION, build_layouts
from kvcanary.faults.ledger import FaultLedger, Injection

ENGINE = "transformers"


@dataclass
class _Injector:
    """Base: a forward pre-hook (run before the canary's) that fires once, after ``after_step``."""

    seed: int = 0
    after_step: int = 2
    ledger: FaultLedger = field(default_factory=FaultLedger)

    name = ""
    fault = ""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.step = 0
        self.seen: set[str] = set()
        self._hook = None
        self._owner = None  # (cache, its batch processor)

    def install(self, model) -> "_Injector":
        self._hook = model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True)
        return self

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _pre(self, module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is None:
            return None
        self.step += 1
        if self._owner is None or self._owner[0] is not cache:
            self._owner = (cache, find_batch_processor(cache))
        batch = list(self._owner[1].inputs_and_outputs.requests_in_batch)
        self.observe(cache, kwargs, batch)
        if not self.ledger and self.step > self.after_step:
            self.fire(cache, kwargs, batch)
        self.seen.update(fs.state.request_id for fs in batch)
        return None

    def record(self, **kw) -> Injection:
        return self.ledger.add(Injection(fault=self.fault, engine=ENGINE, step=self.step, **kw))

    def observe(self, cache, kwargs, batch) -> None:
        """Called before every forward (before `fire`); injectors that need history override it."""

    def fire(self, cache, kwargs, batch) -> None:
        raise NotImplementedError


def _flip(cache, alloc, block: int, offset: int, byte: int, bit: int) -> None:
    """Flip one bit of the first layer's K bytes of (block, offset) in the paged cache tensor."""
    kv = alloc.cache_tensor  # [tokens, 2, H, D]; layer rank 0 K page starts at the block's start
    per_token = kv.shape[-2] * kv.shape[-1] * kv.element_size()
    row = block * alloc.block_physical_stride + offset
    cache.cache_tensor[row * per_token + byte] ^= 1 << bit


class FlipSharedBlockByte(_Injector):
    """Flip one bit in the first 16 K bytes (layer 0) of a slot of a shared prefix block, just
    before the first forward of a request that reuses the block."""

    name = "flip_shared_block_byte"
    fault = "kv_flip_cached"

    def fire(self, cache, kwargs, batch) -> None:
        alloc = cache.cache_allocators.get(FULL_ATTENTION)
        if alloc is None or not cache.use_prefix_sharing:
            return
        ps = alloc.tokens_per_page
        reusers = [fs for fs in batch if fs.state.request_id not in self.seen
                   and fs.state.position_offset - fs.query_length >= ps]
        for fs in reusers:
            rid, prefix = fs.state.request_id, fs.state.position_offset - fs.query_length
            shared = alloc.block_table[rid][: prefix // ps]
            # prefer a block no other request of this forward reads, so the hit is unambiguous
            others = {b for o in batch if o.state.request_id != rid for b in alloc.block_table.get(o.state.request_id, [])}
            blocks = [b for b in shared if b not in others] or (shared if fs is reusers[-1] else [])
            if not blocks:
                continue
            block = self.rng.choice(blocks)
            offset, byte, bit = self.rng.randrange(ps), self.rng.randrange(16), self.rng.randrange(8)
            _flip(cache, alloc, block, offset, byte, bit)
            self.record(group="full", slot=block * ps + offset, position=-1, request_id=rid,
                        expected=("verify_real_kv_hash",),
                        detail=f"block {block} offset {offset} layer {alloc.layer_indices[0]} K byte {byte} bit {bit}")
            return


class FlipUsedBlockByte(_Injector):
    """Flip one bit in the first 16 K bytes (layer 0) of a slot holding one of a request's own earlier
    tokens, which this forward reads, in a block no other request of the forward reads."""

    name = "flip_used_block_byte"
    fault = "kv_flip_used"

    def fire(self, cache, kwargs, batch) -> None:
        alloc = cache.cache_allocators.get(FULL_ATTENTION)
        if alloc is None:
            return
        ps = alloc.tokens_per_page
        owners: dict[int, int] = {}
        for fs in batch:
            for b in alloc.block_table.get(fs.state.request_id, []):
                owners[b] = owners.get(b, 0) + 1
        cands = []
        for fs in batch:
            rid, prefix = fs.state.request_id, fs.state.position_offset - fs.query_length
            table = alloc.block_table.get(rid, [])
            cands += [(rid, q) for q in range(prefix) if q // ps < len(table) and owners[table[q // ps]] == 1]
        if not cands:
            return
        rid, q = self.rng.choice(cands)
        block, offset = alloc.block_table[rid][q // ps], q % ps
        byte, bit = self.rng.randrange(16), self.rng.randrange(8)
        _flip(cache, alloc, block, offset, byte, bit)
        self.record(group="full", slot=block * ps + offset, position=q, request_id=rid, expected=("verify_real_kv_hash",),
                    detail=f"position {q} of {rid}: block {block} offset {offset} layer {alloc.layer_indices[0]} "
                           f"K byte {byte} bit {bit}")


class RedirectRead(_Injector):
    """Point one cached position's read index at another live slot (another request's, or another
    position of the same request) in group ``group`` for one forward."""

    name = "redirect_read"
    fault = "slot_redirect"

    def __init__(self, group: str = "full", **kw) -> None:
        super().__init__(**kw)
        self.group = group

    def fire(self, cache, kwargs, batch) -> None:
        layer_type = FULL_ATTENTION if self.group == "full" else SLIDING_ATTENTION
        alloc = cache.cache_allocators.get(layer_type)
        layout = next((g for g in build_layouts(cache) if g.layer_type == layer_type), None)
        if alloc is None or kwargs.get("block_table") is not None or kwargs["read_index"][alloc.index].numel() == 0:
            return
        read = kwargs["read_index"][alloc.index]
        cu_k = kwargs["cu_seq_lens_k"][layer_type].tolist()
        window = layout.sliding_window
        rows = []  # (batch row, request id, first verified position, cached positions)
        for i, fs in enumerate(batch):
            p, e = fs.state.position_offset - fs.query_length, fs.query_length
            cached = min(p, window - 1) if window else p
            first = max(0, p + e - window) if window else 0
            if p - first >= 2:
                rows.append((i, fs.state.request_id, first, p, cached))
        if not rows:
            return
        i, rid, first, p, cached = self.rng.choice(rows)
        q = self.rng.randrange(max(first, 1), p)
        idx_q = cu_k[i] + (q - (p - cached))
        candidates = []
        for j, _, first_j, p_j, cached_j in rows:
            for q2 in range(first_j, p_j):
                idx = cu_k[j] + (q2 - (p_j - cached_j))
                if q2 != q and int(read[idx]) != int(read[idx_q]):
                    candidates.append((q2, idx))
        if not candidates:
            return
        q2, idx2 = self.rng.choice(candidates)
        phys = int(read[idx2])
        read[idx_q] = phys
        slot = int(layout.physical_to_slot(torch.tensor([phys]), for_write=False)[0])
        self.record(group=self.group, slot=slot, position=q, request_id=rid,
                    expected=("verify_position", "verify_chain_hash"),
                    detail=f"position {q} of {rid} read from the slot of position {q2} (slot {slot})")


STRUCTURE = ("verify_position", "verify_chain_hash", "verify_token")


class StaleWindowRead(_Injector):
    """Sliding-window group: in one forward whose chunk moves the window (``P + E > W``, ``E >= 2``), the read
    index of one position ``q`` the chunk's first queries read and that leaves the window during the chunk
    (``max(0, P - W + 1) <= q < P + E - W``) points at a freed ring block that earlier held another request's
    sliding-window KV (same in-page offset). Fires once a freed block is known."""

    name = "stale_window_read"
    fault = "swa_window_stale"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.blocks_seen: set[int] = set()  # sliding-window blocks some request held at an earlier forward

    def observe(self, cache, kwargs, batch) -> None:
        alloc = cache.cache_allocators.get(SLIDING_ATTENTION)
        if alloc is not None:
            self._used = {b for blocks in alloc.block_table.values() for b in blocks}
            self._freed = sorted(self.blocks_seen - self._used)
            self.blocks_seen |= self._used

    def fire(self, cache, kwargs, batch) -> None:
        alloc = cache.cache_allocators.get(SLIDING_ATTENTION)
        if alloc is None or not self._freed or kwargs.get("block_table") is not None:
            return
        read = kwargs["read_index"][alloc.index]
        if read.numel() == 0:
            return
        window, page = alloc.sliding_window, alloc.tokens_per_page
        cu_k = kwargs["cu_seq_lens_k"][SLIDING_ATTENTION].tolist()
        cands = []  # (batch row, request id, P, cached, q)
        for i, fs in enumerate(batch):
            e = fs.query_length
            p = fs.state.position_offset - e
            cached = min(p, window - 1)
            cands += [(i, fs.state.request_id, p, cached, q) for q in range(p - cached, min(p, p + e - window))]
        if not cands:
            return
        i, rid, p, cached, q = self.rng.choice(cands)
        block = self.rng.choice(self._freed)
        offset = (q % window) % page
        read[cu_k[i] + q - (p - cached)] = block * alloc.block_physical_stride + offset
        self.record(group="swa", slot=block * page + offset, position=q, request_id=rid, expected=STRUCTURE,
                    detail=f"position {q} of {rid} (P={p}, leaves the window during the chunk) read from freed "
                           f"sliding-window block {block} offset {offset}")


class SwapInputTokens(_Injector):
    """Swap the input tokens of two decoding requests (one token each, different values) in one forward's
    ``input_ids``; the engine's own request states keep the right tokens. ``oracle_on`` / ``committed_on``: whether
    the canary runs with a token oracle / with committed-token truth (``attach(committed_tokens=True)``, the
    default); with neither the swap is invisible (``expected_detectable`` False)."""

    name = "swap_input_tokens"
    fault = "token_swap"

    def __init__(self, oracle_on: bool = True, committed_on: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.oracle_on = oracle_on
        self.committed_on = committed_on

    def fire(self, cache, kwargs, batch) -> None:
        ids = kwargs["input_ids"][0]
        cu = kwargs["cu_seq_lens_q"].tolist()
        decoding = [(i, fs) for i, fs in enumerate(batch)
                    if fs.query_length == 1 and fs.state.position_offset - 1 >= len(fs.state.initial_tokens)]
        pairs = [(a, b) for k, a in enumerate(decoding) for b in decoding[k + 1 :]
                 if int(ids[cu[a[0]]]) != int(ids[cu[b[0]]])]
        if not pairs:
            return
        (ia, fa), (ib, fb) = self.rng.choice(pairs)
        ta, tb = int(ids[cu[ia]]), int(ids[cu[ib]])
        ids[cu[ia]], ids[cu[ib]] = tb, ta
        rid, position = fa.state.request_id, fa.state.position_offset - 1
        ok = self.oracle_on or self.committed_on
        self.record(group="full", slot=-1, position=position, request_id=rid, expected=("write_token",),
                    expected_detectable=ok, why_not="" if ok else "no token oracle and no committed-token truth: the "
                                                                  "swapped tokens are self-consistent",
                    detail=f"input tokens of {rid} (position {position}: {ta} -> {tb}) and {fb.state.request_id} "
                           f"(position {fb.state.position_offset - 1}: {tb} -> {ta}) swapped")


def match(injection: Injection, violations) -> Optional[dict]:
    """The first violation that detects ``injection``: same group, at or after its step, on its slot
    or charged to its request, with one of the expected reasons (at the earliest such step, one
    charged to the injected request is preferred)."""
    hits = []
    for v in violations:
        labels = set(v.reason_label.split("+"))
        if v.group != injection.group or v.step < injection.step or not labels & set(injection.expected):
            continue
        if v.slot == injection.slot or v.request_id == injection.request_id:
            hits.append((v.step, v.request_id != injection.request_id, v, labels))
    if not hits:
        return None
    step, _, v, labels = min(hits, key=lambda h: (h[0], h[1]))
    return {"reasons": sorted(labels), "request": v.request_id, "latency_forwards": step - injection.step,
            "step": step, "tag": v.launch_tag.name}
