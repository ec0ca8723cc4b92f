"""Translate one vLLM worker forward into the runtime's `BatchDescription` (worker side, read only).

Sources, per forward (all read, nothing written):

* the forward context's attention metadata, one object per KV cache group (taken from the group's
  first layer): ``query_start_loc`` and ``seq_lens`` (prefix = seq_len - query_len), ``block_table``
  (kernel block ids — what attention *reads*) and ``slot_mapping`` (what the forward *writes*);
* the model runner's persistent batch: ``input_batch.req_ids`` (request id of each batch row, in
  the attention metadata's row order), ``input_ids`` and ``positions`` (what the model is fed);
* the token oracle: the scheduler's own record of each request's tokens (prompt + sampled so far),
  shipped in the connector metadata (`TokenHistory`); positions the scheduler has not seen yet
  (async scheduling's in-flight token) are left unknown, not guessed;
* each request's context key (LoRA adapter, cache salt), from the same metadata: a batch row's
  ``context_keys`` entry, so KV computed under one context and served to another fails its chain.

Position -> slot table (``req_to_token``) of a row: ``block_table[row, p // B] * B + p % B`` for
``p < seq_len`` — built from what attention reads, so a stale or redirected block table entry makes
the canary verify the wrong slot and fail there. Slot 0 (null block) is the padding slot.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvcanary.engines.vllm.layout import GroupLayout
from kvcanary.errors import KvCanaryRuntimeError
from kvcanary.ops.paged import launch_block_table_slots_kernel, launch_mark_written_slots_kernel
from kvcanary.runtime.batch import BatchDescription, GroupBatch, classify_forward
from kvcanary.runtime.upload import ColumnUpload


def find_model_runner(kv_tensor: Optional[torch.Tensor] = None):
    """The worker's model runner — V1 ``GPUModelRunner`` (``CPUModelRunner`` on CPU) or the V2 runner
    (``vllm.v1.worker.gpu.model_runner``, vLLM's default on CUDA) — found once, read only (the connector API
    hands out no runner): first up the call stack — the connector is called from the runner's
    ``execute_model`` — then among the garbage collector's objects (which miss objects vLLM froze with
    ``gc.freeze``). With several candidates, the one holding ``kv_tensor`` among its ``kv_caches``."""
    from kvcanary.engines.vllm.compat import model_runner_classes

    classes = model_runner_classes()

    def is_runner(obj) -> bool:
        mro = type(obj).__mro__
        return any(c in mro for c in classes)

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and is_runner(candidate):
            return candidate
        frame = frame.f_back
    found = [o for o in gc.get_objects() if is_runner(o)]
    if kv_tensor is not None and len(found) > 1:
        ptr = kv_tensor.data_ptr()
        found = [r for r in found if any(t.data_ptr() == ptr for t in _runner_kv_tensors(r))] or found
    if len(found) != 1:
        raise KvCanaryRuntimeError(
            f"kv-canary: expected one vLLM model runner in this worker, found {len(found)}; "
            "the vLLM adapter supports vLLM's V1 and V2 model runners"
        )
    return found[0]


def _runner_kv_tensors(runner) -> list:
    caches = getattr(runner, "kv_caches", None) or []
    return list(caches.values()) if isinstance(caches, dict) else list(caches)


def is_v2_runner(runner) -> bool:
    """True for vLLM's V2 model runner (``vllm.v1.worker.gpu``): its batch is a per-step ``InputBatch``."""
    return type(runner).__module__.startswith("vllm.v1.worker.gpu.") or any(
        c.__module__.startswith("vllm.v1.worker.gpu.") for c in type(runner).__mro__)


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """One forward as the model runner holds it, right before the model runs.

    req_ids / query / prefix: per batch row (attention-metadata order), on the host: request id, tokens
    scheduled, positions already cached. input_ids / positions: ``[>= sum(query)]`` on the engine's device
    (the runner's own buffers, not copied). attn_metadata: layer name -> the backend's metadata (block
    table, slot mapping), as attention will read it.
    """

    req_ids: tuple
    query: list
    prefix: list
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: dict
    graph_mode: str = ""  # V2 runner: the step's CUDA-graph mode (FULL, PIECEWISE, NONE); "" when not known


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


