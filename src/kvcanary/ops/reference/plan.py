"""Vectorised torch twin of the plan op (docs/design.md §3.5)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.constants import REQ_POOL_IDX_PADDING
from kvcanary.ops.records import VerifyPlan, WritePlan
from kvcanary.ops.reference.common import segment_ids

_NAME = "launch_canary_plan_kernels_torch_reference"


def _translate(raw: torch.Tensor, lut: Optional[torch.Tensor]) -> torch.Tensor:
    """T(x): negative values pass through, others are looked up (range already checked)."""
    if lut is None:
        return raw
    looked_up = lut[torch.clamp(raw, min=0)].to(torch.int64)
    return torch.where(raw < 0, raw, looked_up)


def _check_lut_range(slot_raw: torch.Tensor, prev_raw: torch.Tensor, prev_looked_up: torch.Tensor, lut_len: int) -> None:
    """Raise for the first lookup (entry by entry, slot before predecessor) past the LUT."""
    bad = torch.stack([slot_raw >= lut_len, prev_looked_up & (prev_raw >= lut_len)], dim=1).flatten()
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        value = int(torch.stack([slot_raw, prev_raw], dim=1).flatten()[first])
        raise KvCanaryValueError(f"kv-canary: SWA slot {value} is outside full_to_swa_index_mapping length {lut_len}")


def request_row_bound(req_to_token: torch.Tensor, table: Optional[torch.Tensor]) -> int:
    """Rows an active request row may name: those of ``req_to_token`` and, when an expected-token
    table with columns is given, of the table too."""
    rows = int(req_to_token.shape[0])
    if table is not None and table.shape[1] > 0:
        rows = min(rows, int(table.shape[0]))
    return rows


def check_request_rows(op: str, req_pool_indices: torch.Tensor, n_rows: int) -> None:
    """Raise ``KvCanaryValueError`` for the first active batch row (request row not 0) whose request
    row is outside ``[0, n_rows)``; padding rows (0) are never checked. A host read."""
    rp = req_pool_indices.to(torch.int64)
    bad = (rp != REQ_POOL_IDX_PADDING) & ((rp < 0) | (rp >= n_rows))
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise KvCanaryValueError(
            f"kv-canary: {op} req_pool_indices[{r}]={int(rp[r])} is outside the request table rows [0, {n_rows})"
        )


def check_prefix_lens(op: str, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, width: int) -> None:
    """Raise ``KvCanaryValueError`` for the first active batch row (request row not 0) whose prefix
    length exceeds ``width`` (``req_to_token.shape[1]``): its verify entries and seed would read
    positions past the row. Padding rows are never checked; the extend length is not read (the
    plan reads positions below the prefix only). A host read."""
    active = req_pool_indices.to(torch.int64) != REQ_POOL_IDX_PADDING
    prefix = prefix_lens.to(torch.int64)
    bad = active & (prefix > width)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise KvCanaryValueError(
            f"kv-canary: {op} row {r}: prefix {int(prefix[r])} exceeds the request table width {width}"
        )


def launch_canary_plan_kernels_torch_reference(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
    full_to_swa_index_mapping: Optional[torch.Tensor],
    verify_capacity: int,
    req_to_verify_expected_tokens: Optional[torch.Tensor],
    req_to_verify_expected_tokens_valid_lens: Optional[torch.Tensor],
    kv_token_id_vs_position_offset: int,
) -> None:
    """Gather the verify entries of every active row's cached prefix (window) and the write
    offsets / seeds of its extend. Mutates only the nine plan tensors; unchanged if it raises.
    An active row whose request row is outside the request table (``request_row_bound``) raises
    ``KvCanaryValueError`` after the capacity and table checks, then one whose prefix exceeds
    ``req_to_token.shape[1]`` (``check_prefix_lens``), before any lookup. An expected-token column
    at or past the table's width is never read (token -1, as past the valid length)."""
    capacity = int(verify_plan_out.verify_slot_indices.shape[0])
    table, valid_lens = req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens
    _check_args(capacity, verify_capacity, table, valid_lens)
    check_request_rows(_NAME, req_pool_indices, request_row_bound(req_to_token, table))
    check_prefix_lens(_NAME, req_pool_indices, prefix_lens, int(req_to_token.shape[1]))
    rows = _Rows(req_pool_indices.to(torch.int64), prefix_lens.to(torch.int64), extend_seq_lens.to(torch.int64))
    lut = full_to_swa_index_mapping
    entries = _verify_entries(rows, req_to_token, int(swa_window_size), lut, table, valid_lens,
                              int(kv_token_id_vs_position_offset))
    n_seed = min(rows.count, int(write_plan_out.write_seed_slot_indices.shape[0]))
    offsets, seeds = _write_metadata(rows, req_to_token, lut)
    # Every check passed: write the outputs.
    _store_verify_plan(verify_plan_out, entries, capacity)
    _store_write_plan(write_plan_out, offsets, seeds, n_seed, rows.count)


