"""Torch twin of the expected-token scatter (docs/design.md §3.8); does not validate."""
from __future__ import annotations

import torch

from kvcanary.ops.reference.common import last_occurrence_mask, segment_ids


def scatter_req_token_ids_torch_reference(
    *, flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor, pool_out: torch.Tensor
) -> None:
    """``pool_out[req_pool_indices[r], :n] = int32(flat_in[offsets[r]:offsets[r]+n])``,
    ``n = min(offsets[r+1] - offsets[r], pool_out.shape[1])``; rows with ``n <= 0`` write nothing."""
    bs = int(req_pool_indices.shape[0])
    if bs == 0 or flat_in.numel() == 0:
        return
    offs = offsets.to(torch.int64)
    start = offs[:bs]
    n = torch.clamp(offs[1 : bs + 1] - start, max=int(pool_out.shape[1]))
    n = torch.clamp(n, min=0)
    total = int(n.sum())
    if total == 0:
        return
    row_of, col = segment_ids(n)
    src = flat_in[start[row_of] + col]
    rows = req_pool_indices.to(torch.int64)[row_of]
    # Batch rows sharing a request row: the later batch row wins, as in a sequential loop.
    last = last_occurrence_mask(rows * int(pool_out.shape[1]) + col)
    pool_out[rows[last], col[last]] = src[last].to(torch.int32)
