"""Triton paged-KV bookkeeping (docs/design.md §3.10): a block table -> per-position slot table; slots written again.

``_block_table_slots_kernel``: one program per (batch row, BLOCK columns). ``_mark_written_kernel``: one program per
BLOCK slots, one atomic add each. Neither reads a value back to the host: both are safe inside a CUDA-graph capture.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvcanary.ops.triton.launch import jit_batch_sized

_BLOCK = 1024


@jit_batch_sized("bs", "width", "n_rows")
def _block_table_slots_kernel(bt_ptr, bt_stride, nblk, rows_ptr, seq_ptr, out_ptr, out_stride, width, bs, n_rows,
                              BLOCK_SIZE: tl.constexpr, DROP_NULL: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    rp = tl.load(rows_ptr + r).to(tl.int64)
    if (rp >= 0) & (rp < n_rows):
        seq = tl.load(seq_ptr + r).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        slots = _row_slots(bt_ptr + r * bt_stride, nblk, cols, inside & (cols < seq), BLOCK_SIZE, DROP_NULL)
        tl.store(out_ptr + rp * out_stride + cols, slots.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _row_slots(row_ptr, nblk, cols, keep, BLOCK_SIZE: tl.constexpr, DROP_NULL: tl.constexpr):
    """Slots of positions ``cols`` from one block-table row (0 where not ``keep``, past ``nblk``, or a null block)."""
    blk = cols // BLOCK_SIZE
    keep = keep & (blk < nblk)
    blocks = tl.load(row_ptr + blk, mask=keep, other=0).to(tl.int64)
    if DROP_NULL:
        keep = keep & (blocks > 0)
    return tl.where(keep, blocks * BLOCK_SIZE + cols % BLOCK_SIZE, 0)


@jit_batch_sized("bt_rows", "bt_stride", "nblk", "out_stride", "out_width", "n_rows")
def _block_table_rows_kernel(bt_ptr, bt_rows, bt_stride, nblk, rows_ptr, seq_ptr, out_ptr, out_stride, out_width, n_rows,
                             BLOCK_SIZE: tl.constexpr, DROP_NULL: tl.constexpr, BLOCK: tl.constexpr,
                             TILES: tl.constexpr):
    """One program per batch row: its positions ``p < seq`` (and inside the table) in TILES BLOCK-wide steps."""
    r = tl.program_id(0)
    rp = tl.load(rows_ptr + r).to(tl.int64)
    seq = tl.minimum(tl.load(seq_ptr + r).to(tl.int64), out_width)
    if (rp >= 0) & (rp < n_rows) & (seq > 0) & (r < bt_rows):
        for t in range(TILES):  # the table's width (fixed per engine); the steps past the length are masked off
            cols = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            inside = cols < seq
            slots = _row_slots(bt_ptr + r * bt_stride, nblk, cols, inside, BLOCK_SIZE, DROP_NULL)
            tl.store(out_ptr + rp * out_stride + cols, slots.to(out_ptr.dtype.element_ty), mask=inside)


@jit_batch_sized("n", "num_slots", scalar_ptrs=("count_ptr",))
def _mark_written_kernel(slots_ptr, n, ever_ptr, num_slots, count_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(slots_ptr + i, mask=m, other=-1).to(tl.int64)
    valid = m & (s >= 0) & (s < num_slots)
    seen = tl.load(ever_ptr + s, mask=valid, other=0).to(tl.int64)
    tl.store(ever_ptr + s, tl.full([BLOCK], 1, tl.uint8), mask=valid)
    tl.atomic_add(count_ptr, tl.sum(seen, 0))


def launch_block_table_slots(*, block_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                             width: Optional[int], drop_null: bool, table_out: torch.Tensor) -> None:
    """Triton twin of ``block_table_slots_torch_reference`` (arguments already checked)."""
    bs = int(rows.shape[0])
    if bs and width is None:  # to each row's length: one program per row, no host-known width
        _block_table_rows_kernel[(bs,)](
            block_table, block_table.shape[0], block_table.stride(0), int(block_table.shape[1]), rows, seq_lens, table_out,
            table_out.stride(0), table_out.shape[1], table_out.shape[0], BLOCK_SIZE=block_size, DROP_NULL=drop_null, BLOCK=_BLOCK,
            TILES=triton.cdiv(table_out.shape[1], _BLOCK), num_warps=4,
        )
        return
    if bs == 0 or width <= 0:
        return
    nblk = min((width + block_size - 1) // block_size, int(block_table.shape[1]))
    _block_table_slots_kernel[(bs, triton.cdiv(width, _BLOCK))](
        block_table, block_table.stride(0), nblk, rows, seq_lens, table_out, table_out.stride(0), width, bs,
        table_out.shape[0], BLOCK_SIZE=block_size, DROP_NULL=drop_null, BLOCK=_BLOCK, num_warps=4,
    )


def launch_mark_written(*, slots: torch.Tensor, ever_written: torch.Tensor, rewritten: torch.Tensor) -> None:
    """Triton twin of ``mark_written_slots_torch_reference`` (arguments already checked)."""
    n = int(slots.shape[0])
    if n == 0:
        return
    _mark_written_kernel[(triton.cdiv(n, _BLOCK),)](slots, n, ever_written, ever_written.shape[0], rewritten,
                                                     BLOCK=_BLOCK, num_warps=4)
