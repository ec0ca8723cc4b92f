"""Triton stamp (contract: ``kvcanary.ops.stamp``): one small program per ring, no host reads.

Program t (grid ``(k,)`` for k stacked rings, ``(1,)`` for one) stamps ring t: it reads the ring's
counts, and for each new row walks the shared plan's entries in blocks to find the row's entry
(four candidate minima in one pass for a verify row, two for a write row) and the batch row
holding it. With no new rows it does two loads and exits.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvcanary.ops.records import VerifyPlan, WritePlan
from kvcanary.ops.triton.constants import (
    R_AUX, R_BITS, R_EXPECTED_TOKEN, R_POSITION, R_SLOT, REQ_PADDING, RING_FIELDS, S_BATCH_ROW, S_EXPECTED_POSITION,
    S_STEP, STAMP_FIELDS, UNKNOWN, VERIFY_POSITION, WRITE_REASONS,
)
from kvcanary.ops.triton.hashing import H0_SIGNED
from kvcanary.ops.triton.launch import jit_batch_sized, pdl_enabled, pdl_release, pdl_wait

_NONE = tl.constexpr(2**62)
H0 = tl.constexpr(H0_SIGNED)
_BLOCK = 1024
_WARPS = 4


@triton.jit
def _verify_entry(slot, position, exp_tok, pos_bad, aux_is_head, cursor, v_slot_ptr, v_tok_ptr, v_pos_ptr, v_prev_ptr, n,
                  BLOCK: tl.constexpr):
    """The verify entry of a ring row: first entry after ``cursor`` with the row's slot that
    fits it, else the first after ``cursor`` with the slot, else the same two from entry 0
    (``_NONE`` when the slot is nowhere)."""
    lanes = tl.arange(0, BLOCK)
    fit_after = tl.zeros([], tl.int64) + _NONE
    slot_after = tl.zeros([], tl.int64) + _NONE
    fit_any = tl.zeros([], tl.int64) + _NONE
    slot_any = tl.zeros([], tl.int64) + _NONE
    for s in range(0, n, BLOCK):
        i = s + lanes.to(tl.int64)
        m = i < n
        same = m & (tl.load(v_slot_ptr + i, mask=m, other=0) == slot)
        tok = tl.load(v_tok_ptr + i, mask=same, other=0)
        pos = tl.load(v_pos_ptr + i, mask=same, other=0)
        prev = tl.load(v_prev_ptr + i, mask=same, other=0)
        # an entry whose predecessor is the chain head expected H0; an unreachable one (0) expected anything
        chain_fits = (prev == 0) | ((prev < 0) == aux_is_head)
        fits = same & ((exp_tok == -1) | (tok == exp_tok)) & ((pos != position) == pos_bad) & chain_fits
        after = i > cursor
        fit_after = tl.minimum(fit_after, tl.min(tl.where(fits & after, i, _NONE), 0))
        slot_after = tl.minimum(slot_after, tl.min(tl.where(same & after, i, _NONE), 0))
        fit_any = tl.minimum(fit_any, tl.min(tl.where(fits, i, _NONE), 0))
        slot_any = tl.minimum(slot_any, tl.min(tl.where(same, i, _NONE), 0))
    e = tl.where(fit_after < _NONE, fit_after, slot_after)
    e = tl.where(e < _NONE, e, fit_any)
    return tl.where(e < _NONE, e, slot_any)


@triton.jit
def _verify_row_of(e, rp_ptr, prefix_ptr, bs, window, BLOCK: tl.constexpr):
    """Batch row whose verify range holds entry e (ranges in plan order), or UNKNOWN."""
    lanes = tl.arange(0, BLOCK)
    base = tl.zeros([], tl.int64)
    below = tl.zeros([], tl.int64)  # rows whose range ends at or before e
    for s in range(0, bs, BLOCK):
        r = s + lanes
        m = r < bs
        rp = tl.load(rp_ptr + r, mask=m, other=0).to(tl.int64)
        p = tl.load(prefix_ptr + r, mask=m, other=0).to(tl.int64)
        if window > 0:
            lo = tl.maximum(p - window, 0)
        else:
            lo = p * 0
        c = tl.where(m & (rp != REQ_PADDING), tl.maximum(p - lo, 0), 0)
        ends = base + tl.cumsum(c, 0)
        below += tl.sum((m & (ends <= e)).to(tl.int64), 0)
        base += tl.sum(c, 0)
    return tl.where(below < bs, below, UNKNOWN)


@triton.jit
def _write_entry(slot, position, cursor, loc_ptr, pos_ptr, m_entries, BLOCK: tl.constexpr):
    """The write entry of a ring row: first entry after ``cursor`` storing (slot, position),
    else the first such entry (``_NONE`` when there is none)."""
    lanes = tl.arange(0, BLOCK)
    after_best = tl.zeros([], tl.int64) + _NONE
    any_best = tl.zeros([], tl.int64) + _NONE
    for s in range(0, m_entries, BLOCK):
        i = s + lanes.to(tl.int64)
        m = i < m_entries
        hit = m & (tl.load(loc_ptr + i, mask=m, other=-1).to(tl.int64) == slot)
        hit = hit & (tl.load(pos_ptr + i, mask=hit, other=0).to(tl.int64) == position)
        after_best = tl.minimum(after_best, tl.min(tl.where(hit & (i > cursor), i, _NONE), 0))
        any_best = tl.minimum(any_best, tl.min(tl.where(hit, i, _NONE), 0))
    return tl.where(after_best < _NONE, after_best, any_best)


@triton.jit
def _write_row_of(e, off_ptr, a, BLOCK: tl.constexpr):
    """Largest batch row r < a with write_offsets[r] <= e, or UNKNOWN."""
    lanes = tl.arange(0, BLOCK)
    best = tl.zeros([], tl.int64) + UNKNOWN
    for s in range(0, a, BLOCK):
        r = s + lanes.to(tl.int64)
        m = r < a
        o = tl.load(off_ptr + r, mask=m, other=0)
        best = tl.maximum(best, tl.max(tl.where(m & (o <= e), r, UNKNOWN), 0))
    return best


@jit_batch_sized('v_cap', 'bs', 'seed_cap', 'n_loc', scalar_ptrs=(
    'widx_ptr', 'from_ptr', 'step_ptr', 'v_num_ptr', 'v_enable_ptr', 'w_num_ptr'))
def _stamp_kernel(
    ring_ptr, widx_ptr, from_ptr, stamps_ptr, step_ptr, cap,     # k rings, counts, stamps
    v_slot_ptr, v_tok_ptr, v_pos_ptr, v_prev_ptr, v_num_ptr, v_enable_ptr, v_cap,
    rp_ptr, prefix_ptr, bs, window,                              # batch rows (verify ranges)
    w_off_ptr, w_num_ptr, seed_cap, loc_ptr, wpos_ptr, n_loc,    # write plan + flattened entries
    HAS_VERIFY: tl.constexpr, HAS_WRITE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pdl_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    ring_ptr += t * cap * RING_FIELDS
    stamps_ptr += t * cap * STAMP_FIELDS
    widx_ptr += t
    from_ptr += t
    lo = tl.minimum(tl.maximum(tl.load(from_ptr).to(tl.int64), 0), cap)
    hi = tl.minimum(tl.maximum(tl.load(widx_ptr).to(tl.int64), 0), cap)
    if hi > lo:
        step = tl.load(step_ptr)
        n = tl.zeros([], tl.int64)
        if HAS_VERIFY:
            n = tl.minimum(tl.maximum(tl.load(v_num_ptr).to(tl.int64), 0), v_cap)
            n = tl.where(tl.load(v_enable_ptr) != 0, n, 0)
        a = tl.zeros([], tl.int64)
        m_entries = tl.zeros([], tl.int64)
        if HAS_WRITE:
            a = tl.minimum(tl.maximum(tl.load(w_num_ptr).to(tl.int64), 0), seed_cap)
            m_entries = tl.minimum(tl.maximum(tl.load(w_off_ptr + a), 0), n_loc)
        v_cursor = tl.zeros([], tl.int64) - 1
        w_cursor = tl.zeros([], tl.int64) - 1
        for j in range(lo, hi):
            row = ring_ptr + j * RING_FIELDS
            slot = tl.load(row + R_SLOT)
            position = tl.load(row + R_POSITION)
            bits = tl.load(row + R_BITS)
            batch_row = tl.zeros([], tl.int64) + UNKNOWN
            expected = tl.zeros([], tl.int64) + UNKNOWN
            if (bits & WRITE_REASONS) != 0:
                if HAS_WRITE:
                    e = _write_entry(slot, position, w_cursor, loc_ptr, wpos_ptr, m_entries, BLOCK)
                    if e < _NONE:
                        w_cursor = e
                        batch_row = _write_row_of(e, w_off_ptr, a, BLOCK)
            else:
                if HAS_VERIFY:
                    exp_tok = tl.load(row + R_EXPECTED_TOKEN)
                    pos_bad = (bits & VERIFY_POSITION) != 0
                    aux_is_head = tl.load(row + R_AUX) == H0
                    e = _verify_entry(slot, position, exp_tok, pos_bad, aux_is_head, v_cursor, v_slot_ptr, v_tok_ptr,
                                      v_pos_ptr, v_prev_ptr, n, BLOCK)
                    if e < _NONE:
                        v_cursor = e
                        batch_row = _verify_row_of(e, rp_ptr, prefix_ptr, bs, window, BLOCK)
                        expected = tl.load(v_pos_ptr + e)
            out = stamps_ptr + j * STAMP_FIELDS
            tl.store(out + S_STEP, step)
            tl.store(out + S_BATCH_ROW, batch_row)
            tl.store(out + S_EXPECTED_POSITION, expected)


def launch_stamp(
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
    pdl: bool = True,
) -> None:
    """Triton twin of ``stamp_violation_rows_torch_reference`` (arguments already checked): one
    launch, one program per ring of a [k, cap, 8] ring (one for [cap, 8])."""
    dev = violation_ring.device
    k = violation_ring.shape[0] if violation_ring.dim() == 3 else 1
    has_verify = verify_plan is not None and req_pool_indices is not None and prefix_lens is not None
    has_write = write_plan is not None and out_cache_loc is not None and positions is not None
    dummy_i64, dummy_i32 = step, violation_write_index
    if has_verify:
        v = (verify_plan.verify_slot_indices, verify_plan.verify_expected_tokens, verify_plan.verify_expected_positions,
             verify_plan.verify_prev_slot_indices, verify_plan.verify_num_valid, verify_plan.enable, verify_plan.verify_slot_indices.shape[0],
             req_pool_indices, prefix_lens, req_pool_indices.shape[0], int(swa_window_size))
    else:
        v = (dummy_i64, dummy_i64, dummy_i64, dummy_i64, dummy_i32, dummy_i32, 0, dummy_i64, dummy_i64, 0, 0)
    if has_write:
        n_loc = min(out_cache_loc.shape[0], positions.shape[0])
        w = (write_plan.write_offsets, write_plan.write_num_valid_reqs, write_plan.write_seed_slot_indices.shape[0],
             out_cache_loc, positions, n_loc)
    else:
        w = (dummy_i64, dummy_i32, 0, dummy_i64, dummy_i64, 0)
    use_pdl = pdl_enabled(dev, pdl)
    _stamp_kernel[(k,)](
        violation_ring, violation_write_index, rows_from, stamps, step, violation_ring.shape[-2], *v, *w,
        HAS_VERIFY=has_verify, HAS_WRITE=has_write, BLOCK=_BLOCK, PDL=use_pdl, num_warps=_WARPS,
        launch_pdl=use_pdl,
    )
