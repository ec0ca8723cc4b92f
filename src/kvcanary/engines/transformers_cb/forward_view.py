"""Translate one transformers continuous-batching forward into the runtime's `BatchDescription`.

Two halves, so the device half can be captured in a CUDA graph with the engine's forward:

* `ForwardTranslator.host_step` — host bookkeeping, once per engine forward (eager or replayed), after
  the engine prepared the batch (``prepare_batch_tensors`` already walked the requests in Python): one
  pass over ``requests_in_batch`` assigns request rows and reads each row's first position ``P`` and
  query length ``E``; the results go to the adapter's static device tensor ``meta`` (rows, P, E, token
  history length) in one non-blocking copy. Prompt tokens the canary has not seen yet (a prefix-cache
  hit, a restored request) go to the token table in one scatter. No device reads.
* `ForwardTranslator.describe` — device ops only, on the forward's keyword arguments (the engine's own
  static buffers: ``input_ids``, ``position_ids``, ``cu_seq_lens_q/k``, ``write_index`` / ``read_index``
  or ``block_table``) and ``meta``: no host reads, shapes fixed by the kwargs' shapes, so the ops are
  captured once per graph key and replay with the values of each batch.

Per batch row with ``P`` = first position and ``E`` = query length (padding rows: request row 0):

* written slots (``out_cache_loc``) come from ``write_index`` (or, on the decode fast path, from the
  block table). Trash rows are not stored (-1): a sliding-window chunk longer than the window sends
  its first ``E - W`` tokens to the write trash, so the canary skips them too (no slot is written
  twice in one launch); the chain then jumps from the seed to the first stored token, a link that is
  never judged because its predecessor is outside the window.
* the position -> slot table row comes from what attention *reads*: ``read_index`` (full attention:
  positions ``[0, P + E)``; sliding window: the ``min(P, W - 1)`` newest cached positions, then sentinel
  rows for the new tokens) or the block table. A read redirected to a wrong slot therefore shows up in
  the canary. Entries are scattered into the persistent table (rows of other requests are untouched).
* sliding window: a ring slot is reused by position ``p + W``. The plan's window is ``[P - W, P)``; the
  chunk's queries read ``[P - W + 1, P)`` (``W - 1`` cached positions), so position ``P - W`` is set to slot
  0 (padding, never verified, and the window head's chain link is not followed) and every read position is
  verified at HEAD — also those in ``[P - W + 1, P + E - W)``, which the chunk's first queries read before
  its own writes overwrite their ring slots. Their KV is gone after the forward, so the group is declared
  a ring (``GroupSpec.ring_window``): the runtime's TAIL verify skips exactly those positions.
* token history: the tokens of ``[P, P + E)`` are the forward's ``input_ids`` (scattered on the device);
  positions below ``P`` the canary has not seen come from the request's prompt / generated tokens.
* producer identity (``context_of`` and the weights version, `kvcanary.runtime.identity`): each request's key — its
  context (LoRA adapter, tenant, cache salt; a ``ProducerIdentity`` or any hashable) under the weights version when
  the request first appears — goes to the runtime as ``context_keys``; a keyed request's position 0 chains from its
  key, so KV of another context or of older weights served to it (a prefix-cache hit on identical tokens) fails the
  chain check at position 0, named at drain time.
* committed tokens (default, ``committed_tokens``): the write-input assert's expected tokens are what each request
  has committed — its prompt and the tokens it has generated (``initial_tokens + generated_tokens``, what the user
  receives), staged by `host_step` — not the forward's own ``input_ids``, which would make the assert vacuous for
  the tokens this forward writes: a forward fed another token than the request committed (inputs routed to the
  wrong row, a stale token) is a ``write_token`` violation of that request. A ``token_oracle`` (a deterministic
  test sampler) replaces the generated part with the oracle's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Hashable, Optional

import torch

from kvcanary.engines.transformers_cb import compat
from kvcanary.engines.transformers_cb.compat import find_batch_processor  # noqa: F401  (re-exported)
from kvcanary.engines.transformers_cb.layout import NOT_STORED, PADDING_SLOT, GroupLayout
from kvcanary.errors import KvCanaryCapacityError, KvCanaryTypeError
from kvcanary.runtime.batch import BatchDescription, GroupBatch, classify_forward, ReadCheck
from kvcanary.runtime.identity import ProducerIdentity, as_identity, identity_key

# rows of `ForwardTranslator.meta`
META_ROWS, META_PREFIX, META_EXTEND, META_TOKEN_LENS, META_CONTEXT = range(5)

# (request id, position) -> the token the engine's sampler emits there (past the prompt): a token oracle
TokenOracleFn = Callable[[str, int], int]
# request id -> the context its KV belongs to (LoRA adapter, tenant, cache salt): any hashable key, None = no context
ContextFn = Callable[[str], Hashable]


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    """What the host knows about one engine forward: batch rows in order, and whether it is a warmup."""

    request_ids: tuple[Optional[str], ...]
    rows: tuple[int, ...]
    forward_kind: str
    warmup: bool = False


@dataclass
class RequestRows:
    """Request id -> row of the canary's request tables (row 0 is the padding row)."""

    max_requests: int

    def __post_init__(self) -> None:
        self.row_of: dict[str, int] = {}
        self.free = list(range(self.max_requests, 0, -1))

    def assign(self, request_id: str) -> int:
        if not self.free:
            raise KvCanaryCapacityError(
                f"kv-canary: more than max_requests={self.max_requests} live requests; "
                "attach with a larger max_requests"
            )
        row = self.free.pop()
        self.row_of[request_id] = row
        return row

    def release_missing(self, live) -> list[int]:
        gone = [rid for rid in self.row_of if rid not in live]
        rows = [self.row_of.pop(rid) for rid in gone]
        self.free.extend(rows)
        return rows


