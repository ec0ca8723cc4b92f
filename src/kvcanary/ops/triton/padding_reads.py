"""Triton padding-read check (docs/design.md §3.12): read positions of live rows whose slot is the padding slot.

One persistent launch, ``_padding_read_kernel``: tile t = (batch row ``t // tiles_per_row``, positions block
``t % tiles_per_row`` of that row's read range); each program takes every nprog-th tile, reads the row's request
row and prefix (two scalar loads), and, for a tile inside the range, loads the table's entries, translates them
through the LUT and appends a row per hole: one ring reservation (atomic) per tile that found any, the stamp
written beside each stored row. Rows of one tile keep position order; tiles land in any order (docs/design.md
§3.9's one freedom). No host reads, grid from host-known sizes: capturable.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvcanary.ops.constants import FailReason
from kvcanary.ops.triton.constants import (
    REQ_PADDING, S_BATCH_ROW, S_EXPECTED_POSITION, S_STEP, SLOT_PADDING, STAMP_FIELDS,
)
from kvcanary.ops.triton.launch import jit_batch_sized, num_sms, pdl_enabled, pdl_release, pdl_wait
from kvcanary.ops.triton.ring import reserve_rows, store_rows

PADDING_READ = tl.constexpr(int(FailReason.VERIFY_PADDING_SLOT_READ))
_BLOCK = 1024
_PROGRAMS_PER_SM = 4


@jit_batch_sized('n_tiles', 'kind', scalar_ptrs=('widx_ptr', 'step_ptr'))
def _padding_read_kernel(
    rp_ptr, prefix_ptr, shared_ptr, rtt_ptr, rtt_stride0, rtt_stride1, n_rows, width, window, head_skip,
    lut_ptr, lut_len, ring_ptr, ring_cap, widx_ptr, stamps_ptr, step_ptr, kind, tiles_per_row, n_tiles,
    HAS_LUT: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    k = tl.arange(0, BLOCK).to(tl.int64)
    for t in range(pid, n_tiles, nprog):
        r = t // tiles_per_row
        first = (t % tiles_per_row) * BLOCK
        rp = tl.load(rp_ptr + r).to(tl.int64)
        p = tl.load(prefix_ptr + r).to(tl.int64)
        active = (rp != REQ_PADDING) & (rp >= 0) & (rp < n_rows)
        if window > 0:
            start = p
            if HAS_SHARED:
                start += tl.load(shared_ptr + r).to(tl.int64)
            lo = tl.maximum(start - window + head_skip, 0)
        else:
            lo = p * 0
        count = tl.where(active, tl.maximum(tl.minimum(p, width) - lo, 0), 0)
        if first < count:
            m = first + k < count
            pos = lo + first + k
            raw = tl.load(rtt_ptr + rp * rtt_stride0 + pos * rtt_stride1, mask=m, other=-1).to(tl.int64)
            if HAS_LUT:
                inside = m & (raw >= 0) & (raw < lut_len)
                looked = tl.load(lut_ptr + raw, mask=inside, other=-1).to(tl.int64)
                slot = tl.where(raw < 0, raw, looked)
            else:
                slot = raw
            hole = m & (slot == SLOT_PADDING)
            n_holes = tl.sum(hole.to(tl.int32), 0)
            if n_holes > 0:
                row = reserve_rows(widx_ptr, hole.to(tl.int32))
                zero = tl.zeros([BLOCK], tl.int64)
                store_rows(ring_ptr, ring_cap, row, hole, zero + kind, zero + SLOT_PADDING, pos, zero, zero - 1, zero,
                           raw, zero + PADDING_READ)
                keep = hole & (row >= 0) & (row < ring_cap)
                out = stamps_ptr + row * STAMP_FIELDS
                tl.store(out + S_STEP, zero + tl.load(step_ptr), mask=keep)
                tl.store(out + S_BATCH_ROW, zero + r, mask=keep)
                tl.store(out + S_EXPECTED_POSITION, pos, mask=keep)


def launch_padding_read_check(
    *,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
    full_to_swa_index_mapping: Optional[torch.Tensor],
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    stamps: torch.Tensor,
    step: torch.Tensor,
    kernel_kind: int,
    ring_window: bool = False,
    shared_lens: Optional[torch.Tensor] = None,
    pdl: bool = True,
) -> None:
    """Triton twin of ``padding_read_check_torch_reference`` (arguments already checked by the public launcher)."""
    bs = int(req_pool_indices.shape[0])
    n_rows, width = int(req_to_token.shape[0]), int(req_to_token.shape[1])
    if bs == 0 or n_rows == 0 or width == 0:
        return
    window = max(int(swa_window_size), 0)
    span = min(width, window) if window > 0 else width
    tiles_per_row = max(1, triton.cdiv(span, _BLOCK))
    n_tiles = bs * tiles_per_row
    dev = req_to_token.device
    use_pdl = pdl_enabled(dev, pdl)
    lut = full_to_swa_index_mapping
    lut_args = (lut, int(lut.shape[0])) if lut is not None else (req_to_token, 0)
    grid = (max(1, min(n_tiles, num_sms(dev) * _PROGRAMS_PER_SM)),)
    _padding_read_kernel[grid](
        req_pool_indices, prefix_lens, shared_lens if shared_lens is not None else prefix_lens, req_to_token,
        req_to_token.stride(0), req_to_token.stride(1), n_rows, width, window, int(bool(ring_window)), *lut_args, violation_ring, int(violation_ring.shape[0]),
        violation_write_index, stamps, step, int(kernel_kind), tiles_per_row, n_tiles,
        HAS_LUT=lut is not None, HAS_SHARED=shared_lens is not None and window > 0, BLOCK=_BLOCK, PDL=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )
