"""Torch twins of the paged-KV bookkeeping ops (docs/design.md §3.10); they do not validate."""
from __future__ import annotations

from typing import Optional

import torch


def block_table_slots_torch_reference(*, block_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                                      block_size: int, width: Optional[int], drop_null: bool, table_out: torch.Tensor) -> None:
    """Per batch row r, column p < width: ``table_out[rows[r], p] = block_table[r, p // block_size] * block_size +
    p % block_size`` where ``p < seq_lens[r]`` (and, with ``drop_null``, that block is not 0), else 0. Rows outside
    ``[0, table_out.shape[0])`` write nothing. ``width=None``: positions ``p < seq_lens[r]`` only (the rest of each
    row kept; reads the lengths on the host)."""
    bs = int(rows.shape[0])
    to_seq = width is None
    if to_seq:  # rows past the block table's own read nothing
        bs = min(bs, int(block_table.shape[0]))
        rows = rows[:bs]
        width = min(int(seq_lens[:bs].max()), table_out.shape[1]) if bs else 0
    if bs == 0 or width <= 0:
        return
    dev = table_out.device
    pos = torch.arange(width, dtype=torch.int64, device=dev)
    seq = seq_lens[:bs].to(torch.int64)
    inside = pos[None, :] < seq[:, None]
    keep = inside.clone()
    nblk = min((width + block_size - 1) // block_size, int(block_table.shape[1]))
    blk = pos // block_size
    keep &= (blk < nblk)[None, :]
    if nblk:
        blocks = block_table[:bs, :nblk].to(torch.int64)[:, blk.clamp_max(nblk - 1)]
    else:
        blocks = torch.zeros(bs, width, dtype=torch.int64, device=dev)
    if drop_null:
        keep &= blocks > 0
    slots = torch.where(keep, blocks * block_size + pos % block_size, torch.zeros_like(blocks))
    r = rows.to(torch.int64)
    ok = (r >= 0) & (r < table_out.shape[0])
    if to_seq:  # keep each row's columns at and past its length
        slots = torch.where(inside, slots, table_out[r.clamp(0, table_out.shape[0] - 1), :width].to(torch.int64))
    table_out[r[ok], :width] = slots[ok].to(table_out.dtype)


def mark_written_slots_torch_reference(*, slots: torch.Tensor, ever_written: torch.Tensor,
                                       rewritten: torch.Tensor) -> None:
    """For each slot ``s`` in ``[0, len(ever_written))``: ``rewritten += ever_written[s]``, then ``ever_written[s] = 1``;
    other entries (negative: not stored) are skipped."""
    s = slots.to(torch.int64)
    s = s[(s >= 0) & (s < ever_written.shape[0])]
    if s.numel() == 0:
        return
    rewritten += ever_written[s].to(torch.int64).sum()
    ever_written[s] = 1
