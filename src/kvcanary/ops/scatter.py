"""Scatter of expected token ids into the request table (docs/design.md §3.8): launcher with checks."""
from __future__ import annotations

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.dispatch import capturing, triton_backend
from kvcanary.ops.reference.plan import check_request_rows
from kvcanary.ops.reference.scatter import scatter_req_token_ids_torch_reference

_OP = "scatter_req_token_ids"


def launch_scatter_req_token_ids_kernel(
    *, flat_in: torch.Tensor, offsets: torch.Tensor, req_pool_indices: torch.Tensor, pool_out: torch.Tensor
) -> None:
    """``pool_out[req_pool_indices[r], :n] = int32(flat_in[offsets[r]:offsets[r]+n])`` per row r.

    flat_in int64 [N]; offsets int64 [bs+1]; req_pool_indices int64 [bs]; pool_out int32
    [max_reqs, max_ctx] (mutated); n is clipped to the table width.

    A request row outside ``[0, max_reqs)`` (row 0, the padding row, is a valid target) raises
    ``KvCanaryValueError`` before anything is written — a host read of ``req_pool_indices``. While
    the stream is capturing a CUDA graph that check is skipped and the Triton kernel writes nothing
    for such a row: never out of bounds.
    """
    args = (("flat_in", flat_in, 1), ("offsets", offsets, 1), ("req_pool_indices", req_pool_indices, 1), ("pool_out", pool_out, 2))
    for name, t, ndim in args:
        if not isinstance(t, torch.Tensor):
            raise KvCanaryTypeError(f"kv-canary: {_OP} {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise KvCanaryValueError(f"kv-canary: {_OP} {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    for name, t, _ in args:
        want = torch.int32 if name == "pool_out" else torch.int64
        if t.dtype != want:
            raise KvCanaryTypeError(f"kv-canary: {_OP} {name} must be {str(want).removeprefix('torch.')}, got {t.dtype}")
    bs = req_pool_indices.shape[0]
    if offsets.shape[0] != bs + 1:
        raise KvCanaryValueError(f"kv-canary: {_OP} offsets length {offsets.shape[0]} != bs+1 ({bs + 1})")
    for name, t, _ in args:
        if t.device != pool_out.device:
            raise KvCanaryValueError(f"kv-canary: {_OP} {name} is on {t.device}, expected {pool_out.device}")
    if not capturing(pool_out.device):
        check_request_rows(_OP, req_pool_indices, int(pool_out.shape[0]))
    backend = triton_backend(pool_out.device)
    impl = backend.launch_scatter if backend else scatter_req_token_ids_torch_reference
    impl(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices, pool_out=pool_out)