class ForwardTranslator:
    """Static per-request tables and per-batch-row inputs on the canary's device, one forward at a time.

    Tables (by reference in every `BatchDescription`; the same tensor objects for the session's life, as
    CUDA-graph capture needs): ``req_to_token[group]`` and ``token_table``, int32 ``[max_requests + 1,
    max_context]``. ``meta``: int64 ``[5, max_rows]`` — request row, P, E, token-history length, context key
    per batch row (padding rows: zeros), refreshed by `host_step`. Keyed (a ``context_of`` hook, or a
    ``weights_version`` source): each request's producer identity — its ``context_of`` value (`as_identity`) with
    the weights version replaced by ``weights_version()`` when given — is taken once, when the request gets its row
    (a forked child takes its parent's), and ``issue`` turns it into the int64 key handed to the runtime as
    ``context_keys`` (the null identity is 0, no context). ``weights_version`` is asked at most once per step, and
    only in steps that admit a request. With ``committed_tokens`` or a ``token_oracle``, ``expected``: int64
    ``[max_batch_tokens]`` — the token each of the forward's query tokens should be (the prompt's, then the
    generated tokens the request committed or the oracle's; padding tokens 0), refreshed by `host_step` and handed
    to the runtime as ``expected_input_ids``.
    """

    def __init__(self, *, cache, processor, layouts: list[GroupLayout], max_requests: int, max_context: int,
                 max_rows: int, device, token_oracle: Optional[TokenOracleFn] = None,
                 context_of: Optional[ContextFn] = None, committed_tokens: bool = False,
                 weights_version: Optional[Callable[[], int]] = None,
                 issue: Callable[[ProducerIdentity], int] = identity_key) -> None:
        self.cache = cache
        self.processor = processor
        self.layouts = layouts
        self.device = torch.device(device)
        self.max_context = max_context
        self.max_rows = max_rows
        self.rows = RequestRows(max_requests)
        shape = (max_requests + 1, max_context)
        self.req_to_token = {g.name: torch.zeros(shape, dtype=torch.int32, device=self.device) for g in layouts}
        self.token_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.filled = [0] * (max_requests + 1)  # host: history positions [0, filled) are in token_table
        self.has_window = any(g.sliding_window for g in layouts)
        self.last_extend: dict[str, int] = {}  # request id -> E of its latest forward (sliding-window sweep)
        self.context_of = context_of
        self.weights_version = weights_version
        self.issue = issue  # identity -> context key (the canary's registry, so violations name what differed)
        self.keyed = context_of is not None or weights_version is not None
        self.context_of_row = [0] * (max_requests + 1)  # host: context key of each request row
        self.meta = torch.zeros((5, max_rows), dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        self._meta_host = torch.zeros((5, max_rows), dtype=torch.int64, pin_memory=cuda) if cuda else self.meta
        self._meta_copied = torch.cuda.Event() if cuda else None
        self._meta_dirty = max_rows  # host rows of _meta_host that may be non-zero
        max_tokens, max_read = compat.cache_limits(cache)
        span = max(max_tokens, max_read + max_tokens, max_context, max_rows)
        self._arange = torch.arange(span, dtype=torch.int64, device=self.device)
        self.token_oracle = token_oracle
        self.expected: Optional[torch.Tensor] = None
        if token_oracle is not None or committed_tokens:
            self.expected = torch.zeros(max_tokens, dtype=torch.int64, device=self.device)
            self._expected_host = torch.zeros(max_tokens, dtype=torch.int64, pin_memory=cuda) if cuda else self.expected
            self._expected_copied = torch.cuda.Event() if cuda else None
            self._expected_dirty = max_tokens

    # ---- host half ---------------------------------------------------------------------------------
    def host_step(self) -> StepInfo:
        """Bookkeeping for the batch the engine just prepared; refreshes ``meta`` (non-blocking copy)."""
        batch = compat.requests_in_batch(self.processor)
        bs = len(batch)
        if bs > self.max_rows:
            raise KvCanaryCapacityError(
                f"kv-canary: batch of {bs} requests exceeds the engine's max_requests_per_batch={self.max_rows}; "
                "unexpected transformers batch layout"
            )
        if compat.is_warmup(batch):  # fake requests over never-written KV: every row is the padding row
            zeros = [0] * bs
            self._write_meta(zeros, zeros, zeros, zeros, zeros)
            if self.expected is not None:
                self._write_expected([])
            return StepInfo(request_ids=(None,) * bs, rows=tuple(zeros), forward_kind="mixed", warmup=True)

        live = compat.active_requests(self.processor)
        if len(self.rows.row_of) > len(live) or any(rid not in live for rid in self.rows.row_of):
            self.rows.release_missing(live)
            if self.has_window:
                self.last_extend = {rid: e for rid, e in self.last_extend.items() if rid in live}
        row_of, filled, ctx = self.rows.row_of, self.filled, self.max_context
        rows, prefix, extend, ends, ids, history = [], [], [], [], [], []
        version = None  # the weights version, asked once in a step that admits a request
        for fs in batch:
            state = fs.state
            rid = state.request_id
            e = fs.query_length
            p = state.position_offset - e
            row = row_of.get(rid)
            if row is None:
                row = self.rows.assign(rid)
                filled[row] = 0
                if self.keyed:
                    if version is None and self.weights_version is not None:
                        version = self.weights_version()
                    self.context_of_row[row] = self._context_id(rid, version)
            if p + e > ctx:
                raise KvCanaryCapacityError(
                    f"kv-canary: request {rid} reaches position {p + e - 1}, beyond max_context={ctx}; "
                    "attach with a larger max_context"
                )
            if filled[row] < p:
                history.append((row, state, filled[row], p))
            filled[row] = p + e
            rows.append(row)
            prefix.append(p)
            extend.append(e)
            ends.append(p + e)
            ids.append(rid)
        if self.has_window:
            self.last_extend.update(zip(ids, extend))
        if history:
            self._stage_history(history)
        contexts = [self.context_of_row[r] for r in rows] if self.keyed else [0] * len(rows)
        self._write_meta(rows, prefix, extend, ends, contexts)
        if self.expected is not None:
            self._write_expected(self._expected_tokens(batch))
        return StepInfo(request_ids=tuple(ids), rows=tuple(rows), forward_kind=classify_forward(prefix, extend))

    def _context_id(self, request_id: str, version: Optional[int] = None) -> int:
        """The context key of ``request_id`` (0: none) under weights ``version`` (None: asked now, if watched); a
        forked child has its parent's key."""
        parent = compat.fork_parent(request_id)
        row = self.rows.row_of.get(parent) if parent is not None else None
        if row is not None:
            return self.context_of_row[row]
        value = self.context_of(parent if parent is not None else request_id) if self.context_of is not None else None
        try:
            hash(value)
        except TypeError:
            raise KvCanaryTypeError(f"kv-canary: context_of({request_id!r}) must return a hashable key or None, "
                                    f"got {type(value).__name__}") from None
        identity = as_identity(value)
        if self.weights_version is not None:
            identity = replace(identity, weights_version=self.weights_version() if version is None else version)
        return self.issue(identity)

    def context_id(self, request_id: str) -> int:
        """The context key of ``request_id`` (0: none, or not keyed): its row's, else asked now."""
        if not self.keyed:
            return 0
        row = self.rows.row_of.get(request_id)
        return self.context_of_row[row] if row is not None else self._context_id(request_id)

    def _write_meta(self, rows: list, prefix: list, extend: list, token_lens: list, contexts: list) -> None:
        bs = len(rows)
        host = self._meta_host
        if self._meta_copied is not None:
            self._meta_copied.synchronize()  # the previous step's copy has left the pinned buffer
        if bs:
            host[:, :bs] = torch.tensor([rows, prefix, extend, token_lens, contexts], dtype=torch.int64)
        if self._meta_dirty > bs:
            host[:, bs : self._meta_dirty].zero_()
        self._meta_dirty = bs
        if host is not self.meta:
            self.meta.copy_(host, non_blocking=True)
            self._meta_copied.record()

    def _expected_tokens(self, batch: list) -> list[int]:
        """The tokens the forward's query tokens should be, in batch order: position ``q`` of a request is its
        prompt token while ``q`` is inside the prompt (``initial_tokens``: after a soft reset it holds the tokens
        generated before too), else the token oracle's ``(request id, q)``, else the token the request generated
        at ``q``. A position the request has not committed (none known) expects -1: a violation, never a guess."""
        oracle, out = self.token_oracle, []
        for fs in batch:
            state = fs.state
            e = fs.query_length
            p = state.position_offset - e
            prompt = state.initial_tokens
            inside = max(0, min(p + e, len(prompt)) - p)
            out.extend(prompt[p : p + inside])
            if inside == e:
                continue
            if oracle is not None:
                out.extend(int(oracle(state.request_id, q)) for q in range(p + inside, p + e))
            else:
                lo = p + inside - len(prompt)
                got = state.generated_tokens[lo : lo + e - inside]
                out.extend(got)
                out.extend([-1] * (e - inside - len(got)))
        return out

    def _write_expected(self, tokens: list) -> None:
        n, host = len(tokens), self._expected_host
        if n > host.shape[0]:
            raise KvCanaryCapacityError(f"kv-canary: batch of {n} tokens exceeds the cache's max_batch_tokens="
                                        f"{host.shape[0]}; unexpected transformers batch layout")
        if self._expected_copied is not None:
            self._expected_copied.synchronize()  # the previous step's copy has left the pinned buffer
        if n:
            host[:n] = torch.tensor(tokens, dtype=torch.int64)
        if self._expected_dirty > n:
            host[n : self._expected_dirty].zero_()
        self._expected_dirty = n
        if host is not self.expected:
            self.expected.copy_(host, non_blocking=True)
            self._expected_copied.record()

    def _stage_history(self, history: list) -> None:
        """Token history positions ``[have, upto)`` of each listed row, from the request's own tokens."""
        rows, cols, toks = [], [], []
        for row, state, have, upto in history:
            seq = state.initial_tokens
            if upto > len(seq):
                seq = list(seq) + list(state.generated_tokens)
            part = seq[have:upto]
            toks.extend(part)
            cols.extend(range(have, have + len(part)))
            rows.extend([row] * len(part))
        if toks:
            idx = torch.tensor([rows, cols], dtype=torch.int64).to(self.device, non_blocking=True)
            vals = torch.tensor(toks, dtype=torch.int32).to(self.device, non_blocking=True)
            self.token_table.index_put_((idx[0], idx[1]), vals)

    # ---- device half -------------------------------------------------------------------------------
    def describe(self, kwargs: dict) -> BatchDescription:
        """The `BatchDescription` of the forward about to run with ``kwargs`` (device ops only).

        Shapes come from the kwargs (``B`` sequences, ``T`` query tokens, padded under CUDA graphs); the
        values from the engine's buffers and ``meta``. Also scatters the new tokens into the token table
        and what attention reads / writes into ``req_to_token``.
        """
        cu_q = kwargs["cu_seq_lens_q"].to(torch.int64)
        bsz = int(cu_q.shape[0]) - 1
        input_ids = kwargs["input_ids"][0]
        n = int(input_ids.shape[0])
        positions = kwargs["position_ids"][0].to(torch.int64)
        meta = self.meta[:, :bsz]
        rows, prefix, extend, token_lens = meta[META_ROWS], meta[META_PREFIX], meta[META_EXTEND], meta[META_TOKEN_LENS]
        ctx = self.max_context

        tok = self._arange[:n]
        tok_b = torch.searchsorted(cu_q[1:], tok, right=True)  # batch row of each token; bsz = padding
        tok_valid = tok_b < bsz
        tok_bc = tok_b.clamp(max=max(bsz - 1, 0))
        tok_row = torch.where(tok_valid, rows[tok_bc], 0)  # request row (0 for padding tokens)
        tok_pos = torch.where(tok_valid, positions, 0).clamp_(0, ctx - 1)
        self.token_table.index_put_((tok_row, tok_pos), input_ids.to(torch.int32))

        groups = {}
        block_table = kwargs.get("block_table")
        for g in self.layouts:
            table = self.req_to_token[g.name]
            cu_k = kwargs["cu_seq_lens_k"][g.layer_type].to(torch.int64)
            if block_table is not None:
                out, check = self._paged(g, table, block_table[g.index], rows, prefix, extend, cu_k, bsz, tok_bc,
                                         tok_valid, tok_pos)
            else:
                out, check = self._indexed(g, table, kwargs, bsz, n, rows, prefix, extend, cu_q, cu_k, tok_row,
                                           tok_valid, tok_pos)
            groups[g.name] = GroupBatch(req_to_token=table, out_cache_loc=out, read_check=check)
        expected = self.expected[:n] if self.expected is not None else None
        return BatchDescription(
            req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend, input_ids=input_ids, positions=positions,
            groups=groups, token_table=self.token_table, token_table_lens=token_lens, expected_input_ids=expected,
            context_keys=meta[META_CONTEXT] if self.keyed else None,
        )

    def _indexed(self, g: GroupLayout, table, kwargs, bsz, n, rows, prefix, extend, cu_q, cu_k, tok_row, tok_valid,
                 tok_pos):
        """Index-based path (``write_index`` / ``read_index``): fill ``table``, return the written slots and the
        group's `ReadCheck` (every read entry of a row is a cached position it owns — in ``table``, verified at
        HEAD —, one of its new tokens read from the slot it is written to (sliding window: the sentinel), or a
        disagreement; and the row's key length must be the entries it owns)."""
        ctx = self.max_context
        written = g.physical_to_slot(kwargs["write_index"][g.index][:n], for_write=True)
        if written.shape[0] < n:  # unpadded write index shorter than the tokens: nothing stored past it
            written = torch.cat([written, written.new_full((n - written.shape[0],), NOT_STORED)])
        out = torch.where(tok_valid, written, NOT_STORED)
        stored = out >= 0
        window = g.sliding_window
        if window:  # position P - W is in the plan's window but no query reads it: padding, never verified
            old = prefix - window
            keep = (rows > 0) & (old >= 0)
            table.index_put_((torch.where(keep, rows, 0), old.clamp(min=0)), torch.zeros_like(old, dtype=torch.int32))
        # cached entries a row reads (every cached position a query of the chunk reads, those the chunk recycles
        # included), then its E new tokens: the row owns exactly these entries of the read index
        cached_n = prefix.clamp(max=window - 1) if window else prefix
        owned = cached_n + extend
        klen = cu_k[1 : bsz + 1] - cu_k[:bsz]
        first = None
        reads = kwargs["read_index"][g.index]
        k = int(reads.shape[0])
        if k and bsz:
            j = self._arange[:k]
            jb = torch.searchsorted(cu_k[1 : bsz + 1], j, right=True)
            jvalid = jb < bsz
            jb = jb.clamp_(max=bsz - 1)
            local = j - cu_k[jb]
            c = cached_n[jb]
            pos = prefix[jb] - c + local
            keep = jvalid & (local < c)
            slots = g.physical_to_slot(reads, for_write=False)
            table.index_put_((torch.where(keep, rows[jb], 0), torch.where(keep, pos, 0).clamp_(0, ctx - 1)),
                             slots.to(torch.int32))
            new = (local >= c) & (local < c + extend[jb])
            token = (cu_q[jb] + local - c).clamp_(0, max(n - 1, 0))
            want = torch.full_like(slots, PADDING_SLOT) if window or not n else written[token]  # window: the sentinel
            bad = jvalid & (rows[jb] > 0) & ((new & (slots != want)) | (local >= c + extend[jb]))
            first = torch.full_like(prefix, k).scatter_reduce_(0, jb, torch.where(bad, j, k), "amin")
            at = first.clamp(max=k - 1)
            has = first < k
        keep = stored & (tok_row > 0)
        table.index_put_((torch.where(keep, tok_row, 0), torch.where(keep, tok_pos, 0)),
                         out.clamp(min=PADDING_SLOT).to(torch.int32))
        # a row with no disagreeing entry but a wrong key length: the first owned position it does not read
        gap = prefix - cached_n + torch.minimum(klen, owned)
        gap_token = (cu_q[:bsz] + gap - prefix).clamp_(0, max(n - 1, 0))
        gap_new = written[gap_token] if n else torch.full_like(gap, PADDING_SLOT)  # a forward of no tokens writes none
        gap_slot = torch.where(gap >= prefix, gap_new, table[rows, gap.clamp(0, ctx - 1)].to(torch.int64))
        gap_slot = torch.where(klen < owned, gap_slot, -1)
        if first is None:
            return out, _read_check(rows, klen, owned, None, torch.zeros_like(gap), gap, gap_slot)
        wrong_new = has & (local[at] < c[at] + extend[jb[at]])
        expected = torch.where(wrong_new, want[at], -1)
        return out, _read_check(rows, klen, owned, has, torch.where(has, slots[at], PADDING_SLOT),
                                torch.where(has, pos[at], gap), torch.where(has, expected, gap_slot))

    def _paged(self, g: GroupLayout, table, pages, rows, prefix, extend, cu_k, bsz, tok_bc, tok_valid, tok_pos):
        """Decode fast path (block table ``[B, nb]`` of ``block * pages_stride``): fill ``table`` for positions
        ``[0, nb * page)`` of every batch row (entries past a row's blocks map to the padding slot), return
        the written slots and the group's `ReadCheck` (the kernel reads positions ``[0, key length)`` of a row's
        blocks: the key length must be ``P + E``)."""
        page = g.page_size
        nb = int(pages.shape[1])
        width = min(nb * page, self.max_context)
        if width:
            col = self._arange[:width]
            entries = pages[:, torch.div(col, page, rounding_mode="floor")]
            table[rows, :width] = g.block_entries_to_slots(entries, col % page).to(torch.int32)
        blk = torch.div(tok_pos, page, rounding_mode="floor").clamp_(max=max(nb - 1, 0))
        written = g.block_entries_to_slots(pages[tok_bc, blk], tok_pos % page)
        out = torch.where(tok_valid & (written > PADDING_SLOT), written, NOT_STORED)
        owned = prefix + extend
        klen = cu_k[1 : bsz + 1] - cu_k[:bsz]
        pos = torch.minimum(klen, owned)  # a surplus: the first position past the row's; a gap: the first unread
        slot = table[rows, pos.clamp(0, self.max_context - 1)].to(torch.int64) if width else torch.zeros_like(pos)
        surplus = klen > owned
        return out, _read_check(rows, klen, owned, None, torch.where(surplus, slot, PADDING_SLOT), pos,
                                torch.where(surplus, -1, slot))

    # ---- sweep ------------------------------------------------------------------------------------
    def live_slots(self) -> dict[str, torch.Tensor]:
        """Every slot holding live KV, per group: written positions of running requests and every slot of
        the blocks kept cached for prefix sharing (sliding window: the window's positions, less a window
        head whose predecessor slot the same forward recycled). Called between forwards, once per sweep pass.
        Built in host memory from the engine's host-side block tables (int64 CPU tensors): no device read
        and no pageable upload that would wait for the stream — the runtime uploads them without blocking."""
        active = compat.active_requests(self.processor)
        out = {}
        for g in self.layouts:
            alloc = compat.allocators(self.cache)[g.layer_type]
            blocks_of, starts, counts = [], [], []
            for rid, blocks in compat.request_blocks(alloc).items():
                state = active.get(rid)
                if state is None or not blocks:
                    continue
                n = int(state.position_offset)
                if g.sliding_window:
                    head = max(0, n - g.sliding_window)
                    if self.last_extend.get(rid, 0) >= g.sliding_window and head > 0:
                        # the window head's predecessor slot was recycled within the same forward
                        # (a chunk of >= W tokens): its chain link cannot be judged, skip it
                        head += 1
                else:
                    head, n = 0, min(n, len(blocks) * g.page_size)
                if n > head:
                    blocks_of.append(blocks)
                    starts.append(head)
                    counts.append(n - head)
            parts = []
            if blocks_of:
                parts.append(self._slots_of_positions(g, blocks_of, starts, counts))
            cached = compat.cached_blocks(alloc)
            if cached:
                base = torch.tensor(cached, dtype=torch.int64)[:, None] * g.page_size
                parts.append((base + torch.arange(g.page_size, dtype=torch.int64)).flatten())
            slots = torch.cat(parts).unique() if parts else torch.zeros(0, dtype=torch.int64)
            out[g.name] = slots[slots > PADDING_SLOT]
        return out

    def _slots_of_positions(self, g: GroupLayout, blocks_of: list, starts: list, counts: list) -> torch.Tensor:
        """Slots of positions ``[start, start + count)`` of each request (ring positions for a window)."""
        nb = max(len(b) for b in blocks_of)
        blocks = torch.tensor([b + [0] * (nb - len(b)) for b in blocks_of], dtype=torch.int64)  # host memory
        lens = torch.tensor([starts, counts], dtype=torch.int64)
        col = torch.arange(max(counts), dtype=torch.int64)
        pos = lens[0][:, None] + col[None, :]
        if g.sliding_window:
            pos = pos % g.sliding_window
        idx = torch.div(pos, g.page_size, rounding_mode="floor").clamp_(max=nb - 1)
        slots = blocks.gather(1, idx) * g.page_size + pos % g.page_size
        return slots[col[None, :] < lens[1][:, None]]


def _read_check(rows, klen, owned, has, slot, position, expected_slot) -> ReadCheck:
    """The per-row `ReadCheck`: a row disagrees when it reads an entry it does not own (``has``) or its key length
    is not the entries it owns; padding rows never."""
    mismatch = (rows > 0) & (klen != owned)
    if has is not None:
        mismatch |= (rows > 0) & has
    return ReadCheck(mismatch=mismatch, slot=slot, position=position, expected_slot=expected_slot, reads=klen,
                     owned=owned)


class StaticKwargs:
    """Fixed-capacity device copies of what `ForwardTranslator.describe` reads from an *eager* forward's
    kwargs (whose shapes change every forward), so that ``describe`` + ``Canary.stage`` can be captured once
    in a CUDA graph and replayed: `load` costs a few copies per forward instead of ~50 small launches.

    Capacities: ``max_rows`` sequences, ``max_tokens`` query tokens, ``max_reads`` read-index entries per
    group (the engine's own static sizes). Past the forward's ``B`` sequences the cumulative lengths
    plateau (every later token / read entry belongs to no sequence); stale entries past the forward's
    tokens or reads are never used. A forward without cache reads (an empty read index: attention reads the
    new tokens' K/V) is loaded as the read index that says so. Decode-fast-path forwards (block table) are not
    loaded.
    """

    def __init__(self, *, layouts: list[GroupLayout], max_rows: int, max_tokens: int, max_reads: int, device) -> None:
        dev = torch.device(device)
        groups = max(g.index for g in layouts) + 1
        self.max_rows, self.max_tokens, self.max_reads = max_rows, max_tokens, max_reads
        self.input_ids = torch.zeros((1, max_tokens), dtype=torch.int32, device=dev)
        self.position_ids = torch.zeros((1, max_tokens), dtype=torch.int32, device=dev)
        self.cu_q = torch.zeros(max_rows + 1, dtype=torch.int32, device=dev)
        self.cu_k = {g.layer_type: torch.zeros(max_rows + 1, dtype=torch.int32, device=dev) for g in layouts}
        self.write = [torch.zeros(max_tokens, dtype=torch.int64, device=dev) for _ in range(groups)]
        self.read = [torch.zeros(max_reads, dtype=torch.int64, device=dev) for _ in range(groups)]
        self.kwargs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "cu_seq_lens_q": self.cu_q,
                       "cu_seq_lens_k": self.cu_k, "write_index": self.write, "read_index": self.read}
        self.layouts = layouts

    def load(self, kwargs: dict) -> bool:
        """Copy one forward's kwargs in (device copies); False when the forward does not fit (nothing copied)."""
        if kwargs.get("block_table") is not None:
            return False
        n = int(kwargs["input_ids"].shape[1])
        bsz = int(kwargs["cu_seq_lens_q"].shape[0]) - 1
        reads = [int(kwargs["read_index"][g.index].shape[0]) for g in self.layouts]
        if n > self.max_tokens or bsz > self.max_rows or max(reads) > self.max_reads:
            return False
        self.input_ids[:, :n].copy_(kwargs["input_ids"])
        self.position_ids[:, :n].copy_(kwargs["position_ids"])
        _plateau(self.cu_q, kwargs["cu_seq_lens_q"], bsz)
        for g, k in zip(self.layouts, reads):
            self.write[g.index][:n].copy_(kwargs["write_index"][g.index][:n])
            if k:
                self.read[g.index][:k].copy_(kwargs["read_index"][g.index])
            elif g.sliding_window:  # no cache reads: attention reads the new tokens' own K/V (the window's sentinel)
                self.read[g.index][:n].zero_()
            else:  # ... which full attention stores first: the read index would be the write index
                self.read[g.index][:n].copy_(self.write[g.index][:n])
            _plateau(self.cu_k[g.layer_type], kwargs["cu_seq_lens_k"][g.layer_type], bsz)
        return True


def _plateau(dst: torch.Tensor, src: torch.Tensor, bsz: int) -> None:
    """``dst[: bsz + 1] = src``, then every later entry = ``src[bsz]`` (two device ops)."""
    dst[: bsz + 1].copy_(src[: bsz + 1])
    dst[bsz + 1 :].copy_(src[bsz : bsz + 1].expand(dst.shape[0] - bsz - 1))