def v2_step(input_batch, attn_metadata: dict, graph_mode: str = "") -> StepInputs:
    """`StepInputs` of a V2 runner's forward: lengths from the batch's host arrays (no device read)."""
    n = int(input_batch.num_reqs)
    query = [int(x) for x in input_batch.num_scheduled_tokens[:n]]
    prefix = [int(x) for x in input_batch.num_computed_tokens_np[:n]]
    return StepInputs(req_ids=tuple(input_batch.req_ids[:n]), query=query, prefix=prefix,
                      input_ids=input_batch.input_ids, positions=input_batch.positions, attn_metadata=attn_metadata,
                      graph_mode=graph_mode)


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
            return v2_step(batch, attn, graph_mode=str(mode))
        frame = frame.f_back
    return None


class RequestRows:
    """Request id -> row of the canary's request tables (row 0 is the padding row)."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.row_of: dict[str, int] = {}
        self.free = list(range(max_requests, 0, -1))

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

    def release(self, request_id: str) -> Optional[int]:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.free.append(row)
        return row


@dataclass
class TokenHistory:
    """Per request: the tokens the scheduler has recorded, by position (prompt, then sampled)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)

    def extend(self, request_id: str, start: int, new: list[int]) -> None:
        have = self.tokens.setdefault(request_id, [])
        if start != len(have):  # resent from scratch (e.g. after the worker lost track)
            del have[start:]
            if start > len(have):
                return
        have.extend(new)

    def drop(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)


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
                 device: torch.device, track_read_slots: bool = False) -> None:
        self.runner = runner
        self.layouts = layouts
        self.device = torch.device(device)
        self.max_context = max_context
        self.rows = RequestRows(max_requests)
        shape = (max_requests + 1, max_context)
        self.req_to_token = {g.name: torch.zeros(shape, dtype=torch.int32, device=self.device) for g in layouts}
        self.token_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.filled: dict[str, int] = {}  # request id -> token_table columns written
        self.history = TokenHistory()
        self.computed: dict[str, int] = {}  # request id -> positions stored as of its latest forward
        self.preempted: set[str] = set()
        self.contexts: dict[str, int] = {}  # request id -> context key (LoRA adapter / cache salt), when not 0
        self.keyed = False  # a request with a context key was seen: every batch carries context keys from then on
        self.events = ForwardEvents()
        self.drafts: dict[str, int] = {}
        # per group: slots of positions < seq_len of the last forward (kept only for adapters that mirror KV)
        self.track_read_slots = track_read_slots
        self.read_slots: dict[str, torch.Tensor] = {}
        full = next((g for g in layouts if g.name == "full"), None)
        self._ever_written = torch.zeros(full.num_slots if full else 0, dtype=torch.uint8, device=self.device)
        self._reused = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._upload = ColumnUpload(self.device)

    # ---- scheduler events ----------------------------------------------------------------------
    def apply(self, *, tokens: dict, finished, preempted, contexts: Optional[dict] = None,
              drafts: Optional[dict] = None) -> None:
        self.drafts = dict(drafts or {})  # this step's draft tokens per request (speculative decoding)
        for rid in preempted:
            self.computed.pop(rid, None)
            self.preempted.add(rid)
        for rid in finished:
            self.history.drop(rid)
            self.computed.pop(rid, None)
            self.filled.pop(rid, None)
            self.preempted.discard(rid)
            self.contexts.pop(rid, None)
            self.rows.release(rid)
        self.contexts.update(contexts or {})
        for rid, (start, new) in tokens.items():
            self.history.extend(rid, int(start), list(new))

    # ---- one forward ---------------------------------------------------------------------------
    def describe(self, step: StepInputs) -> Optional[BatchDescription]:
        """The `BatchDescription` of the forward about to run, or None for a forward without tokens.

        No device read on the way and a handful of launches whatever the batch: the host columns (rows, lengths,
        context keys, the token history learnt since the last forward) go up in one pinned non-blocking copy, each
        group's position -> slot table is one kernel over the block table attention reads, the runner's input ids,
        positions and slot mapping are handed over as they are (the runtime stages them). So on a GPU the engine's
        stream is never waited for — except on the first forward of a request that hits the prefix cache, see
        `_same_step_shares`."""
        req_ids, query, prefix = list(step.req_ids), list(step.query), list(step.prefix)
        num_tokens = sum(query)
        if num_tokens == 0:
            return None
        seq_l = [p + q for p, q in zip(prefix, query)]
        max_s = max(seq_l)
        if max_s > self.max_context:
            raise KvCanaryRuntimeError(
                f"kv-canary: a request reaches {max_s} tokens, beyond max_context={self.max_context}"
            )
        rows = [self.rows.get(rid) for rid in req_ids]
        first = [rid not in self.computed for rid in req_ids]
        self._count_events(req_ids, prefix, query)
        if self.drafts:
            self.events.draft_tokens += sum(self.drafts.get(rid, 0) for rid in req_ids)
        lens, at_rows, at_cols, values = self._token_updates(req_ids, rows, seq_l)
        keys = [self.contexts.get(rid, 0) for rid in req_ids] if self.contexts or self.keyed else None
        self.keyed = self.keyed or any(keys or ())
        host = (rows, seq_l, prefix, query, lens, at_rows, at_cols, values) + ((keys,) if self.keyed else ())
        rows_t, seq_t, prefix_t, extend_t, lens_t, at_r, at_c, at_v, *keys_t = self._upload(*host)
        if values:
            self.token_table[at_r, at_c] = at_v.to(torch.int32)
        tables, written = self._tables(step, rows_t, seq_t, max_s, num_tokens)
        input_ids = step.input_ids[:num_tokens]
        positions = step.positions[:num_tokens]
        if input_ids.device != self.device:
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        shared = self._same_step_shares(rows, prefix, first, written, positions)
        if any(shared):
            input_ids, positions, written = self._claim_shared(rows, prefix, shared, query, input_ids, positions, written)
            prefix_t, extend_t = self._upload([p - k for p, k in zip(prefix, shared)],
                                              [q + k for q, k in zip(query, shared)])
            self.events.same_step_shared += sum(1 for k in shared if k)
        for rid, n in zip(req_ids, seq_l):
            self.computed[rid] = n
        if self.track_read_slots:
            for name, w in written.items():  # TAIL re-hashes the slots actually written, too
                self.read_slots[name] = torch.cat([self.read_slots[name], w[w > 0]])
        groups = {g.name: GroupBatch(req_to_token=tables[g.name], out_cache_loc=written[g.name]) for g in self.layouts}
        return BatchDescription(
            req_pool_indices=rows_t,
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            input_ids=input_ids,
            positions=positions,
            groups=groups,
            request_ids=tuple(req_ids),
            token_table=self.token_table,
            token_table_lens=lens_t,
            forward_kind=classify_forward(prefix, query, [bool(self.drafts.get(rid)) for rid in req_ids]),
            context_keys=keys_t[0] if keys_t else None,
        )

    def _tables(self, step: StepInputs, rows_t, seq_t, max_s: int, num_tokens: int) -> tuple[dict, dict]:
        """Per group: the position -> slot table (from the block table attention reads) and the slots written."""
        tables, written = {}, {}
        for g in self.layouts:
            meta = step.attn_metadata[g.layer_names[0]]
            tables[g.name] = self._fill_table(g, meta, rows_t, seq_t, max_s)
            written[g.name] = meta.slot_mapping[:num_tokens].to(device=self.device, dtype=torch.int64)
        if "full" in written:
            launch_mark_written_slots_kernel(slots=written["full"], ever_written=self._ever_written,
                                             rewritten=self._reused)
        return tables, written

    def _fill_table(self, g: GroupLayout, meta, rows_t, seq_t, max_s: int) -> torch.Tensor:
        """Write each row's position -> slot table from the block table attention reads (one kernel, on the device);
        a sliding-window group's null blocks (dropped behind the window) become padding, never verified."""
        table = self.req_to_token[g.name]
        bt = meta.block_table
        if bt.device != self.device or bt.stride(-1) != 1:
            bt = bt.to(self.device).contiguous()
        launch_block_table_slots_kernel(block_table=bt, rows=rows_t, seq_lens=seq_t, block_size=g.block_size,
                                        width=max_s, table_out=table, drop_null=bool(g.sliding_window))
        if self.track_read_slots:
            slots = table[rows_t, :max_s].to(torch.int64)
            self.read_slots[g.name] = slots[slots > 0]  # what TAIL re-hashes (with the writes)
        return table

    def slots_reused(self) -> int:
        """Full-attention slots written again after their block was freed (a device read)."""
        return int(self._reused[0])

    def _same_step_shares(self, rows, prefix, first, written, positions) -> list[int]:
        """Per batch row: how many trailing prefix positions this same forward writes (a prefix-cache
        hit on blocks another row computes in this forward — vLLM caches a block when it is scheduled,
        and within each layer all KV writes precede attention, so the read is legitimate).

        A position counts only if, in every group, the row's table slot is written by this forward *at
        that position*; anything else stays in the verified prefix (and fails there if it is wrong)."""
        out = [0] * len(rows)
        todo = [i for i, (p, f) in enumerate(zip(prefix, first)) if f and p > 0]
        if not todo:
            return out
        maps = {}
        for g in self.layouts:
            w = written[g.name]
            keep = w >= 0
            order = torch.argsort(w[keep])
            maps[g.name] = (w[keep][order], positions[keep][order])
        for i in todo:
            p = prefix[i]
            lo = p
            for g in self.layouts:
                slots_w, pos_w = maps[g.name]
                if slots_w.numel() == 0:
                    lo = p
                    break
                cand = self.req_to_token[g.name][rows[i], :p].to(torch.int64)
                idx = torch.searchsorted(slots_w, cand).clamp_max(slots_w.numel() - 1)
                hit = (slots_w[idx] == cand) & (pos_w[idx] == torch.arange(p, device=cand.device))
                miss = (~hit).nonzero().flatten()
                g_lo = int(miss[-1]) + 1 if miss.numel() else 0
                lo = g_lo if g is self.layouts[0] else max(lo, g_lo)
            out[i] = p - lo
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

    def _token_updates(self, req_ids: list[str], rows: list[int], seq: list[int]) -> tuple[list, list, list, list]:
        """Newly known history for the token table, as ``(known length per batch row, table rows, columns, tokens)``
        (host lists; one upload with the rest of the forward's columns)."""
        lens, at_rows, at_cols, values = [], [], [], []
        tokens = self.history.tokens
        for rid, row, s in zip(req_ids, rows, seq):
            hist = tokens.get(rid, ())
            known = min(len(hist), self.max_context)
            have = self.filled.get(rid, 0)
            if have > known:
                have = 0
            if known > have:
                at_rows.extend([row] * (known - have))
                at_cols.extend(range(have, known))
                values.extend(hist[have:known])
                self.filled[rid] = known
            lens.append(min(known, s))
        return lens, at_rows, at_cols, values

    def _count_events(self, req_ids, prefix, query) -> None:
        for rid, p, q in zip(req_ids, prefix, query):
            first = rid not in self.computed
            if first and rid in self.preempted:
                self.events.resumed += 1
                self.preempted.discard(rid)
            elif first and p > 0:
                self.events.prefix_hits += 1
            elif not first and p > 0 and q > 1 and not self.drafts.get(rid):  # a verify row is no prefill chunk
                self.events.chunked += 1

    # ---- sweep ---------------------------------------------------------------------------------
    def live_slots(self, cached_blocks: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """Slots holding live KV: stored positions of running requests, plus the valid tokens of the
        blocks the scheduler keeps in its prefix cache (``(block id, tokens, group index)``)."""
        out = {}
        for g in self.layouts:
            table = self.req_to_token[g.name]
            parts = []
            for rid, n in self.computed.items():
                row = self.rows.row_of.get(rid)
                if row is None or n <= 0:
                    continue
                lo = max(0, n - g.window_left) if g.sliding_window else 0  # what its next query reads
                parts.append(table[row, lo:n].to(torch.int64))
            mine = [(b, n) for b, n, gi in cached_blocks if gi == g.index and not g.sliding_window]
            if mine:
                parts.append(g.manager_block_slots(mine, self.device))
            slots = torch.cat(parts).unique() if parts else torch.zeros(0, dtype=torch.int64, device=self.device)
            out[g.name] = slots[slots >= g.block_size]  # null block slots are never live
        return out
