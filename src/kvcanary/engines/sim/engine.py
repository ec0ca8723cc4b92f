"""`SimEngine`: scheduler, KV pools and forward of the simulated engine.

One `step()`:

    admit waiting requests (row + longest cached prefix, window-checked for the SWA group)
    per running request: allocate slots for its next chunk (evict cached prefixes, else retract)
    build the BatchDescription          -> batch hooks (fault injection) may rewrite it
    with canary.forward(batch):         -> the "model": KV bytes of every layer into out_cache_loc
    advance: sample, finish (insert into the prefix cache), abort, drop out-of-window SWA slots

Speculative decoding (``spec_tokens = k > 0``): a decoding request's forward is a *verify* of ``k + 1`` tokens — its
last committed token and ``k`` seeded drafts at the next positions. Each draft is accepted with ``spec_accept``, in
order, up to the first rejection; the accepted drafts and a bonus token (the target's own sample at the first rejected
position) are committed, and the rejected positions are rolled back: their slots freed (`Canary.release_slots`), the
request's computed length reset to its committed tokens. The token table holds the committed tokens (what the user
receives) and, during a verify forward, the drafts past them; ``committed_lens`` says where the drafts start.

Producer identity (`engines/sim/identity.py`): a request may carry a `ProducerIdentity` (adapter, salt, context) and
images; its context key is issued at admission under the engine's current weights version (``update_weights``), and
the engine's own prefix-cache key holds the identity fields named by ``SimConfig.cache_key_fields``.

Layers: with ``sliding_window == 0`` every layer is full attention (group ``full``); otherwise even
layers are full and odd layers sliding-window (group ``swa``, own slot space, full->swa LUT).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.engines.sim.forward_view import describe
from kvcanary.engines.sim.identity import SimImage, cache_key, check_key_fields, model_tokens, producer
from kvcanary.engines.sim.pool import PADDING_SLOT, RequestTable, SlotAllocator
from kvcanary.engines.sim.radix import RadixCache, RadixNode
from kvcanary.engines.sim.workload import SimWorkload
from kvcanary.ops.hashing import splitmix64_mix3_tensor, splitmix64_tensor
from kvcanary.runtime import BatchDescription, GroupSpec
from kvcanary.runtime.identity import ProducerIdentity, identity_key

BatchHook = Callable[[BatchDescription], BatchDescription]


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Pool sizes and scheduling limits. kv_bytes: bytes per token per layer and side. device: where the
    KV pools and tables live (the scheduler is host Python; per-forward index arrays are built on the host).
    spec_tokens: drafts proposed per decode step (speculative decoding; 0 = off); spec_accept: the chance each
    draft is accepted, in order (the first rejection ends the accepted run). cache_key_fields: what the prefix
    cache's key holds besides token ids (`engines/sim/identity.py` ``KEY_FIELDS``); the default keys images but
    ignores adapter, salt, context and weights version, as engines that shipped those bugs did."""

    num_slots: int = 2048
    swa_num_slots: int = 512
    sliding_window: int = 0
    max_requests: int = 32
    max_context: int = 256
    block_size: int = 4
    num_layers: int = 4
    kv_bytes: int = 32
    chunk_size: int = 48
    max_batch_tokens: int = 192
    max_running: int = 12
    spec_tokens: int = 0
    spec_accept: float = 0.7
    seed: int = 0
    device: str = "cpu"
    cache_key_fields: tuple[str, ...] = ("images",)

    def __post_init__(self) -> None:
        check_key_fields(self.cache_key_fields)
        if self.kv_bytes % 16 or self.kv_bytes <= 0:
            raise KvCanaryValueError(f"kv-canary: SimConfig.kv_bytes must be a positive multiple of 16, got {self.kv_bytes}")
        if self.sliding_window and self.num_layers < 2:
            raise KvCanaryValueError("kv-canary: SimConfig with sliding_window needs num_layers >= 2")
        if self.spec_tokens < 0 or not 0.0 <= self.spec_accept <= 1.0:
            raise KvCanaryValueError(f"kv-canary: SimConfig needs spec_tokens >= 0 and 0 <= spec_accept <= 1, got "
                                     f"{self.spec_tokens} / {self.spec_accept}")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(range(0, self.num_layers, 2 if self.sliding_window else 1))

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(range(1, self.num_layers, 2)) if self.sliding_window else ()

    def group_specs(self) -> list[GroupSpec]:
        specs = [GroupSpec(name="full", num_slots=self.num_slots, layer_ids=self.full_layers)]
        if self.sliding_window:
            specs.append(GroupSpec(name="swa", num_slots=self.swa_num_slots, sliding_window=self.sliding_window,
                                   layer_ids=self.swa_layers))
        return specs


