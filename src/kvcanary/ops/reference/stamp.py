"""Torch twin of the stamp op: say which step, batch row and expected position each new ring row has.

Contract: `kvcanary.ops.stamp.launch_stamp_violation_rows`. Loops over violation *rows* (rare), each
search vectorised over the plan's entries.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.ops.constants import (
    REQ_POOL_IDX_PADDING,
    VIOLATION_FIELD_EXPECTED_TOKEN,
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
    FailReason,
)
from kvcanary.ops.records import VerifyPlan, WritePlan

_WRITE_BITS = int(FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH)
_POSITION_BIT = int(FailReason.VERIFY_POSITION_MISMATCH)


def _first(mask: torch.Tensor, after: int) -> int:
    """Index of the first True at or past ``after + 1``, else -1."""
    hits = torch.nonzero(mask[after + 1 :]).flatten()
    return int(hits[0]) + after + 1 if hits.numel() else -1


def stamp_violation_rows_torch_reference(
    *,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    rows_from: torch.Tensor,
    stamps: torch.Tensor,
    step: torch.Tensor,
    verify_plan: Optional[VerifyPlan] = None,
    write_plan: Optional[WritePlan] = None,
    out_cache_loc: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    req_pool_indices: Optional[torch.Tensor] = None,
    prefix_lens: Optional[torch.Tensor] = None,
    swa_window_size: int = 0,
) -> None:
    """Write ``stamps[j] = (step, batch_row, expected_position)`` for ring rows ``[rows_from, write_index)``."""
    cap = int(violation_ring.shape[0])
    lo = min(max(int(rows_from[0]), 0), cap)
    hi = min(max(int(violation_write_index[0]), 0), cap)
    if hi <= lo:
        return
    rows = violation_ring[lo:hi].to("cpu").tolist()
    step_value = int(step[0])

    v_ok = verify_plan is not None and req_pool_indices is not None and prefix_lens is not None
    if v_ok:
        n = min(max(int(verify_plan.verify_num_valid[0]), 0), int(verify_plan.verify_slot_indices.shape[0]))
        if int(verify_plan.enable[0]) == 0:
            n = 0
        v_slots = verify_plan.verify_slot_indices[:n].to(torch.int64)
        v_tok = verify_plan.verify_expected_tokens[:n].to(torch.int64)
        v_pos = verify_plan.verify_expected_positions[:n].to(torch.int64)
        rp = req_pool_indices.to(torch.int64)
        p = prefix_lens.to(torch.int64)
        w = int(swa_window_size)
        lo_r = torch.clamp(p - w, min=0) if w > 0 else torch.zeros_like(p)
        counts = torch.where(rp != REQ_POOL_IDX_PADDING, torch.clamp(p - lo_r, min=0), torch.zeros_like(p))
        v_ends = torch.cumsum(counts, 0)
    w_ok = write_plan is not None and out_cache_loc is not None and positions is not None
    if w_ok:
        a = min(max(int(write_plan.write_num_valid_reqs[0]), 0), int(write_plan.write_seed_slot_indices.shape[0]))
        offsets = write_plan.write_offsets[: a + 1].to(torch.int64)
        m = int(offsets[a]) if a > 0 else 0
        w_loc = out_cache_loc[:m].to(torch.int64)
        w_pos = positions[:m].to(torch.int64)

    out = []
    v_cursor = w_cursor = -1
    for row in rows:
        slot, position = row[VIOLATION_FIELD_SLOT_IDX], row[VIOLATION_FIELD_POSITION]
        entry = batch_row = expected = -1
        if row[VIOLATION_FIELD_FAIL_REASON_BITS] & _WRITE_BITS:
            if w_ok and m > 0:
                match = (w_loc == slot) & (w_pos == position)
                entry = _first(match, w_cursor)
                if entry < 0:
                    entry = _first(match, -1)
                if entry >= 0:
                    w_cursor = entry
                    batch_row = int(torch.searchsorted(offsets[1:a], torch.tensor(entry), right=True))
        elif v_ok and n > 0:
            same = v_slots == slot
            tok = row[VIOLATION_FIELD_EXPECTED_TOKEN]
            pos_bad = bool(row[VIOLATION_FIELD_FAIL_REASON_BITS] & _POSITION_BIT)
            fits = same & ((v_tok == tok) | (tok == -1)) & ((v_pos != position) == pos_bad)
            for mask, after in ((fits, v_cursor), (same, v_cursor), (fits, -1), (same, -1)):
                entry = _first(mask, after)
                if entry >= 0:
                    break
            if entry >= 0:
                v_cursor = entry
                batch_row = int(torch.searchsorted(v_ends, torch.tensor(entry), right=True))
                expected = int(v_pos[entry])
        out.append([step_value, batch_row, expected])
    stamps[lo:hi] = torch.tensor(out, dtype=torch.int64, device=stamps.device)
