"""Torch twin of the padding-read check (docs/design.md §3.12); it does not validate.

Contract: ``kvcanary.ops.padding_reads``. Vectorised over the read entries (no per-entry Python loop); it
reads the number of holes on the host (a twin may).
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.ops.constants import (
    REQ_POOL_IDX_PADDING,
    TOKEN_TO_KV_SLOT_PADDING,
    FailReason,
)
from kvcanary.ops.reference.common import segment_ids, violation_rows


def read_ranges(req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, *, n_rows: int, width: int, window: int,
                ring_window: bool, shared_lens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first position, entries) per batch row, int64 [bs]: the positions ``[lo, lo + count)`` a row reads from the
    cache. A padding row (request row 0) or one outside ``[0, n_rows)`` reads none; ``lo = 0`` for full attention,
    ``max(P + S - W, 0)`` for a window ``W > 0`` with ``S = shared_lens[r]`` (0 without them; ``+ 1`` with
    ``ring_window``); the range stops at ``min(P, width)``."""
    rp = req_pool_indices.to(torch.int64)
    prefix = prefix_lens.to(torch.int64)[: rp.shape[0]]
    active = (rp != REQ_POOL_IDX_PADDING) & (rp >= 0) & (rp < n_rows)
    if window > 0:
        start = prefix if shared_lens is None else prefix + shared_lens.to(torch.int64)[: rp.shape[0]]
        lo = torch.clamp(start - window + int(bool(ring_window)), min=0)
    else:
        lo = torch.zeros_like(prefix)
    hi = torch.clamp(prefix, max=width)
    count = torch.where(active, torch.clamp(hi - lo, min=0), torch.zeros_like(prefix))
    return lo, count


def translate_slots(raw: torch.Tensor, lut: Optional[torch.Tensor]) -> torch.Tensor:
    """T(x) of the padding-read check: without a LUT ``x``; with one, negative values pass through, values in
    ``[0, len(lut))`` are looked up, and values at or past its end give -1 (never the padding slot)."""
    if lut is None:
        return raw
    n = int(lut.shape[0])
    if n == 0:
        return torch.where(raw < 0, raw, torch.full_like(raw, -1))
    looked = lut[raw.clamp(0, n - 1)].to(torch.int64)
    return torch.where(raw < 0, raw, torch.where(raw < n, looked, torch.full_like(raw, -1)))


def padding_read_check_torch_reference(
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
) -> None:
    """Append one ``VERIFY_PADDING_SLOT_READ`` row per read position of a live row whose slot resolves to the
    padding slot, in batch-row then position order, with its stamp ``(step, batch row, position)``; fill-once
    (``violation_write_index`` grows by the full count, rows and stamps past the ring's capacity are not
    stored). Mutates only the ring rows and stamps it appends and the write index."""
    n_rows, width = int(req_to_token.shape[0]), int(req_to_token.shape[1])
    lo, count = read_ranges(req_pool_indices, prefix_lens, n_rows=n_rows, width=width,
                            window=int(swa_window_size), ring_window=ring_window, shared_lens=shared_lens)
    row, local = segment_ids(count)
    if row.numel() == 0:
        return
    pos = lo[row] + local
    raw = req_to_token[req_pool_indices.to(torch.int64)[row], pos].to(torch.int64)
    hole = translate_slots(raw, full_to_swa_index_mapping) == TOKEN_TO_KV_SLOT_PADDING
    k = int(hole.sum())
    if k == 0:
        return
    row, pos, raw = row[hole], pos[hole], raw[hole]
    dev = violation_ring.device
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    rows = violation_rows(
        torch.full((1,), int(kernel_kind), dtype=torch.int64, device=dev), zero + TOKEN_TO_KV_SLOT_PADDING, pos, zero,
        zero - 1, zero, raw, torch.full((1,), int(FailReason.VERIFY_PADDING_SLOT_READ), dtype=torch.int64, device=dev),
    )
    at = int(violation_write_index[0]) + torch.arange(k, dtype=torch.int64, device=dev)
    fits = (at >= 0) & (at < violation_ring.shape[0])
    if bool(fits.any()):
        stamp = torch.stack([step.to(torch.int64).expand(k), row.to(dev), pos.to(dev)], dim=1)
        violation_ring[at[fits]] = rows[fits].to(violation_ring.dtype)
        stamps[at[fits]] = stamp[fits].to(stamps.dtype)
    violation_write_index += k