@dataclass(eq=False)
class SimRequest:
    rid: str
    tokens: list[int]
    max_new: int
    row: int = 0
    num_computed: int = 0
    generated: int = 0
    own_from: int = 0
    full_slots: list[int] = field(default_factory=list)
    swa_slots: list[int] = field(default_factory=list)
    swa_dropped_upto: int = 0
    path: list[RadixNode] = field(default_factory=list)
    state: str = "waiting"
    context: int = 0  # the context key of its producer identity (issued at admission); 0 = none
    identity: ProducerIdentity = field(default_factory=ProducerIdentity)  # adapter / salt / context given
    images: tuple[SimImage, ...] = ()
    weights_version: int = 0  # the engine's weights version when the request was admitted
    drafts: list[int] = field(default_factory=list)  # this forward's speculative drafts (verify forward), else []
    accepted: int = 0  # how many of ``drafts`` the target accepts (drawn with them)
    bonus: int = 0  # the target's token at the first rejected position (or after the last draft)


def kv_bytes(tokens: torch.Tensor, positions: torch.Tensor, layer: int, side: int, nbytes: int) -> torch.Tensor:
    """Deterministic "K/V" of tokens at positions: uint8 [n, nbytes]."""
    return kv_bytes_all(tokens, positions, torch.tensor([layer * 2 + side], dtype=torch.int64, device=tokens.device),
                        nbytes)[:, 0]