class _Rows(NamedTuple):
    """The batch rows as int64: request rows, prefix and extend lengths."""

    rp: torch.Tensor
    prefix: torch.Tensor
    extend: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.rp.shape[0])

    @property
    def active(self) -> torch.Tensor:
        return self.rp != REQ_POOL_IDX_PADDING


class _VerifyEntries(NamedTuple):
    """The verify entries, row by row: slots, expected tokens, positions, predecessor slots (int64 [total])."""

    slots: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    prevs: torch.Tensor


def _check_args(capacity: int, verify_capacity: int, table: Optional[torch.Tensor],
                valid_lens: Optional[torch.Tensor]) -> None:
    if verify_capacity != capacity:
        raise KvCanaryValueError(
            f"kv-canary: {_NAME} verify_capacity={verify_capacity} does not match "
            f"verify_plan_out.verify_slot_indices.shape[0]={capacity}"
        )
    if table is not None and valid_lens is None:
        raise KvCanaryValueError(
            f"kv-canary: {_NAME} requires req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set"
        )


def _verify_entries(rows: _Rows, req_to_token: torch.Tensor, window: int, lut: Optional[torch.Tensor],
                    table: Optional[torch.Tensor], valid_lens: Optional[torch.Tensor], offset: int) -> _VerifyEntries:
    """Positions [lo, P) of every active row, row by row (``lo``: the window's start, 0 without a window)."""
    prefix = rows.prefix
    lo = torch.clamp(prefix - window, min=0) if window > 0 else torch.zeros_like(prefix)
    count = torch.where(rows.active, torch.clamp(prefix - lo, min=0), torch.zeros_like(prefix))
    row, local = segment_ids(count)
    pos = lo[row] + local
    row_rp = rows.rp[row]
    slot_raw = req_to_token[row_rp, pos].to(torch.int64)
    has_prev = pos > 0
    prev_raw = torch.where(
        has_prev, req_to_token[row_rp, torch.clamp(pos - 1, min=0)].to(torch.int64), torch.full_like(pos, -1)
    )
    if lut is not None:
        _check_lut_range(slot_raw, prev_raw, has_prev, int(lut.shape[0]))
    slots = _translate(slot_raw, lut)
    prevs = _translate(prev_raw, lut)
    if table is not None and table.shape[1] > 0:
        col = pos + offset
        readable = (col >= 0) & (col < valid_lens.to(torch.int64)[row]) & (col < table.shape[1])
        looked = table[row_rp, torch.clamp(col, 0, table.shape[1] - 1)].to(torch.int64)
        tokens = torch.where(readable, looked, torch.full_like(pos, -1))
    else:
        tokens = torch.full_like(pos, -1)
    return _VerifyEntries(slots, tokens, pos, prevs)


def _write_metadata(rows: _Rows, req_to_token: torch.Tensor,
                    lut: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets [bs + 1], seeds [bs]) of the writes: active rows with an extend write, a row with a prefix
    seeds from its last prefix slot (-1 otherwise)."""
    rp, prefix, extend = rows
    writes = rows.active & (extend > 0)
    contrib = torch.where(writes, extend, torch.zeros_like(extend))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=rp.device), torch.cumsum(contrib, 0)])
    seeded = writes & (prefix > 0)
    # only seeded rows are looked up: a padding row's lengths are arbitrary (CUDA-graph padding)
    seed_raw = req_to_token[
        torch.where(seeded, rp, torch.zeros_like(rp)), torch.where(seeded, prefix - 1, torch.zeros_like(prefix))
    ].to(torch.int64)
    return offsets, _translate(torch.where(seeded, seed_raw, torch.full_like(rp, -1)), lut)


def _store_verify_plan(vp: VerifyPlan, entries: _VerifyEntries, capacity: int) -> None:
    """The entries, or (more than ``capacity`` of them) the overflow state: count = capacity, disabled."""
    total = int(entries.positions.shape[0])
    if total > capacity:
        vp.verify_num_valid.fill_(capacity)
        vp.enable.fill_(0)
        return
    vp.verify_slot_indices[:total] = entries.slots
    vp.verify_expected_tokens[:total] = entries.tokens
    vp.verify_expected_positions[:total] = entries.positions
    vp.verify_prev_slot_indices[:total] = entries.prevs
    vp.verify_num_valid.fill_(total)
    vp.enable.fill_(1)


def _store_write_plan(wp: WritePlan, offsets: torch.Tensor, seeds: torch.Tensor, n_seed: int, bs: int) -> None:
    n_off = min(bs + 1, int(wp.write_offsets.shape[0]))
    wp.write_offsets[:n_off] = offsets[:n_off]
    wp.write_offsets[n_off:] = 0
    wp.write_seed_slot_indices[:n_seed] = seeds[:n_seed]
    wp.write_num_valid_reqs.fill_(bs)
