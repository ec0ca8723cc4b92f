"""Translate one transformers continuous-batching forward into the runtime's `BatchDescription`.

Everything here only *reads* the engine: the forward's keyword arguments (``input_ids``,
``position_ids``, ``cu_seq_lens_q``, ``cu_seq_lens_k``, per-group ``write_index`` / ``read_index`` or
``block_table``, ``cache``), the batch processor's ``requests_in_batch`` (request ids and token
histories, batch order = the forward's sequence order), the allocators' block tables and ledgers
(live slots for the sweep).

Per batch row ``i`` with ``P`` = first position and ``E`` = query length:

* written slots (``out_cache_loc``) come from ``write_index`` (or, on the decode fast path, from the
  block table). Trash rows are not stored (-1): a sliding-window chunk longer than the window sends
  its first ``E - W`` tokens to the write trash, so the canary skips them too (no slot is written
  twice in one launch); the chain then jumps from the seed to the first stored token, a link that is
  never judged because its predecessor is outside the window.
* the position -> slot table row comes from what attention *reads*: ``read_index`` (full attention:
  positions ``[0, P + E)``; sliding window: the ``min(P, W - 1)`` newest cached positions, then sentinel
  rows for the new tokens). A read redirected to a wrong slot therefore shows up in the canary.
* sliding window: a ring slot is reused by position ``p + W``. Positions below ``P + E - W`` are
  overwritten during this forward, so they are left out of the table (slot 0 = padding, never
  verified, and the window head's chain link is not followed): nothing is ever checked against a
  recycled slot.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Optional

import torch

from kvcanary.engines.transformers_cb.layout import PADDING_SLOT, GroupLayout
from kvcanary.runtime.batch import BatchDescription, GroupBatch


def find_batch_processor(cache):
    """The ``ContinuousBatchProcessor`` that owns ``cache`` (read-only discovery, once per cache).

    The forward's kwargs carry the cache but not the request states; the processor that built the
    batch holds them in ``inputs_and_outputs.requests_in_batch``.
    """
    for ref in gc.get_referrers(cache):
        if getattr(ref, "cache", None) is cache and hasattr(ref, "inputs_and_outputs") and hasattr(ref, "scheduler"):
            return ref
    raise RuntimeError(
        "kv-canary: could not find the continuous-batching processor that owns this PagedAttentionCache; "
        "kvcanary supports model.generate_batch / init_continuous_batching of transformers==5.24.0"
    )


@dataclass
class RequestRows:
    """Request id -> row of the canary's request tables (row 0 is the padding row)."""

    max_requests: int

    def __post_init__(self) -> None:
        self.row_of: dict[str, int] = {}
        self.free = list(range(self.max_requests, 0, -1))

    def get(self, request_id: str) -> tuple[int, bool]:
        """The request's row, and whether it was just assigned."""
        row = self.row_of.get(request_id)
        if row is not None:
            return row, False
        if not self.free:
            raise RuntimeError(
                f"kv-canary: more than max_requests={self.max_requests} live requests; "
                "attach with a larger max_requests"
            )
        row = self.free.pop()
        self.row_of[request_id] = row
        return row, True

    def release_missing(self, live_ids) -> list[int]:
        gone = [rid for rid in self.row_of if rid not in live_ids]
        rows = [self.row_of.pop(rid) for rid in gone]
        self.free.extend(rows)
        return rows


