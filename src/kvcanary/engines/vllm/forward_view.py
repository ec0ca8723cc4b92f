"""Translate one vLLM worker forward into the runtime's `BatchDescription` (worker side, read only).

Sources, per forward (all read, nothing written):

* the forward context's attention metadata, one object per KV cache group (taken from the group's
  first layer): ``query_start_loc`` and ``seq_lens`` (prefix = seq_len - query_len), ``block_table``
  (kernel block ids — what attention *reads*) and ``slot_mapping`` (what the forward *writes*);
* the model runner's persistent batch: ``input_batch.req_ids`` (request id of each batch row, in
  the attention metadata's row order), ``input_ids`` and ``positions`` (what the model is fed);
* the token oracle: the scheduler's own record of each request's tokens (prompt + sampled so far),
  shipped in the connector metadata (written into the token table, `TokenWrites`); positions the scheduler has not seen yet
  (async scheduling's in-flight token) are left unknown, not guessed;
* each request's context key (LoRA adapter, cache salt), from the same metadata: a batch row's
  ``context_keys`` entry, so KV computed under one context and served to another fails its chain.

Position -> slot table (``req_to_token``) of a row: ``block_table[row, p // B] * B + p % B`` for
``p < seq_len`` — built from what attention reads, so a stale or redirected block table entry makes
the canary verify the wrong slot and fail there. Slot 0 (null block) is the padding slot.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kvcanary.engines.vllm.compat import find_model_runner, is_v2_runner  # noqa: F401  (their old home)
from kvcanary.engines.vllm.layout import GroupLayout
from kvcanary.engines.vllm.multimodal import MultimodalSpans
from kvcanary.errors import KvCanaryRuntimeError
from kvcanary.ops.paged import launch_block_table_slots_kernel, launch_mark_written_slots_kernel
from kvcanary.runtime.batch import BatchDescription, BlockTable, GroupBatch, RewriteCounter, classify_forward
from kvcanary.runtime.cuda_host import current_stream
from kvcanary.runtime.upload import ColumnUpload


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """One forward as the model runner holds it, right before the model runs.

    req_ids / query / prefix: per batch row (attention-metadata order), on the host (query / prefix: int sequences
    or numpy arrays): request id, tokens scheduled, positions already cached. input_ids / positions: ``[>= sum(query)]`` on the engine's device
    (the runner's own buffers, not copied). attn_metadata: layer name -> the backend's metadata (block
    table, slot mapping), as attention will read it. seq_lens: ``[>= rows]`` on the device, each row's exact sequence
    length after this forward, where the host ``prefix`` may be an upper bound (V2 runner: with async scheduling
    and speculative drafts the host counts the previous step's drafts as accepted until their result is back; the
    runner's device lengths are exact); None where the host lengths are exact. block_tables: V2 runner, the block
    table of each KV cache group (by group index) as the runner gathered it for this forward — what a backend whose
    metadata keeps no ``block_table`` (FlashInfer: paged-KV indices built from it) reads; None elsewhere.
    """

    req_ids: tuple
    query: object
    prefix: object
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: dict
    graph_mode: str = ""  # V2 runner: the step's CUDA-graph mode (FULL, PIECEWISE, NONE); "" when not known
    seq_lens: Optional[torch.Tensor] = None
    block_tables: Optional[tuple] = None


def v1_step(runner, attn_metadata: dict, first_layer: str) -> StepInputs:
    """`StepInputs` of a V1 runner's forward (CPU): lengths read from the attention metadata."""
    first = attn_metadata[first_layer]
    num_reqs = int(first.query_start_loc.shape[0]) - 1
    req_ids = tuple(runner.input_batch.req_ids[:num_reqs])
    if len(req_ids) != num_reqs:
        raise KvCanaryRuntimeError(
            f"kv-canary: the attention metadata has {num_reqs} rows, the model runner's batch "
            f"{len(req_ids)}; unexpected vLLM batch layout"
        )
    qsl = first.query_start_loc[: num_reqs + 1].to(torch.int64).cpu()
    seq = first.seq_lens[:num_reqs].to(torch.int64).cpu().tolist()
    query = (qsl[1:] - qsl[:-1]).tolist()
    return StepInputs(req_ids=req_ids, query=query, prefix=[s - q for s, q in zip(seq, query)],
                      input_ids=runner.input_ids.gpu, positions=runner.positions, attn_metadata=attn_metadata)


def v2_step(input_batch, attn_metadata: dict, graph_mode: str = "", block_tables: Optional[tuple] = None) -> StepInputs:
    """`StepInputs` of a V2 runner's forward: lengths from the batch's host arrays (no device read), and its device
    ``seq_lens`` (exact where the host prefix is an upper bound; `WorkerView.device_lengths`)."""
    n = int(input_batch.num_reqs)
    query = np.array(input_batch.num_scheduled_tokens[:n], dtype=np.int64)  # copies: the runner reuses its arrays
    prefix = np.array(input_batch.num_computed_tokens_np[:n], dtype=np.int64)
    return StepInputs(req_ids=tuple(input_batch.req_ids[:n]), query=query, prefix=prefix,
                      input_ids=input_batch.input_ids, positions=input_batch.positions, attn_metadata=attn_metadata,
                      graph_mode=graph_mode, seq_lens=getattr(input_batch, "seq_lens", None), block_tables=block_tables)


def v2_step_from_stack(runner, depth: int = 12) -> Optional[StepInputs]:
    """The V2 runner's forward being set up, read from its ``execute_model`` frame (locals ``input_batch`` and
    ``attn_metadata``; the connector's ``bind_connector_metadata`` is called from there, in every CUDA-graph
    mode — the forward context holds no attention metadata in FULL-graph steps). None when the caller is not
    a forward (a step without tokens, a dummy run)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "execute_model" and frame.f_locals.get("self") is runner:
            loc = frame.f_locals
            batch, attn = loc.get("input_batch"), loc.get("attn_metadata")
            if batch is None or not attn or loc.get("dummy_run"):
                return None
            if isinstance(attn, list):
                raise KvCanaryRuntimeError("kv-canary: micro-batched forwards (DBO) are not supported by the vLLM adapter")
            desc = loc.get("batch_desc")
            mode = getattr(getattr(desc, "cg_mode", None), "name", "") if desc is not None else ""
            tables = loc.get("block_tables")
            return v2_step(batch, attn, graph_mode=str(mode), block_tables=tuple(tables) if tables is not None else None)
        frame = frame.f_back
    return None


def block_table_of(step: StepInputs, g: GroupLayout, meta) -> torch.Tensor:
    """The block table attention reads for group ``g`` this forward: the backend's metadata's, else (a backend that
    keeps none, FlashInfer) the one the V2 runner gathered for the group."""
    bt = getattr(meta, "block_table", None)
    if bt is None and step.block_tables is not None and g.index < len(step.block_tables):
        bt = step.block_tables[g.index]
    if bt is None:
        raise KvCanaryRuntimeError(
            f"kv-canary: the attention metadata of {g.layer_names[0]} ({type(meta).__name__}) holds no block table and "
            f"the model runner gave none for KV cache group {g.index}; this attention backend is not supported"
        )
    return bt


class RequestRows:
    """Request id -> row of the canary's request tables (row 0 is the padding row), and per row what the adapter
    knows of its request (numpy, so a forward's rows are read and written without a Python loop per row):

    hist: tokens of its history shipped so far (prompt + sampled; may exceed max_context). computed: positions
    stored as of its latest forward (0 = no forward yet, or preempted since). preempted: preempted and not
    forwarded since. keys: context key (LoRA adapter / cache salt; 0 = none)."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.row_of: dict[str, int] = {}
        self.free = list(range(max_requests, 0, -1))
        n = max_requests + 1
        self.hist = np.zeros(n, dtype=np.int64)
        self.computed = np.zeros(n, dtype=np.int64)
        self.preempted = np.zeros(n, dtype=bool)
        self.keys = np.zeros(n, dtype=np.int64)
        self._recent: dict[tuple, np.ndarray] = {}  # `of`

    def get(self, request_id: str) -> int:
        row = self.row_of.get(request_id)
        if row is None:
            if not self.free:
                raise KvCanaryRuntimeError(
                    f"kv-canary: more than max_requests={self.max_requests} live vLLM requests; raise "
                    "kvcanary max_requests (kv_connector_extra_config) to at least max_num_seqs"
                )
            row = self.row_of[request_id] = self.free.pop()
        return row

    def of(self, request_ids) -> np.ndarray:
        """int64 rows of ``request_ids`` (new ids get free rows), read-only. The few lists asked for last are
        remembered until a request is released (a steady decode asks for the same ids every forward)."""
        key = request_ids if isinstance(request_ids, tuple) else tuple(request_ids)
        rows = self._recent.get(key)
        if rows is None:
            row_of = self.row_of
            rows = np.fromiter((row_of.get(r) or self.get(r) for r in key), dtype=np.int64, count=len(key))
            rows.flags.writeable = False
            if len(self._recent) >= 4:
                self._recent.clear()
            self._recent[key] = rows
        return rows

    def release(self, request_id: str) -> Optional[int]:
        row = self.row_of.pop(request_id, None)
        self._recent.clear()
        if row is not None:
            self.free.append(row)
            self.hist[row] = self.computed[row] = self.keys[row] = 0
            self.preempted[row] = False
        return row


@dataclass(frozen=True, kw_only=True)
class TokenBatch:
    """Tokens the scheduler recorded since it last shipped them, for several requests at once (host, numpy):
    request ``request_ids[i]`` gained ``counts[i]`` tokens from position ``starts[i]``; ``tokens`` holds them all,
    request after request. Each request id at most once."""

    request_ids: tuple
    starts: np.ndarray
    counts: np.ndarray
    tokens: np.ndarray

    @classmethod
    def from_lists(cls, request_ids, starts, counts, tokens) -> "TokenBatch":
        return cls(request_ids=tuple(request_ids), starts=np.asarray(starts, dtype=np.int64).reshape(-1),
                   counts=np.asarray(counts, dtype=np.int64).reshape(-1), tokens=np.asarray(tokens, dtype=np.int64).reshape(-1))

    @classmethod
    def from_dict(cls, tokens: dict) -> "TokenBatch":
        """From ``{request id: (first position, token ids)}``."""
        items = list(tokens.items())
        flat = [t for _, (_, new) in items for t in new]
        return cls.from_lists([r for r, _ in items], [int(s) for _, (s, _) in items], [len(new) for _, (_, new) in items],
                              flat)


class TokenWrites:
    """Token-table cells learnt from the scheduler and not uploaded yet: ``(rows, columns, tokens)`` int64 arrays
    in arrival order; `take` keeps the last value of a cell written twice (a resend), so the upload writes each
    cell once."""

    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, rows: np.ndarray, cols: np.ndarray, tokens: np.ndarray) -> None:
        if rows.size:
            self._parts.append((rows, cols, tokens))

    def drop_rows(self, rows) -> None:
        """Forget the pending cells of ``rows`` (released: their next request starts afresh)."""
        if self._parts and rows:
            gone = np.asarray(list(rows), dtype=np.int64)
            kept = []
            for r, c, t in self._parts:
                keep = ~np.isin(r, gone)
                kept.append((r[keep], c[keep], t[keep]))
            self._parts = kept

    def take(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, columns, tokens)`` of every pending cell (``width``: the table's columns), and forget them."""
        parts, self._parts = self._parts, []
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        if len(parts) == 1:
            return parts[0]
        rows, cols, toks = (np.concatenate(x) for x in zip(*parts))
        key = rows * width + cols
        _, last = np.unique(key[::-1], return_index=True)
        pick = np.sort(key.size - 1 - last)
        return rows[pick], cols[pick], toks[pick]


@dataclass
class ForwardEvents:
    """What the last forward showed about the engine (counted for the report)."""

    prefix_hits: int = 0  # first forward of a request that starts past position 0 (prefix cache)
    chunked: int = 0  # forwards continuing a prefill (query > 1 at a position > 0, not a first forward)
    resumed: int = 0  # first forward after a preemption
    same_step_shared: int = 0  # rows reading prefix blocks that another row of the same forward writes
    draft_tokens: int = 0  # speculative decoding: draft tokens written (and verified) by the target model


class WorkerView:
    """Keeps the canary's per-request tables and builds one `BatchDescription` per forward."""

    def __init__(self, *, runner, layouts: list[GroupLayout], max_requests: int, max_context: int,
                 device: torch.device, track_read_slots: bool = False, device_lengths: bool = False) -> None:
        self.runner = runner
        # the rows' prefix / sequence lengths from the step's device ``seq_lens`` where it has them (async scheduling
        # with speculative drafts: the host lengths are upper bounds); two small launches a forward
        self.device_lengths = device_lengths
        self.layouts = layouts
        self.device = torch.device(device)
        self.max_context = max_context
        self.rows = RequestRows(max_requests)
        shape = (max_requests + 1, max_context)
        self.req_to_token = {g.name: torch.zeros(shape, dtype=torch.int32, device=self.device) for g in layouts}
        self.token_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.writes = TokenWrites()
        self.keyed = False  # a batch row with a context key was seen: every batch carries context keys from then on
        self._any_key = False  # a context key was applied (rows' keys are read from then on)
        self.events = ForwardEvents()
        self.drafts: dict[str, int] = {}
        self.mm = MultimodalSpans()  # live requests with multimodal placeholder runs
        # per group: slots of positions < seq_len of the last forward (kept only for adapters that mirror KV)
        self.track_read_slots = track_read_slots
        self.read_slots: dict[str, torch.Tensor] = {}
        # slots_reused: one mark per slot over every full-attention group (vLLM's groups draw their blocks from one
        # pool, so a block freed by one full group and reallocated to another is reused memory too)
        self._full_groups = [g.name for g in layouts if not g.sliding_window]
        width = max((g.num_slots for g in layouts if not g.sliding_window), default=0)
        self._ever_written = torch.zeros(width, dtype=torch.uint8, device=self.device)
        self._reused = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._reused_seen = 0
        self._reused_copy = None  # CUDA: (pinned int64 [1], event, [copy pending]) for `slots_reused(wait=False)`
        self._rewrites = RewriteCounter(ever_written=self._ever_written, rewritten=self._reused)
        self._full_set = frozenset(self._full_groups)
        self._block_tables: dict[tuple, BlockTable] = {}  # `_held_block_table`
        self._upload = ColumnUpload(self.device)

    # ---- scheduler events ----------------------------------------------------------------------
    def apply(self, *, tokens, finished, preempted, contexts: Optional[dict] = None,
              drafts: Optional[dict] = None, multimodal: Optional[dict] = None) -> None:
        """One step's scheduler events: requests preempted and finished, context keys and multimodal placeholder
        runs (``(start, end)`` pairs) of new requests, and each request's newly known tokens — a `TokenBatch`, or ``{request id: (first position, tokens)}`` — (a resend
        from an earlier position replaces the tail; a gap is ignored until the scheduler resends from before it)."""
        self.drafts = dict(drafts or {})  # this step's draft tokens per request (speculative decoding)
        rows = self.rows
        for rid in preempted:
            row = rows.get(rid)
            rows.computed[row] = 0
            rows.preempted[row] = True
        done = set(finished)
        released = [r for r in (rows.release(rid) for rid in done) if r is not None]
        for rid, key in (contexts or {}).items():
            if rid not in done:
                rows.keys[rows.get(rid)] = int(key)
                self._any_key = self._any_key or bool(key)
        if done:
            self.writes.drop_rows(released)
            if self.mm:
                for rid in done:
                    self.mm.drop(rid)
        for rid, spans in (multimodal or {}).items():
            if rid not in done:
                self.mm.add(rid, spans)
        batch = tokens if isinstance(tokens, TokenBatch) else TokenBatch.from_dict(tokens or {})
        if not batch.request_ids:
            return
        ids, starts, counts = batch.request_ids, batch.starts, batch.counts
        live = np.ones(len(ids), dtype=bool)
        if done:
            live = np.fromiter((r not in done for r in ids), dtype=bool, count=len(ids))
        at = rows.of([r for r, keep in zip(ids, live) if keep]) if not live.all() else rows.of(ids)
        row = np.zeros(len(ids), dtype=np.int64)
        row[live] = at
        ok = live & (starts <= rows.hist[row])  # a gap: wait for the resend from scratch
        rows.hist[row[ok]] = (starts + counts)[ok]
        first_tok = np.cumsum(counts) - counts
        per_tok = np.repeat(np.arange(len(ids)), counts)
        cols = starts[per_tok] + (np.arange(per_tok.size) - first_tok[per_tok])
        keep = ok[per_tok] & (cols < self.max_context)
        self.writes.add(row[per_tok][keep], cols[keep], batch.tokens[keep])

    # ---- one forward ---------------------------------------------------------------------------
    def describe(self, step: StepInputs) -> Optional[BatchDescription]:
        """The `BatchDescription` of the forward about to run, or None for a forward without tokens.

        No device read on the way, a handful of launches and no Python loop per row whatever the batch: the host
        columns (rows, lengths, context keys, the token history learnt since the last forward) go up in one pinned
        non-blocking copy, each group's position -> slot table is one kernel over the block table attention reads,
        the runner's input ids, positions and slot mapping are handed over as they are (the runtime stages them).
        So on a GPU the engine's stream is never waited for — except on the first forward of a request that hits
        the prefix cache, see `_same_step_shares`."""
        req_ids = list(step.req_ids)
        query = np.asarray(step.query, dtype=np.int64)
        num_tokens = int(query.sum())
        if num_tokens == 0:
            return None
        prefix = np.asarray(step.prefix, dtype=np.int64)
        seq = prefix + query
        max_s = int(seq.max())
        if max_s > self.max_context:
            raise KvCanaryRuntimeError(
                f"kv-canary: a request reaches {max_s} tokens, beyond max_context={self.max_context}"
            )
        rs = self.rows
        rows = rs.of(req_ids)
        first = rs.computed[rows] == 0
        verify = self._verify_rows(req_ids)
        self._count_events(rows, first, prefix, query, verify)
        rows_t, seq_t, prefix_t, extend_t, lens_t, keys_t = self._upload_columns(rows, seq, prefix, query)
        exact = self.device_lengths and step.seq_lens is not None
        if exact:  # the host's max_s stays the tables' width: an upper bound
            seq_t = step.seq_lens[: len(req_ids)].to(device=self.device, dtype=torch.int64)
        todo = np.flatnonzero(first & (prefix > 0))
        tables, written, paged = self._tables(step, rows_t, seq_t, max_s, num_tokens, eager=bool(todo.size))
        input_ids, positions = self._inputs(step, num_tokens, req_ids, rows, prefix, query)
        shared_t = None
        if todo.size:
            shared = self._same_step_shares(rows.tolist(), prefix.tolist(), todo.tolist(), written, positions)
            if any(shared):
                input_ids, positions, written, prefix_t, extend_t, shared_t = self._share(
                    rows, prefix, query, shared, input_ids, positions, written)
        if exact:  # after any same-step share: a row's claimed positions moved from its prefix to its extend
            prefix_t = seq_t - extend_t
        rs.computed[rows] = seq
        return BatchDescription(
            req_pool_indices=rows_t,
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            input_ids=input_ids,
            positions=positions,
            groups=self._groups(tables, written, paged),
            request_ids=tuple(req_ids),
            token_table=self.token_table,
            token_table_lens=lens_t,
            forward_kind=classify_forward(prefix, query, verify),
            context_keys=keys_t,
            shared_lens=shared_t,
        )

    def _inputs(self, step: StepInputs, num_tokens: int, req_ids, rows, prefix, query) -> tuple:
        """The forward's input ids and positions on the canary's device (multimodal placeholders as content tokens)."""
        input_ids = step.input_ids[:num_tokens]
        positions = step.positions[:num_tokens]
        if input_ids.device != self.device:
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        if self.mm:
            input_ids = self._content_inputs(req_ids, rows, prefix, query, input_ids)
        return input_ids, positions

    def _groups(self, tables: dict, written: dict, paged: dict) -> dict:
        """Per group its `GroupBatch` (with its `BlockTable` and the full groups' `RewriteCounter` where HEAD fills the
        table, `_tables`); the slots written join the read slots TAIL re-hashes (adapters that mirror KV)."""
        if self.track_read_slots:
            for name, w in written.items():
                self.read_slots[name] = torch.cat([self.read_slots[name], w[w > 0]])
        return {g.name: self._group_batch(g, tables[g.name], written[g.name], paged) for g in self.layouts}

    def _group_batch(self, g: GroupLayout, table: torch.Tensor, written: torch.Tensor, paged: dict) -> GroupBatch:
        """Group ``g``'s `GroupBatch`; where HEAD fills the tables (``paged``), its `BlockTable` and, for a full group,
        the shared `RewriteCounter`."""
        return GroupBatch(req_to_token=table, out_cache_loc=written, block_table=paged.get(g.name),
                          rewrites=self._rewrites if paged and g.name in self._full_set else None)

    def empty_batch(self) -> BatchDescription:
        """A forward without rows or tokens holding this view's tables (for `Canary.warm_up`); where HEAD will fill the
        tables from vLLM's block tables, with a one-row stand-in block table of each group's shape of launch."""
        none = torch.zeros(0, dtype=torch.int64, device=self.device)
        paged = {}
        if self._paged_ok():
            stand_in = torch.zeros(1, 1, dtype=torch.int32, device=self.device)
            paged = {g.name: BlockTable(table=stand_in, block_size=g.block_size, drop_null=bool(g.sliding_window))
                     for g in self.layouts}
        return BatchDescription(
            req_pool_indices=none, prefix_lens=none, extend_lens=none, input_ids=none, positions=none,
            groups={g.name: self._group_batch(g, self.req_to_token[g.name], none, paged) for g in self.layouts},
            request_ids=(), token_table=self.token_table, token_table_lens=none, forward_kind="decode",
        )

    def _upload_columns(self, rows, seq, prefix, query) -> tuple:
        """The forward's host columns in one upload, and the token-table cells learnt since the last forward
        written: ``(rows, seq lens, prefix lens, extend lens, token-table lens, context keys or None)`` on the device."""
        rs = self.rows
        lens = np.minimum(np.minimum(rs.hist[rows], self.max_context), seq)
        at_rows, at_cols, values = self.writes.take(self.max_context)
        keys = rs.keys[rows] if self._any_key else None
        self.keyed = self.keyed or bool(keys is not None and keys.any())
        host = (rows, seq, prefix, query, lens, at_rows, at_cols, values)
        if self.keyed:
            host += (keys if keys is not None else np.zeros(rows.shape[0], dtype=np.int64),)
        rows_t, seq_t, prefix_t, extend_t, lens_t, at_r, at_c, at_v, *keys_t = self._upload(*host)
        if values.size:
            self.token_table[at_r, at_c] = at_v.to(torch.int32)
        return rows_t, seq_t, prefix_t, extend_t, lens_t, (keys_t[0] if keys_t else None)

    def _content_inputs(self, req_ids: list, rows, prefix, query, input_ids: torch.Tensor) -> torch.Tensor:
        """The forward's input ids with each multimodal placeholder position's id replaced by its content token (the
        token history's, `kvcanary.engines.vllm.multimodal`): a copy, the runner's buffer is left as it is. The model
        reads the item's embedding there, not the id; the content token stands for it."""
        cells = self.mm.cells(req_ids, rows, prefix, query)
        if cells is None:
            return input_ids
        idx, at_rows, at_pos = self._upload(*cells)
        out = input_ids.clone()
        out[idx] = self.token_table[at_rows, at_pos].to(out.dtype)
        return out

    def _verify_rows(self, req_ids: list) -> Optional[np.ndarray]:
        """Speculative decoding: which batch rows verify drafts this forward (None without drafts); counts them."""
        if not self.drafts:
            return None
        ndraft = np.fromiter((self.drafts.get(r, 0) for r in req_ids), dtype=np.int64, count=len(req_ids))
        self.events.draft_tokens += int(ndraft.sum())
        return ndraft > 0

    def _share(self, rows, prefix, query, shared, input_ids, positions, written):
        """Rows reading blocks this same forward writes claim those positions (`_claim_shared`); their prefix and
        extend lengths move by as many (uploaded again, with the claimed counts: `BatchDescription.shared_lens`,
        where a sliding window's reads start)."""
        input_ids, positions, written = self._claim_shared(rows.tolist(), prefix.tolist(), shared, query.tolist(),
                                                           input_ids, positions, written)
        k = np.asarray(shared, dtype=np.int64)
        prefix_t, extend_t, shared_t = self._upload(prefix - k, query + k, k)
        self.events.same_step_shared += int((k > 0).sum())
        return input_ids, positions, written, prefix_t, extend_t, shared_t

    def _tables(self, step: StepInputs, rows_t, seq_t, max_s: int, num_tokens: int,
                eager: bool = False) -> tuple[dict, dict, dict]:
        """Per group: the position -> slot table (from the block table attention reads), the slots written, and the
        `BlockTable` HEAD fills the table from (on the canary's device, inside its own graphs: no launch here).

        Filled here instead (and no `BlockTable`) where the runtime cannot: a block table not on the canary's device
        or not row-major, an adapter that mirrors KV (its read slots come from the table now). ``eager``: filled here
        as well (this forward reads the tables before HEAD, `_same_step_shares`); HEAD writes the same entries."""
        metas = [step.attn_metadata[g.layer_names[0]] for g in self.layouts]
        bts = [block_table_of(step, g, meta) for g, meta in zip(self.layouts, metas)]
        in_head = self._paged_ok() and all(bt.device == self.device and bt.stride(-1) == 1 for bt in bts)
        tables, written, paged = {}, {}, {}
        for g, meta, bt in zip(self.layouts, metas, bts):
            written[g.name] = meta.slot_mapping[:num_tokens].to(device=self.device, dtype=torch.int64)
            if in_head:
                paged[g.name] = self._held_block_table(g, bt)
            if eager or not in_head:
                self._fill_table(g, bt, rows_t, seq_t, max_s)
            tables[g.name] = self.req_to_token[g.name]
        if not in_head:  # HEAD marks the written slots where it fills the tables; here one launch per full group
            for name in self._full_groups:  # a block belongs to one group at a time
                launch_mark_written_slots_kernel(slots=written[name], ever_written=self._ever_written,
                                                 rewritten=self._reused)
        return tables, written, paged

    def _paged_ok(self) -> bool:
        """Whether HEAD may fill the tables (`BlockTable`): not for an adapter that mirrors KV (`track_read_slots`)."""
        return not self.track_read_slots

    def _held_block_table(self, g: GroupLayout, bt: torch.Tensor) -> BlockTable:
        """``bt`` (a view of vLLM's persistent block table cut to the batch's rows) widened to every row its storage
        holds, as one `BlockTable` object per address: the canary's graphs read it by batch row whatever the batch."""
        key = (g.name, bt.data_ptr(), bt.stride(0), bt.shape[1], bt.dtype)
        held = self._block_tables.get(key)
        if held is None:
            elems = bt.untyped_storage().nbytes() // bt.element_size() - bt.storage_offset()
            rows = max((elems - bt.shape[1]) // bt.stride(0) + 1 if bt.stride(0) > 0 else 0, bt.shape[0])
            full = bt.as_strided((rows, bt.shape[1]), bt.stride(), bt.storage_offset())
            held = self._block_tables[key] = BlockTable(table=full, block_size=g.block_size,
                                                         drop_null=bool(g.sliding_window))
        return held

    def _fill_table(self, g: GroupLayout, bt: torch.Tensor, rows_t, seq_t, max_s: int) -> torch.Tensor:
        """Write each row's position -> slot table from the block table attention reads (one kernel, on the device);
        a sliding-window group's null blocks (dropped behind the window) become padding, never verified."""
        table = self.req_to_token[g.name]
        if bt.device != self.device or bt.stride(-1) != 1:
            bt = bt.to(self.device).contiguous()
        launch_block_table_slots_kernel(block_table=bt, rows=rows_t, seq_lens=seq_t, block_size=g.block_size,
                                        width=max_s, table_out=table, drop_null=bool(g.sliding_window))
        if self.track_read_slots:
            slots = table[rows_t, :max_s].to(torch.int64)
            self.read_slots[g.name] = slots[slots > 0]  # what TAIL re-hashes (with the writes)
        return table

    def slots_reused(self, wait: bool = True) -> int:
        """Full-attention slots written again after their block was freed (in any full-attention group: the groups
        share vLLM's block pool): read now (a device read), or with ``wait=False`` on CUDA as last read back (a
        non-blocking copy per call, taken once it has completed)."""
        if wait or self.device.type != "cuda":
            self._reused_seen = int(self._reused[0])
            return self._reused_seen
        if self._reused_copy is None:
            self._reused_copy = (torch.zeros(1, dtype=torch.int64, pin_memory=True), torch.cuda.Event(), [False])
        host, event, pending = self._reused_copy
        if pending[0] and event.query():
            self._reused_seen, pending[0] = max(self._reused_seen, int(host[0])), False
        if not pending[0]:
            host.copy_(self._reused, non_blocking=True)
            event.record(current_stream())
            pending[0] = True
        return self._reused_seen

    def _same_step_shares(self, rows, prefix, todo, written, positions) -> list[int]:
        """Per batch row: how many trailing prefix positions it claims as this forward's (a prefix-cache hit on
        blocks another row computes in this forward — vLLM caches a block when it is scheduled, and within each
        layer all KV writes precede attention, so the read is legitimate). ``todo``: the batch rows to look at (a
        first forward past position 0); host lists.

        A position is *written here* if, in some group, the row's table slot is written by this forward at that
        position. The claim starts at the row's first such position and runs to the end of its prefix: the hit may be a
        block computed now followed by blocks cached earlier (the earlier copy of its first block was evicted, so the
        writing row found no hit and recomputes it, while the later ones are still cached). The records of those later
        positions are written again with the row's own tokens instead of being verified (docs/vllm.md, "Prefix hits
        inside one forward"). Not where the row reads the padding slot at or after that position (a full group, or
        inside a sliding window: vLLM hands null blocks only behind it): then only the trailing run written here (or
        behind a sliding window) is claimed, and the rest stays in the verified prefix, where it fails if it is wrong."""
        out = [0] * len(rows)
        maps = {}
        for g in self.layouts:
            w = written[g.name]
            keep = w >= 0
            order = torch.argsort(w[keep])
            maps[g.name] = (w[keep][order], positions[keep][order])
        for i in todo:
            p = prefix[i]
            trailing, first, reads = p, p, []
            for g in self.layouts:
                slots_w, pos_w = maps[g.name]
                if slots_w.numel() == 0:
                    trailing, first = p, p
                    break
                cand = self.req_to_token[g.name][rows[i], :p].to(torch.int64)
                idx = torch.searchsorted(slots_w, cand).clamp_max(slots_w.numel() - 1)
                at = torch.arange(p, device=cand.device)
                here = (slots_w[idx] == cand) & (pos_w[idx] == at)
                behind = at < p - g.window_left if g.sliding_window else torch.zeros_like(here)
                miss = (~(here | behind)).nonzero().flatten()
                g_trailing = int(miss[-1]) + 1 if miss.numel() else 0
                trailing = g_trailing if g is self.layouts[0] else max(trailing, g_trailing)
                found = here.nonzero().flatten()
                if found.numel():
                    first = min(first, int(found[0]))
                reads.append((cand, behind))
            hole = any(bool(((cand[first:] == 0) & ~behind[first:]).any()) for cand, behind in reads)
            out[i] = p - (trailing if hole else min(first, trailing))
        return out

    def _claim_shared(self, rows, prefix, shared, query, input_ids, positions, written):
        """Rebuild the flattened token arrays with each sharing row's same-step positions prepended to
        its own tokens (it claims the same slot, position and token as the row that writes them)."""
        input_ids, positions = input_ids.to(torch.int64), positions.to(torch.int64)
        qsl = [0]
        for q in query:
            qsl.append(qsl[-1] + q)
        ids_parts, pos_parts = [], []
        slot_parts = {name: [] for name in written}
        dev = self.device
        for i, row in enumerate(rows):
            a, b = qsl[i], qsl[i + 1]
            k = shared[i]
            if k:
                lo, hi = prefix[i] - k, prefix[i]
                hist = self.token_table[row, lo:hi].to(torch.int64)
                ids_parts.append(hist)
                pos_parts.append(torch.arange(lo, hi, dtype=torch.int64, device=dev))
                for name in written:
                    slot_parts[name].append(self.req_to_token[name][row, lo:hi].to(torch.int64))
            ids_parts.append(input_ids[a:b])
            pos_parts.append(positions[a:b])
            for name in written:
                slot_parts[name].append(written[name][a:b])
        return torch.cat(ids_parts), torch.cat(pos_parts), {n: torch.cat(p) for n, p in slot_parts.items()}

    def _count_events(self, rows: np.ndarray, first: np.ndarray, prefix: np.ndarray, query: np.ndarray,
                      verify: Optional[np.ndarray]) -> None:
        rs = self.rows
        resumed = first & rs.preempted[rows]
        self.events.resumed += int(resumed.sum())
        self.events.prefix_hits += int((first & ~resumed & (prefix > 0)).sum())
        chunked = ~first & (prefix > 0) & (query > 1)  # a verify row is no prefill chunk
        if verify is not None:
            chunked &= ~verify
        self.events.chunked += int(chunked.sum())
        rs.preempted[rows[first]] = False

    # ---- sweep ---------------------------------------------------------------------------------
    def live_masks(self, cached_blocks: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """`live_slots` as bool masks ``[num_slots]`` per group, built on the device without a host read (one
        upload of the rows' lengths and the cached blocks; the sweep's input, `Canary.launch_sweep`)."""
        rs = self.rows
        live = np.flatnonzero(rs.computed > 0)  # rows of requests with stored positions (released rows read 0)
        n = rs.computed[live]
        blocks = [[(b, k) for b, k, gi in cached_blocks if gi == g.index and not g.sliding_window] for g in self.layouts]
        host = [live, n]
        for mine in blocks:
            host += [np.array([b for b, _ in mine], dtype=np.int64), np.array([k for _, k in mine], dtype=np.int64)]
        rows_t, n_t, *cached_t = self._upload(*host)
        width = int(n.max()) if live.size else 0
        cols = torch.arange(width, device=self.device)[None, :]
        out = {}
        for g, ids_t, counts_t in zip(self.layouts, cached_t[0::2], cached_t[1::2]):
            mask = torch.zeros(g.num_slots + 1, dtype=torch.bool, device=self.device)  # + a trash row
            if live.size:
                keep = cols < n_t[:, None]
                if g.sliding_window:
                    keep &= cols >= (n_t - g.window_left)[:, None]  # what its next query reads
                slots = self.req_to_token[g.name][rows_t, :width].to(torch.int64).clamp(0, g.num_slots)
                mask.index_fill_(0, torch.where(keep, slots, g.num_slots).flatten(), True)
            if ids_t.numel():
                offs = torch.arange(g.manager_block_size, dtype=torch.int64, device=self.device)[None, :]
                slots = (ids_t[:, None] * g.manager_block_size + offs).clamp(0, g.num_slots)
                mask.index_fill_(0, torch.where(offs < counts_t[:, None], slots, g.num_slots).flatten(), True)
            mask[: g.block_size] = False  # null block slots are never live
            out[g.name] = mask[: g.num_slots]
        return out

    def live_slots(self, cached_blocks: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """Slots holding live KV: stored positions of running requests, plus the valid tokens of the
        idle blocks the scheduler keeps in its prefix cache (``(block id, tokens, group index)``)."""
        out = {}
        rs = self.rows
        live = np.flatnonzero(rs.computed > 0)  # rows of requests with stored positions (released rows read 0)
        if live.size:
            n = rs.computed[live]
            width = int(n.max())
            rows_t, n_t = self._upload(live, n)
            cols = torch.arange(width, device=self.device)[None, :]
        for g in self.layouts:
            parts = []
            if live.size:
                mask = cols < n_t[:, None]
                if g.sliding_window:
                    mask &= cols >= (n_t - g.window_left)[:, None]  # what its next query reads
                parts.append(self.req_to_token[g.name][rows_t, :width][mask].to(torch.int64))
            mine = [(b, k) for b, k, gi in cached_blocks if gi == g.index and not g.sliding_window]
            if mine:
                parts.append(g.manager_block_slots(mine, self.device))
            slots = torch.cat(parts).unique() if parts else torch.zeros(0, dtype=torch.int64, device=self.device)
            out[g.name] = slots[slots >= g.block_size]  # null block slots are never live
        return out
