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
from kvcanary.runtime.batch import BatchDescription, GroupBatch, classify_forward


def find_model_runner(kv_tensor: Optional[torch.Tensor] = None):
    """The worker's ``GPUModelRunner`` (``CPUModelRunner`` on CPU), found once, read only (the connector
    API hands out no runner): first up the call stack — the connector is called from the runner's
    ``execute_model`` — then among the garbage collector's objects (which miss objects vLLM froze
    with ``gc.freeze``). With several candidates, the one holding ``kv_tensor`` among its ``kv_caches``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and GPUModelRunner in type(candidate).__mro__:
            return candidate
        frame = frame.f_back
    found = [o for o in gc.get_objects() if GPUModelRunner in type(o).__mro__]
    if kv_tensor is not None and len(found) > 1:
        ptr = kv_tensor.data_ptr()
        found = [r for r in found if any(t.data_ptr() == ptr for t in getattr(r, "kv_caches", []) or [])] or found
    if len(found) != 1:
        raise KvCanaryRuntimeError(
            f"kv-canary: expected one vLLM model runner in this worker, found {len(found)}; "
            "the vLLM adapter supports the V1 model runner"
        )
    return found[0]


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
    slots_reused: int = 0  # full-attention slots written again after their block was freed (eviction, reuse)


class WorkerView:
    """Keeps the canary's per-request tables and builds one `BatchDescription` per forward."""

    def __init__(self, *, runner, layouts: list[GroupLayout], max_requests: int, max_context: int,
                 device: torch.device) -> None:
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
        self.read_slots: dict[str, torch.Tensor] = {}  # per group: slots of positions < seq_len of the last forward
        full = next((g for g in layouts if g.name == "full"), None)
        self._ever_written = torch.zeros(full.num_slots if full else 0, dtype=torch.bool, device=self.device)

    # ---- scheduler events ----------------------------------------------------------------------
    def apply(self, *, tokens: dict, finished, preempted, contexts: Optional[dict] = None) -> None:
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
    def describe(self, attn_metadata: dict) -> Optional[BatchDescription]:
        """The `BatchDescription` of the forward about to run, or None for a forward without tokens."""
        first = attn_metadata[self.layouts[0].layer_names[0]]
        num_reqs = int(first.query_start_loc.shape[0]) - 1
        req_ids = list(self.runner.input_batch.req_ids[:num_reqs])
        if len(req_ids) != num_reqs:
            raise KvCanaryRuntimeError(
                f"kv-canary: the attention metadata has {num_reqs} rows, the model runner's batch "
                f"{len(req_ids)}; unexpected vLLM batch layout"
            )
        qsl = first.query_start_loc[: num_reqs + 1].to(torch.int64).cpu()
        seq = first.seq_lens[:num_reqs].to(torch.int64).cpu()
        query = (qsl[1:] - qsl[:-1]).tolist()
        seq_l = seq.tolist()
        prefix = [s - q for s, q in zip(seq_l, query)]
        num_tokens = int(qsl[-1]) if num_reqs else 0
        if num_tokens == 0:
            return None
        if max(seq_l) > self.max_context:
            raise KvCanaryRuntimeError(
                f"kv-canary: a request reaches {max(seq_l)} tokens, beyond max_context={self.max_context}"
            )
        rows = [self.rows.get(rid) for rid in req_ids]
        first = [rid not in self.computed for rid in req_ids]
        self._count_events(req_ids, prefix, query)
        dev = self.device
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        tables, written = {}, {}
        for g in self.layouts:
            meta = attn_metadata[g.layer_names[0]]
            tables[g.name] = self._fill_table(g, meta, rows_t, seq, num_reqs)
            written[g.name] = meta.slot_mapping[:num_tokens].to(device=dev, dtype=torch.int64)
        if "full" in written:
            w = written["full"][written["full"] >= 0]
            self.events.slots_reused += int(self._ever_written[w].sum())
            self._ever_written[w] = True
        input_ids = self.runner.input_ids.gpu[:num_tokens].to(device=dev, dtype=torch.int64)
        positions = self.runner.positions[:num_tokens].to(device=dev, dtype=torch.int64)
        lens = self._fill_tokens(req_ids, rows, seq_l)
        shared = self._same_step_shares(rows, prefix, first, written, positions)
        canary_prefix = [p - k for p, k in zip(prefix, shared)]
        canary_extend = [q + k for q, k in zip(query, shared)]
        if any(shared):
            input_ids, positions, written = self._claim_shared(
                rows, prefix, shared, qsl.tolist(), input_ids, positions, written)
        for rid, s in zip(req_ids, seq_l):
            self.computed[rid] = s
        for name, w in written.items():  # TAIL re-hashes the slots actually written, too
            self.read_slots[name] = torch.cat([self.read_slots[name], w[w > 0]])
        groups = {g.name: GroupBatch(req_to_token=tables[g.name], out_cache_loc=written[g.name]) for g in self.layouts}
        keys = [self.contexts.get(rid, 0) for rid in req_ids]
        self.keyed = self.keyed or any(keys)
        self.events.same_step_shared += sum(1 for k in shared if k)
        return BatchDescription(
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            prefix_lens=torch.tensor(canary_prefix, dtype=torch.int64),
            extend_lens=torch.tensor(canary_extend, dtype=torch.int64),
            input_ids=input_ids,
            positions=positions,
            groups=groups,
            request_ids=tuple(req_ids),
            token_table=self.token_table,
            token_table_lens=torch.tensor(lens, dtype=torch.int64, device=dev),
            forward_kind=classify_forward(prefix, query),
            context_keys=torch.tensor(keys, dtype=torch.int64) if self.keyed else None,
        )

    def _fill_table(self, g: GroupLayout, meta, rows_t, seq, num_reqs: int) -> torch.Tensor:
        """Write each row's position -> slot table from the block table attention reads."""
        table = self.req_to_token[g.name]
        max_s = int(seq.max())
        pos = torch.arange(max_s, dtype=torch.int64)
        bt = meta.block_table[:num_reqs, : (max_s + g.block_size - 1) // g.block_size].to(torch.int64).cpu()
        blocks = bt[:, pos // g.block_size]
        slots = blocks * g.block_size + pos % g.block_size
        keep = pos[None, :] < seq[:, None]
        if g.sliding_window:
            keep &= blocks > 0  # blocks vLLM dropped behind the window: null block -> padding, never verified
        slots = torch.where(keep, slots, torch.zeros_like(slots))
        table[rows_t, :max_s] = slots.to(device=self.device, dtype=torch.int32)
        self.read_slots[g.name] = slots[slots > 0].to(self.device)  # what TAIL re-hashes (with the writes)
        return table

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

    def _claim_shared(self, rows, prefix, shared, qsl, input_ids, positions, written):
        """Rebuild the flattened token arrays with each sharing row's same-step positions prepended to
        its own tokens (it claims the same slot, position and token as the row that writes them)."""
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

    def _fill_tokens(self, req_ids: list[str], rows: list[int], seq: list[int]) -> list[int]:
        """Copy newly known history into the token table; the known length per batch row."""
        lens = []
        for rid, row, s in zip(req_ids, rows, seq):
            hist = self.history.tokens.get(rid, [])
            known = min(len(hist), self.max_context)
            have = self.filled.get(rid, 0)
            if have > known:
                have = 0
            if known > have:
                self.token_table[row, have:known] = torch.tensor(hist[have:known], dtype=torch.int32, device=self.device)
                self.filled[rid] = known
            lens.append(min(known, s))
        return lens

    def _count_events(self, req_ids, prefix, query) -> None:
        for rid, p, q in zip(req_ids, prefix, query):
            first = rid not in self.computed
            if first and rid in self.preempted:
                self.events.resumed += 1
                self.preempted.discard(rid)
            elif first and p > 0:
                self.events.prefix_hits += 1
            elif not first and p > 0 and q > 1:
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
