"""Torch twin of the stamp op: which step, batch row and expected position each new ring row has.

A Python loop over the violation rows the step appended (rare), each vectorised over the plan's
entries; the twin reads the two ring counts on the host (stacked rings: one ring after another).
Contract: ``kvcanary.ops.stamp``.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.ops.constants import (
    VIOLATION_FIELD_EXPECTED_AUX,
    REQ_POOL_IDX_PADDING,
    STAMP_UNKNOWN,
    VIOLATION_FIELD_EXPECTED_TOKEN,
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
    WRITE_FAIL_REASONS,
    FailReason,
)
from kvcanary.ops.hashing import CHAIN_HEAD_HASH, to_signed64
from kvcanary.ops.records import VerifyPlan, WritePlan

H0_SIGNED = to_signed64(CHAIN_HEAD_HASH)


def _first(mask: torch.Tensor) -> int:
    """Index of the first True in a 1-D bool tensor, or -1."""
    hit = mask.nonzero()
    return int(hit[0, 0]) if hit.numel() else -1


def _pick_entry(cursor: int, *candidates: torch.Tensor) -> int:
    """The first entry after ``cursor`` matching the first candidate mask that has one, trying
    each mask in order; then the same from entry 0. -1 when no mask matches anywhere."""
    n = candidates[0].shape[0]
    later = torch.arange(n, device=candidates[0].device) > cursor
    for mask in candidates:
        i = _first(mask & later)
        if i >= 0:
            return i
    for mask in candidates:
        i = _first(mask)
        if i >= 0:
            return i
    return -1


class _VerifySide:
    """Verify entries of the step and the batch row each belongs to."""

    def __init__(self, plan: VerifyPlan, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, window: int):
        capacity = int(plan.verify_slot_indices.shape[0])
        n = min(max(int(plan.verify_num_valid[0]), 0), capacity) if int(plan.enable[0]) != 0 else 0
        self.slots = plan.verify_slot_indices[:n].to(torch.int64)
        self.tokens = plan.verify_expected_tokens[:n].to(torch.int64)
        self.positions = plan.verify_expected_positions[:n].to(torch.int64)
        self.prev = plan.verify_prev_slot_indices[:n].to(torch.int64)
        rp = req_pool_indices.to(torch.int64)
        p = prefix_lens.to(torch.int64)[: rp.shape[0]]
        lo = torch.clamp(p - window, min=0) if window > 0 else torch.zeros_like(p)
        count = torch.where(rp != REQ_POOL_IDX_PADDING, torch.clamp(p - lo, min=0), torch.zeros_like(p))
        self.ends = torch.cumsum(count, 0)
        self.cursor = -1

    def stamp(self, slot: int, position: int, expected_token: int, bits: int, expected_chain: int) -> tuple[int, int]:
        same_slot = self.slots == slot
        token_fits = (self.tokens == expected_token) if expected_token != -1 else torch.ones_like(same_slot)
        position_fits = (self.positions != position) == bool(bits & FailReason.VERIFY_POSITION_MISMATCH)
        # an entry whose predecessor is the chain head expected H0; an unreachable one (0) expected anything
        chain_fits = (self.prev == 0) | ((self.prev < 0) == (expected_chain == H0_SIGNED))
        i = _pick_entry(self.cursor, same_slot & token_fits & position_fits & chain_fits, same_slot)
        if i < 0:
            return STAMP_UNKNOWN, STAMP_UNKNOWN
        self.cursor = i
        row = int(torch.searchsorted(self.ends, torch.tensor([i], device=self.ends.device), right=True)[0])
        batch_row = row if row < self.ends.shape[0] else STAMP_UNKNOWN
        return batch_row, int(self.positions[i])


class _WriteSide:
    """Write entries of the step and the batch row each belongs to."""

    def __init__(self, plan: WritePlan, out_cache_loc: torch.Tensor, positions: torch.Tensor):
        seeds = int(plan.write_seed_slot_indices.shape[0])
        self.a = min(max(int(plan.write_num_valid_reqs[0]), 0), seeds)
        m = int(plan.write_offsets[self.a])
        m = min(max(m, 0), int(out_cache_loc.shape[0]), int(positions.shape[0]))
        self.slots = out_cache_loc[:m].to(torch.int64)
        self.positions = positions[:m].to(torch.int64)
        self.offsets = plan.write_offsets[: self.a].to(torch.int64)
        self.cursor = -1

    def stamp(self, slot: int, position: int) -> tuple[int, int]:
        i = _pick_entry(self.cursor, (self.slots == slot) & (self.positions == position))
        if i < 0:
            return STAMP_UNKNOWN, STAMP_UNKNOWN
        self.cursor = i
        rows = (self.offsets <= i).nonzero()
        return (int(rows[-1, 0]) if rows.numel() else STAMP_UNKNOWN), STAMP_UNKNOWN


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
    """Stamp ring rows ``[clamp(rows_from), clamp(write_index))`` with (step, batch row,
    expected position). Mutates only those rows of ``stamps``. A [k, cap, 8] ring stamps each
    ring t in turn with ``violation_write_index[t]``, ``rows_from[t]`` and ``stamps[t]``."""
    if violation_ring.dim() == 3:
        ends, starts = violation_write_index.reshape(-1), rows_from.reshape(-1)
        for t in range(violation_ring.shape[0]):
            stamp_violation_rows_torch_reference(
                violation_ring=violation_ring[t], violation_write_index=ends[t : t + 1], rows_from=starts[t : t + 1],
                stamps=stamps[t], step=step, verify_plan=verify_plan, write_plan=write_plan,
                out_cache_loc=out_cache_loc, positions=positions, req_pool_indices=req_pool_indices,
                prefix_lens=prefix_lens, swa_window_size=swa_window_size,
            )
        return
    cap = int(violation_ring.shape[0])
    lo = min(max(int(rows_from[0]), 0), cap)
    hi = min(max(int(violation_write_index[0]), 0), cap)
    if hi <= lo:
        return
    verify = write = None
    if verify_plan is not None and req_pool_indices is not None and prefix_lens is not None:
        verify = _VerifySide(verify_plan, req_pool_indices, prefix_lens, int(swa_window_size))
    if write_plan is not None and out_cache_loc is not None and positions is not None:
        write = _WriteSide(write_plan, out_cache_loc, positions)
    rows = violation_ring[lo:hi].tolist()
    step_value = int(step[0])
    out = []
    for row in rows:
        slot, position = row[VIOLATION_FIELD_SLOT_IDX], row[VIOLATION_FIELD_POSITION]
        bits = row[VIOLATION_FIELD_FAIL_REASON_BITS]
        if bits & WRITE_FAIL_REASONS:
            batch_row, expected = write.stamp(slot, position) if write else (STAMP_UNKNOWN, STAMP_UNKNOWN)
        elif verify is not None:
            batch_row, expected = verify.stamp(slot, position, row[VIOLATION_FIELD_EXPECTED_TOKEN], bits,
                                               row[VIOLATION_FIELD_EXPECTED_AUX])
        else:
            batch_row, expected = STAMP_UNKNOWN, STAMP_UNKNOWN
        out.append((step_value, batch_row, expected))
    stamps[lo:hi] = torch.tensor(out, dtype=stamps.dtype, device=stamps.device)