class ForwardTranslator:
    """Keeps the per-request tables on the canary's device and builds one `BatchDescription` per forward."""

    def __init__(self, *, cache, layouts: list[GroupLayout], max_requests: int, max_context: int, device) -> None:
        self.cache = cache
        self.layouts = layouts
        self.device = torch.device(device)
        self.max_context = max_context
        self.rows = RequestRows(max_requests)
        shape = (max_requests + 1, max_context)
        self.req_to_token = {g.name: torch.zeros(shape, dtype=torch.int32, device=self.device) for g in layouts}
        self.token_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.token_filled = [0] * (max_requests + 1)
        self.last_extend: dict[str, int] = {}  # request id -> query length of its latest forward
        self.processor = find_batch_processor(cache)

    # ------------------------------------------------------------------------------------------------
    def requests_in_batch(self) -> list:
        return list(self.processor.inputs_and_outputs.requests_in_batch)

    def describe(self, kwargs: dict, step: int) -> BatchDescription:
        """The `BatchDescription` of the forward about to run with ``kwargs``."""
        future_states = self.requests_in_batch()
        bs = len(future_states)
        cu_q = kwargs["cu_seq_lens_q"][: bs + 1].to(torch.int64).cpu().tolist()
        num_tokens = cu_q[-1]
        positions_all = kwargs["position_ids"][0, :num_tokens]
        first_pos = positions_all[torch.tensor(cu_q[:-1], dtype=torch.int64, device=positions_all.device)] if bs else positions_all[:0]
        first_pos = first_pos.to(torch.int64).cpu().tolist()

        live = self.processor.scheduler.active_requests
        self.rows.release_missing(live)
        for rid in [rid for rid in self.last_extend if rid not in live]:
            del self.last_extend[rid]
        rows, prefix, extend, ids = [], [], [], []
        for i, fs in enumerate(future_states):
            state = fs.state
            p, e = int(first_pos[i]), cu_q[i + 1] - cu_q[i]
            if e != fs.query_length:
                raise RuntimeError(
                    f"kv-canary: batch row {i} ({state.request_id}) has {e} query tokens in the forward but "
                    f"{fs.query_length} in the scheduler; unexpected transformers batch layout"
                )
            if p + e > self.max_context:
                raise RuntimeError(
                    f"kv-canary: request {state.request_id} reaches position {p + e - 1}, beyond "
                    f"max_context={self.max_context}; attach with a larger max_context"
                )
            row, fresh = self.rows.get(state.request_id)
            if fresh:
                self.token_filled[row] = 0
            self.last_extend[state.request_id] = e
            rows.append(row)
            prefix.append(p)
            extend.append(e)
            ids.append(state.request_id)

        dev = self.device
        groups = {}
        for g in self.layouts:
            groups[g.name] = self._group_batch(g, kwargs, rows, prefix, extend, cu_q, future_states)
        token_lens = self._fill_token_table(future_states, rows, prefix, extend)
        kind = _forward_kind(prefix, extend)
        return BatchDescription(
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
            prefix_lens=torch.tensor(prefix, dtype=torch.int64, device=dev),
            extend_lens=torch.tensor(extend, dtype=torch.int64, device=dev),
            input_ids=kwargs["input_ids"][0, :num_tokens].to(device=dev, dtype=torch.int64),
            positions=positions_all.to(device=dev, dtype=torch.int64),
            groups=groups,
            request_ids=tuple(ids),
            token_table=self.token_table,
            token_table_lens=torch.tensor(token_lens, dtype=torch.int64, device=dev),
            forward_kind=kind,
            extra={"step": step},
        )

    # ------------------------------------------------------------------------------------------------
    def _group_batch(self, g: GroupLayout, kwargs, rows, prefix, extend, cu_q, future_states) -> GroupBatch:
        dev = self.device
        table = self.req_to_token[g.name]
        block_table = kwargs.get("block_table")
        writes = []
        if block_table is not None:  # decode fast path: the attention kernel reads and writes via pages
            bt = block_table[g.index]
            for i, row in enumerate(rows):
                p, e = prefix[i], extend[i]
                pages = bt[i].to(torch.int64)
                pages = pages[pages >= 0] // g.pages_stride
                slots = g.block_slots(pages.tolist(), p + e, dev)
                table[row].zero_()
                table[row, : p + e] = slots.to(torch.int32)
                writes.append(slots[p : p + e])
            return GroupBatch(req_to_token=table, out_cache_loc=torch.cat(writes) if writes else _empty(dev))

        write_index = kwargs["write_index"][g.index]
        read_index = kwargs["read_index"][g.index]
        cu_k = kwargs["cu_seq_lens_k"][g.layer_type][: len(rows) + 1].to(torch.int64).cpu().tolist()
        has_reads = read_index.numel() > 0
        for i, row in enumerate(rows):
            p, e = prefix[i], extend[i]
            w = g.physical_to_slot(write_index[cu_q[i] : cu_q[i + 1]], for_write=True).to(dev)
            table[row].zero_()
            if g.sliding_window:
                win = g.sliding_window
                lo = max(0, p + e - win)
                if has_reads and p > lo:
                    cached = min(p, win - 1)
                    seg = read_index[cu_k[i] : cu_k[i] + cached]
                    r = g.physical_to_slot(seg, for_write=False).to(dev)
                    table[row, lo:p] = r[lo - (p - cached) :].to(torch.int32)
                start = max(p, lo)
                table[row, start : p + e] = w[start - p :].to(torch.int32)
            else:
                if has_reads and p > 0:
                    seg = read_index[cu_k[i] : cu_k[i] + p]
                    table[row, :p] = g.physical_to_slot(seg, for_write=False).to(dev, torch.int32)
                table[row, p : p + e] = w.clamp_min(PADDING_SLOT).to(torch.int32)
            writes.append(w)
        return GroupBatch(req_to_token=table, out_cache_loc=torch.cat(writes) if writes else _empty(dev))

    def _fill_token_table(self, future_states, rows, prefix, extend) -> list[int]:
        """Token history (prompt + generated) per row, appended incrementally; valid length per batch row."""
        lens = []
        for fs, row, p, e in zip(future_states, rows, prefix, extend):
            state = fs.state
            init, gen = state.initial_tokens, state.generated_tokens
            total = min(len(init) + len(gen), p + e, self.max_context)
            have = min(self.token_filled[row], total)
            if total > have:
                hist = (init[have:total] if have < len(init) else []) + gen[max(0, have - len(init)) : total - len(init)]
                self.token_table[row, have:total] = torch.tensor(hist, dtype=torch.int32, device=self.device)
                self.token_filled[row] = total
            lens.append(total)
        return lens

    # ------------------------------------------------------------------------------------------------
    def live_slots(self, *, exclude_batch_extend: Optional[dict] = None) -> dict[str, torch.Tensor]:
        """Every slot holding live KV, per group: written positions of running requests and every slot
        of the blocks kept cached for prefix sharing (sliding window: the window's positions, less a
        window head whose predecessor slot the same forward recycled). ``exclude_batch_extend`` maps request id -> number
        of tokens of this forward not stored yet (for a sweep taken before the forward)."""
        active = self.processor.scheduler.active_requests
        pending = exclude_batch_extend or {}
        out = {}
        for g in self.layouts:
            alloc = self.cache.cache_allocators[g.layer_type]
            parts = []
            for rid, blocks in alloc.block_table.items():
                state = active.get(rid)
                if state is None or not blocks:
                    continue
                n = int(state.position_offset) - int(pending.get(rid, 0))
                if g.sliding_window:
                    head = max(0, n - g.sliding_window)
                    if self.last_extend.get(rid, 0) >= g.sliding_window and head > 0:
                        # the window head's predecessor slot was recycled within the same forward
                        # (a chunk of >= W tokens): its chain link cannot be judged, skip it
                        head += 1
                    pos = torch.arange(head, n, device=self.device)
                    if pos.numel():
                        parts.append(g.ring_slots(blocks, pos))
                else:
                    n = min(n, len(blocks) * g.page_size)
                    parts.append(g.block_slots(blocks, n, self.device))
            cached = list(alloc.ledger.cached_blocks)
            if cached:
                parts.append(g.block_slots(cached, len(cached) * g.page_size, self.device))
            slots = torch.cat(parts).unique() if parts else _empty(self.device)
            out[g.name] = slots[slots > PADDING_SLOT]
        return out


def _forward_kind(prefix: list[int], extend: list[int]) -> str:
    if not extend:
        return "idle"
    if all(e == 1 for e in extend) and all(p > 0 for p in prefix):
        return "decode"
    if all(e > 1 or p == 0 for p, e in zip(prefix, extend)):
        return "prefill"
    return "mixed"


def _empty(device) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64, device=device)
