"""Plan op (docs/design.md §3.5): public launcher; checks arguments, then runs Triton or the twin."""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.checks import INDEX_DTYPES, check_tensor
from kvcanary.ops.dispatch import capturing, triton_backend
from kvcanary.ops.records import VerifyPlan, WritePlan
from kvcanary.ops.reference.plan import (
    check_prefix_lens,
    check_request_rows,
    launch_canary_plan_kernels_torch_reference,
    request_row_bound,
)

_OP = "launch_canary_plan_kernels"


def _check_plan_args(
    *, verify_plan_out, write_plan_out, req_pool_indices, prefix_lens, extend_lens, req_to_token,
    swa_window_size, full_to_swa_index_mapping, verify_capacity, req_to_verify_expected_tokens,
    req_to_verify_expected_tokens_valid_lens, kv_token_id_vs_position_offset,
) -> None:
    if not isinstance(verify_plan_out, VerifyPlan):
        raise KvCanaryTypeError(f"kv-canary: {_OP} verify_plan_out must be a VerifyPlan, got {type(verify_plan_out).__name__}")
    if not isinstance(write_plan_out, WritePlan):
        raise KvCanaryTypeError(f"kv-canary: {_OP} write_plan_out must be a WritePlan, got {type(write_plan_out).__name__}")
    for name, value in (
        ("swa_window_size", swa_window_size), ("verify_capacity", verify_capacity),
        ("kv_token_id_vs_position_offset", kv_token_id_vs_position_offset),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise KvCanaryTypeError(f"kv-canary: {_OP} {name} must be an int, got {type(value).__name__}")
    dev = check_tensor(_OP, "req_to_token", req_to_token, dtypes=(torch.int32,), ndim=2).device
    bs = None
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens), ("extend_lens", extend_lens)):
        check_tensor(_OP, name, t, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
        if bs is None:
            bs = t.shape[0]
        elif t.shape[0] != bs:
            raise KvCanaryValueError(f"kv-canary: {_OP} {name} has {t.shape[0]} rows, req_pool_indices has {bs}")
    for name in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices"):
        check_tensor(_OP, f"verify_plan_out.{name}", getattr(verify_plan_out, name), dtypes=(torch.int64,), ndim=1, device=dev, contiguous=True)
    check_tensor(_OP, "verify_plan_out.verify_num_valid", verify_plan_out.verify_num_valid, dtypes=(torch.int32,), numel=1, device=dev)
    check_tensor(_OP, "verify_plan_out.enable", verify_plan_out.enable, dtypes=(torch.int32,), numel=1, device=dev)
    check_tensor(_OP, "write_plan_out.write_offsets", write_plan_out.write_offsets, dtypes=(torch.int64,), ndim=1, device=dev, contiguous=True)
    check_tensor(_OP, "write_plan_out.write_seed_slot_indices", write_plan_out.write_seed_slot_indices, dtypes=(torch.int64,), ndim=1, device=dev, contiguous=True)
    check_tensor(_OP, "write_plan_out.write_num_valid_reqs", write_plan_out.write_num_valid_reqs, dtypes=(torch.int32,), numel=1, device=dev)
    if full_to_swa_index_mapping is not None:
        check_tensor(_OP, "full_to_swa_index_mapping", full_to_swa_index_mapping, dtypes=(torch.int64,), ndim=1, device=dev, contiguous=True)
    if req_to_verify_expected_tokens is not None:
        check_tensor(_OP, "req_to_verify_expected_tokens", req_to_verify_expected_tokens, dtypes=(torch.int32,), ndim=2, device=dev)
    if req_to_verify_expected_tokens_valid_lens is not None:
        t = check_tensor(
            _OP, "req_to_verify_expected_tokens_valid_lens", req_to_verify_expected_tokens_valid_lens,
            dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True,
        )
        if t.shape[0] < bs:
            raise KvCanaryValueError(
                f"kv-canary: {_OP} req_to_verify_expected_tokens_valid_lens has {t.shape[0]} rows, batch has {bs}"
            )
    cap = verify_plan_out.verify_slot_indices.shape[0]
    if verify_capacity != cap:
        raise KvCanaryValueError(
            f"kv-canary: {_OP} verify_capacity={verify_capacity} does not match "
            f"verify_plan_out.verify_slot_indices.shape[0]={cap}"
        )
    if req_to_verify_expected_tokens is not None and req_to_verify_expected_tokens_valid_lens is None:
        raise KvCanaryValueError(
            f"kv-canary: {_OP} requires req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set"
        )
    if swa_window_size > 0 and full_to_swa_index_mapping is None:
        raise KvCanaryValueError(f"kv-canary: {_OP} requires full_to_swa_index_mapping when swa_window_size > 0")


def launch_canary_plan_kernels(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
    full_to_swa_index_mapping: Optional[torch.Tensor],
    verify_capacity: int,
    req_to_verify_expected_tokens: Optional[torch.Tensor],
    req_to_verify_expected_tokens_valid_lens: Optional[torch.Tensor],
    kv_token_id_vs_position_offset: int,
    check_request_rows_on_host: Optional[bool] = None,
) -> None:
    """Build the verify entries and write metadata of one forward.

    Mutates only the nine plan tensors; every error is raised before any of them changes (the
    plan has no counters). Request rows: an active batch row (``req_pool_indices[r] != 0``) must
    name a row of ``req_to_token`` (and of ``req_to_verify_expected_tokens`` when it has columns),
    else ``KvCanaryValueError("kv-canary: launch_canary_plan_kernels req_pool_indices[{r}]={row} is
    outside the request table rows [0, {n}))")`` — a host read of ``req_pool_indices`` (on CUDA it
    waits for the stream). While the current stream is capturing a CUDA graph that check is
    skipped and the Triton kernels plan such a row as a padding row (no verify entries, no write
    tokens, seed -1): nothing outside the tables is read.

    Prefix lengths: an active row whose prefix ``P`` exceeds the table width ``w =
    req_to_token.shape[1]`` raises ``KvCanaryValueError("kv-canary: launch_canary_plan_kernels row
    {r}: prefix {P} exceeds the request table width {w}")``, on the same host path, after the row
    check (the plan reads positions below ``P`` only, so ``P + extend > w`` is legal). Under capture
    the Triton kernels plan such a row inside its request row only: verify entries for positions
    ``[lo, w)`` (``lo`` the window start computed from ``P`` as usual; the positions ``[w, P)`` get
    no entry, so ``verify_num_valid`` counts only the planned ones), seed -1 (``P - 1`` is past the
    row), write offsets unchanged (the write op does not read the table). Expected tokens: a column
    at or past ``req_to_verify_expected_tokens.shape[1]`` is never read, whatever the valid length
    (token -1, on every path).

    ``check_request_rows_on_host`` (an extension, keyword only): None (default) checks as above;
    False skips the host reads on CUDA too (a caller that must not wait for the stream, e.g. the
    runtime's per-forward path, gets the capture behaviour: bad rows planned as padding, long
    prefixes cut at the width). CPU tensors are always checked (the twin would index out of bounds).
    """
    kwargs = dict(
        verify_plan_out=verify_plan_out, write_plan_out=write_plan_out, req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens, req_to_token=req_to_token,
        swa_window_size=swa_window_size, full_to_swa_index_mapping=full_to_swa_index_mapping,
        verify_capacity=verify_capacity, req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
    )
    _check_before_launch(kwargs, check_request_rows_on_host)
    backend = triton_backend(req_to_token.device)
    impl = backend.launch_plan if backend else launch_canary_plan_kernels_torch_reference
    impl(**kwargs)


def _check_before_launch(kwargs: dict, check_request_rows_on_host: Optional[bool]) -> None:
    """Every check of the launcher's arguments (``kwargs``: the launch's), the host reads of the request rows and
    prefix lengths included unless skipped (under capture, or ``check_request_rows_on_host=False`` on CUDA)."""
    check_args = dict(kwargs)
    check_args["extend_lens"] = check_args.pop("extend_seq_lens")
    _check_plan_args(**check_args)
    req_pool_indices, req_to_token = kwargs["req_pool_indices"], kwargs["req_to_token"]
    dev = req_to_token.device
    host_check = check_request_rows_on_host is not False or dev.type != "cuda"
    if host_check and not capturing(dev):  # host reads; under capture the kernels never read outside the tables
        check_request_rows(_OP, req_pool_indices,
                           request_row_bound(req_to_token, kwargs["req_to_verify_expected_tokens"]))
        check_prefix_lens(_OP, req_pool_indices, kwargs["prefix_lens"], int(req_to_token.shape[1]))