def kv_bytes_all(tokens: torch.Tensor, positions: torch.Tensor, sides: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`kv_bytes` of every (layer, side) in ``sides`` (int64 [S] of ``layer * 2 + side``) at once: uint8
    [n, S, nbytes]. Word j of a row is ``splitmix64(mix3(token, position, layer * 2 + side) + j)``."""
    h = splitmix64_mix3_tensor(tokens.to(torch.int64)[:, None], positions.to(torch.int64)[:, None], sides[None, :])
    words = splitmix64_tensor(h[:, :, None] + torch.arange(nbytes // 8, dtype=torch.int64, device=h.device))
    return words.view(torch.uint8).reshape(h.shape[0], h.shape[1], nbytes)


class SimEngine:
    """The simulated engine. ``canary`` (a `kvcanary.runtime.Canary` or None) brackets each forward."""

    def __init__(self, config: SimConfig, canary=None) -> None:
        self.config = c = config
        self.rng = random.Random(c.seed)
        self.device = dev = torch.device(c.device)
        self.table = RequestTable(c.max_requests, c.max_context, device=dev)
        self.full_alloc = SlotAllocator(c.num_slots)
        self.swa_alloc = SlotAllocator(c.swa_num_slots) if c.sliding_window else None
        self.full_to_swa = torch.zeros(c.num_slots, dtype=torch.int64, device=dev)
        self.cache = RadixCache(c.block_size)
        self.kv = {  # (group, layer) -> (k, v), uint8 [group slots, kv_bytes]
            (g, layer): tuple(torch.zeros(n, c.kv_bytes, dtype=torch.uint8, device=dev) for _ in "kv")
            for g, layers, n in (("full", c.full_layers, c.num_slots), ("swa", c.swa_layers, c.swa_num_slots))
            for layer in layers
        }
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.finished = 0
        self.aborted = 0
        self.retracted = 0
        self.evicted_blocks = 0
        self.cache_hit_tokens = 0
        self.forwards = 0
        self.batch_hooks: list[BatchHook] = []
        self.sampler: Optional[Callable[[str, int], int]] = None  # (request id, position) -> token; None = seeded random
        self._next_rid = 0
        self._contexts_used = False
        self.weights_version = 0
        self.key_fields = set(c.cache_key_fields)  # mutable: fault injectors drop a field to re-enact a bug
        self.canary = None
        if canary is not None:
            self.attach(canary)

    # ---- canary wiring (what a real adapter does) -----------------------------------------------
    def attach(self, canary) -> None:
        self.canary = canary
        for g in ("full", "swa") if self.swa_alloc else ("full",):
            canary.set_kv_cache(g, {layer: kv for (grp, layer), kv in self.kv.items() if grp == g})
        canary.set_live_slots_provider(self.live_slots)

    def live_slots(self) -> dict[str, torch.Tensor]:
        """The canary's live-slots provider: each allocator's in-use mask (bool [num_slots], host memory)."""
        live = {"full": self.full_alloc.in_use}
        if self.swa_alloc:
            live["swa"] = self.swa_alloc.in_use
        return live

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: list[int], max_new: int, rid: Optional[str] = None, *, context: int = 0,
                    identity: Optional[ProducerIdentity] = None, images: tuple[SimImage, ...] = ()) -> SimRequest:
        """Queue a request. ``context``: an opaque adapter / tenant / salt key (shorthand for
        ``identity=ProducerIdentity(context=context)``); ``identity``: its producer identity; ``images``: its
        multimodal items (their positions in ``prompt`` hold the placeholder id). The prefix cache keys the fields of
        ``cache_key_fields``; the batch hands the issued key to the canary as ``context_keys``."""
        if not prompt or len(prompt) + max_new > self.config.max_context:
            raise KvCanaryValueError(f"kv-canary: sim request needs 1 <= prompt and prompt + max_new <= {self.config.max_context}")
        if context and identity is not None:
            raise KvCanaryValueError("kv-canary: sim request takes context or identity, not both")
        ident = identity if identity is not None else ProducerIdentity(context=context or None)
        req = SimRequest(rid=rid or f"r{self._next_rid}", tokens=model_tokens(prompt, images), max_new=max_new,
                         identity=ident, images=tuple(images))
        self._next_rid += 1
        self.waiting.append(req)
        return req

    def request(self, rid: str) -> SimRequest:
        for r in self.running:
            if r.rid == rid:
                return r
        raise KeyError(f"no running request {rid!r}")

    def _admit(self) -> None:
        c = self.config
        while self.waiting and len(self.running) < c.max_running and self.table.num_free:
            req = self.waiting.pop(0)
            req.row = self.table.alloc_row()
            req.weights_version = self.weights_version
            req.context = self.issue_key(req)
            path = self.cache.match(self.cache_key(req), len(req.tokens) - 1)
            if c.sliding_window:
                while path and not self._window_alive(path):
                    path.pop()
            RadixCache.lock(path, +1)
            req.path = path
            req.full_slots = [s for n in path for s in n.full_slots]
            req.swa_slots = [s for n in path for s in n.swa_slots]
            req.num_computed = req.own_from = len(req.full_slots)
            self.cache_hit_tokens += req.own_from
            req.swa_dropped_upto = req.own_from
            req.state = "running"
            n = len(req.tokens)
            self.table.tokens[req.row, :n] = torch.tensor(req.tokens, dtype=torch.int32)
            if req.full_slots:
                self.table.req_to_token[req.row, : len(req.full_slots)] = torch.tensor(req.full_slots, dtype=torch.int32)
            self.running.append(req)

    def issue_key(self, req: SimRequest) -> int:
        """The context key of ``req``'s producer (its identity under its weights version), registered with the
        canary's identities when attached (so violations name what differed)."""
        ident = producer(req.identity, req.weights_version)
        key = self.canary.identities.issue(ident) if self.canary is not None else identity_key(ident)
        self._contexts_used = self._contexts_used or key != 0
        return key

    def cache_key(self, req: SimRequest) -> list:
        """The prefix cache's key of ``req``'s tokens (`engines/sim/identity.py`)."""
        return cache_key(req.tokens, req.images, producer(req.identity, req.weights_version), self.key_fields)

    def update_weights(self, *, reset_prefix_cache: bool = True) -> None:
        """New model weights, in place, between steps: the weights version goes up (KV computed from now on differs).
        With ``reset_prefix_cache`` the engine does what a correct one does: running requests are retracted (they
        recompute under the new weights) and every cached prefix is dropped. Without it the cache survives: right only
        when ``weights_version`` is in the cache key (old blocks then never match), else the stale-prefix bug."""
        self.weights_version += 1
        if reset_prefix_cache:
            for req in list(self.running):
                self.retract(req)
            self._evict(self.config.num_slots)

    def _window_alive(self, path: list[RadixNode]) -> bool:
        swa = [s for n in path for s in n.swa_slots]
        return all(s != PADDING_SLOT for s in swa[max(0, len(swa) - self.config.sliding_window):])

    # ---- memory -------------------------------------------------------------------------------
    def _alloc(self, n: int) -> Optional[tuple[list[int], list[int]]]:
        """``n`` full (+ swa) slots, evicting cached prefixes if needed; None if impossible."""
        for alloc in (self.full_alloc, self.swa_alloc):
            if alloc is not None and alloc.num_free < n:
                self._evict(n - alloc.num_free)
        if self.full_alloc.num_free < n or (self.swa_alloc and self.swa_alloc.num_free < n):
            return None
        full = self.full_alloc.alloc(n)
        swa = self.swa_alloc.alloc(n) if self.swa_alloc else [0] * n
        return full, swa

    def _evict(self, needed: int) -> None:
        for node in self.cache.evict(needed):
            self.evicted_blocks += 1
            self._free(node.full_slots, node.swa_slots)

    def _free(self, full: list[int], swa: list[int]) -> None:
        self.full_alloc.free(full)
        if self.swa_alloc:
            live_swa = [s for s in swa if s != PADDING_SLOT]
            self.swa_alloc.free(live_swa)
            if full:
                self.full_to_swa[full] = 0

    def _release(self, req: SimRequest) -> None:
        """Free what the request owns (not its cached prefix), unlock the prefix, free the row."""
        own = slice(req.own_from, None)
        self._free(req.full_slots[own], req.swa_slots[own])
        RadixCache.lock(req.path, -1)
        self.table.free_row(req.row)
        self.running.remove(req)

    def retract(self, req: SimRequest) -> None:
        """Put a running request back in the queue; it recomputes from scratch (minus cache hits)."""
        self._release(req)
        self.retracted += 1
        req.state, req.num_computed, req.path, req.full_slots, req.swa_slots = "waiting", 0, [], [], []
        self.waiting.insert(0, req)

    def abort(self, req: SimRequest) -> None:
        self._release(req)
        self.aborted += 1
        req.state = "aborted"

    def _finish(self, req: SimRequest) -> None:
        n_blocks = req.num_computed // self.config.block_size
        dup_full, dup_swa = self.cache.insert(self.cache_key(req), req.full_slots, req.swa_slots, n_blocks, req.path)
        self._free(dup_full, dup_swa)
        tail = n_blocks * self.config.block_size
        self._free(req.full_slots[tail:], req.swa_slots[tail:])
        RadixCache.lock(req.path, -1)
        self.table.free_row(req.row)
        self.running.remove(req)
        self.finished += 1
        req.state = "finished"

    # ---- one forward ----------------------------------------------------------------------------
    def step(self) -> Optional[BatchDescription]:
        """Schedule and run one forward; returns its batch (None when idle)."""
        c = self.config
        self._admit()
        plan: list[tuple[SimRequest, int, list[int], list[int]]] = []
        budget = c.max_batch_tokens
        for req in list(self.running):
            if req.state != "running" or budget <= 0:
                continue
            e = min(c.chunk_size, len(req.tokens) - req.num_computed, budget)
            self._draft(req, budget)
            e += len(req.drafts)
            got = self._alloc(e)
            if got is None and req.drafts:  # speculation is best-effort: decode plainly before preempting anyone
                e -= len(req.drafts)
                req.drafts = []
                got = self._alloc(e)
            while got is None:
                victims = [r for r in self.running if r is not req and r not in [p[0] for p in plan]]
                if not victims:
                    break
                self.retract(victims[-1])
                got = self._alloc(e)
            if got is None:
                req.drafts = []
                self.retract(req)
                continue
            full, swa = got
            p = req.num_computed
            req.full_slots += full
            req.swa_slots += swa
            plan.append((req, e, full, swa))
            budget -= e
        if not plan:
            return None
        self._map_slots(plan)
        batch = self._batch(plan)
        for hook in self.batch_hooks:
            batch = hook(batch)
        self.forwards += 1
        if self.canary is not None:
            with self.canary.forward(batch):
                self._model(batch)
        else:
            self._model(batch)
        if self.canary is not None:
            self.canary.note_engine_forward()
        self._advance(plan)
        return batch

    def _decoding(self, req: SimRequest) -> bool:
        """The request's next forward computes its newest token only (it has generated, and its prompt is cached)."""
        return req.generated > 0 and req.num_computed == len(req.tokens) - 1

    def _draft(self, req: SimRequest, budget: int) -> None:
        """Speculative decoding: draw this step's drafts, how many the target accepts, and the bonus token. The first
        rejected draft differs from the target's token there; the bonus is that token. Nothing when off, or when the
        request has no room (``max_new``, the batch budget)."""
        req.drafts, req.accepted = [], 0
        k = min(self.config.spec_tokens, req.max_new - req.generated - 1, budget - 1)
        if k <= 0 or not self._decoding(req):
            return
        accepted = 0
        while accepted < k and self.rng.random() < self.config.spec_accept:
            accepted += 1
        base = len(req.tokens)
        truth = [self._sample(req, base + j) for j in range(accepted + 1)]
        drafts = truth[:accepted]
        if accepted < k:
            drafts.append(truth[accepted] % 31999 + 1)  # != truth[accepted]
            drafts += [self.rng.randrange(1, 32000) for _ in range(k - accepted - 1)]
        req.drafts, req.accepted, req.bonus = drafts, accepted, truth[accepted]
        self.table.tokens[req.row, base : base + k] = torch.tensor(drafts, dtype=torch.int32)

    def _sample_next(self, req: SimRequest) -> bool:
        """Every token of ``req`` is computed: finish it at ``max_new`` (False), else sample and commit its next
        token (True)."""
        if req.generated >= req.max_new:
            self._finish(req)
            return False
        tok = self._sample(req, len(req.tokens))
        self.table.tokens[req.row, len(req.tokens)] = tok
        req.tokens.append(tok)
        req.generated += 1
        return True

    def _sample(self, req: SimRequest, position: int) -> int:
        return self.sampler(req.rid, position) if self.sampler is not None else self.rng.randrange(1, 32000)

    def _map_slots(self, plan) -> None:
        """Table rows (and the full -> swa LUT) for the plan's new slots: one host-to-device copy each."""
        rows = [r.row for r, e, _, _ in plan for _ in range(e)]
        cols = [r.num_computed + i for r, e, _, _ in plan for i in range(e)]
        full = [s for p in plan for s in p[2]]
        idx = torch.tensor([rows, cols, full], dtype=torch.int64).to(self.device)
        self.table.req_to_token[idx[0], idx[1]] = idx[2].to(torch.int32)
        if self.swa_alloc:
            self.full_to_swa[idx[2]] = torch.tensor([s for p in plan for s in p[3]], dtype=torch.int64).to(self.device)

    def _batch(self, plan) -> BatchDescription:
        return describe(plan, table=self.table, full_to_swa=self.full_to_swa if self.swa_alloc else None,
                        contexts=self._contexts_used)

    def _model(self, batch: BatchDescription) -> None:
        """Store every layer's K and V for the batch's tokens at the batch's slots."""
        dev = self.device
        stored = {}
        for group, gb in batch.groups.items():
            loc = gb.out_cache_loc
            keep = loc >= 0  # host tensors: no device read
            stored[group] = (loc[keep].to(dev), batch.input_ids[keep].to(dev), batch.positions[keep].to(dev))
        for group, (loc, ids, pos) in stored.items():
            layers = [(layer, kv) for (g, layer), kv in self.kv.items() if g == group]
            sides = torch.tensor([2 * layer + side + (self.weights_version << 32) for layer, _ in layers for side in (0, 1)],
                                 dtype=torch.int64, device=dev)  # the weights version changes every layer's KV
            data = kv_bytes_all(ids, pos, sides, self.config.kv_bytes)  # [n, 2 * layers, kv_bytes]
            for i, (_, (k, v)) in enumerate(layers):
                k[loc] = data[:, 2 * i]
                v[loc] = data[:, 2 * i + 1]

    def _advance(self, plan) -> None:
        c = self.config
        for req, e, _, _ in plan:
            if req.state != "running":
                continue
            if req.drafts:
                self._commit_verify(req)
            else:
                req.num_computed += e
                if req.num_computed == len(req.tokens) and not self._sample_next(req):
                    continue
            if c.sliding_window:
                upto = req.num_computed - c.sliding_window
                if upto > req.swa_dropped_upto:
                    drop = range(req.swa_dropped_upto, upto)
                    self.swa_alloc.free([req.swa_slots[i] for i in drop])
                    self.full_to_swa[[req.full_slots[i] for i in drop]] = 0
                    for i in drop:
                        req.swa_slots[i] = PADDING_SLOT
                    req.swa_dropped_upto = upto

    def _commit_verify(self, req: SimRequest) -> None:
        """After a verify forward: commit the accepted drafts and the bonus token, roll the rejected positions back
        (their slots freed and released to the canary; the bonus token is computed by the request's next forward)."""
        a = req.accepted
        base = len(req.tokens)
        req.tokens += req.drafts[:a] + [req.bonus]
        req.generated += a + 1
        self.table.tokens[req.row, base + a] = req.bonus
        req.num_computed = base + a  # positions base - 1 .. base + a - 1 hold the last token and the accepted drafts
        keep = base + a
        rejected_full, rejected_swa = req.full_slots[keep:], req.swa_slots[keep:]
        del req.full_slots[keep:], req.swa_slots[keep:]
        self._free(rejected_full, rejected_swa)
        if self.canary is not None and rejected_full:
            self.canary.release_slots("full", rejected_full)
            if self.swa_alloc:
                self.canary.release_slots("swa", [s for s in rejected_swa if s != PADDING_SLOT])
        req.drafts = []

    def run(self, steps: int, workload: Optional[SimWorkload] = None, *, progress: bool = False) -> int:
        """Run ``steps`` scheduler steps feeding ``workload``; returns forwards executed."""
        stream = (workload or SimWorkload(seed=self.config.seed)).stream(self.config.max_context)
        abort_prob = (workload or SimWorkload()).abort_prob
        it: Iterable[int] = range(steps)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, desc="sim forwards", unit="step")
        start = self.forwards
        for _ in it:
            for prompt, new in next(stream):
                self.add_request(prompt, new)
            if self.running and self.rng.random() < abort_prob:
                self.abort(self.rng.choice(self.running))
            self.step()
        return self.forwards - start
