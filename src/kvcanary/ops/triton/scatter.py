"""Triton scatter of expected token ids into the request table (docs/design.md §3.8).

One program per batch row copies ``flat_in[offsets[r] : offsets[r] + n]`` (int64 -> int32) into
``pool_out[req_pool_indices[r], :n]``. Batch rows sharing a request row behave as a sequential
loop (the later row wins): each program first finds the longest later row with the same
request row and copies only the columns past it. A request row outside the table writes nothing
(the launcher raises for one before launching, except under CUDA-graph capture).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.ops.triton.launch import jit_batch_sized

_BLOCK = 1024


@jit_batch_sized('bs')
def _scatter_kernel(flat_ptr, off_ptr, rp_ptr, out_ptr, out_stride, out_cstride, width, bs, n_rows,
                    BLOCK: tl.constexpr):
    r = tl.program_id(0)
    rp = tl.load(rp_ptr + r)
    start = tl.load(off_ptr + r)
    n = tl.minimum(tl.load(off_ptr + r + 1) - start, width)
    n = n * ((rp >= 0) & (rp < n_rows)).to(tl.int64)  # a request row outside the table writes nothing
    # Columns [0, covered) are overwritten by a later batch row with the same request row.
    covered = tl.zeros([], tl.int64)
    for b in range(r + 1, bs, BLOCK):
        rows = b + tl.arange(0, BLOCK)
        m = rows < bs
        same = m & (tl.load(rp_ptr + rows, mask=m, other=-1) == rp)
        o0 = tl.load(off_ptr + rows, mask=same, other=0)
        o1 = tl.load(off_ptr + rows + 1, mask=same, other=0)
        later_n = tl.where(same, tl.minimum(o1 - o0, width), 0)
        covered = tl.maximum(covered, tl.max(later_n, 0))
    line = out_ptr + rp * out_stride
    for c in range(covered, n, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        m = cols < n
        v = tl.load(flat_ptr + start + cols, mask=m, other=0)
        tl.store(line + cols * out_cstride, v.to(tl.int32), mask=m)


def launch_scatter(
    *, flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor, pool_out: torch.Tensor
) -> None:
    """Triton twin of ``scatter_req_token_ids_torch_reference`` (arguments already checked)."""
    bs = int(req_pool_indices.shape[0])
    if bs == 0 or flat_in.numel() == 0 or pool_out.shape[1] == 0:
        return
    _scatter_kernel[(bs,)](
        flat_in, offsets, req_pool_indices, pool_out, pool_out.stride(0), pool_out.stride(1), pool_out.shape[1], bs,
        pool_out.shape[0], BLOCK=_BLOCK, num_warps=4,
    )
