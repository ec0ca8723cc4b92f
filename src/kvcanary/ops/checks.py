"""Up-front argument checks for the public launchers (the twins stay lenient).

Every failure is a ``kv-canary:`` ValueError/TypeError naming the argument, raised before
anything is touched.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.constants import MAX_REAL_KV_SOURCES
from kvcanary.ops.records import RealKvSource, VerifyOrWriteContext, VerifyPlan, WritePlan

INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype],
    ndim: Optional[int] = None,
    numel: Optional[int] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; returns it."""
    dtypes = tuple(dtypes)
    if not isinstance(t, torch.Tensor):
        raise KvCanaryTypeError(f"kv-canary: {op} {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise KvCanaryTypeError(f"kv-canary: {op} {name} must be {want}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise KvCanaryValueError(f"kv-canary: {op} {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if numel is not None and t.numel() != numel:
        raise KvCanaryValueError(f"kv-canary: {op} {name} must hold exactly {numel} element(s), got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise KvCanaryValueError(f"kv-canary: {op} {name} is on {t.device}, expected {device} (all tensors on one device)")
    if contiguous and not t.is_contiguous():
        raise KvCanaryValueError(
            f"kv-canary: {op} {name} must be contiguous, got shape {tuple(t.shape)} strides {tuple(t.stride())}"
        )
    return t


def check_source_count(sources: tuple) -> None:
    if len(sources) > MAX_REAL_KV_SOURCES:
        raise KvCanaryValueError(
            f"kv-canary: at most {MAX_REAL_KV_SOURCES} RealKvSource entries supported by the CUDA ABI, got {len(sources)}"
        )


def check_context(op: str, ctx: object) -> torch.device:
    """Check a VerifyOrWriteContext; returns the device every tensor must live on."""
    if not isinstance(ctx, VerifyOrWriteContext):
        raise KvCanaryTypeError(f"kv-canary: {op} context must be a VerifyOrWriteContext, got {type(ctx).__name__}")
    check_source_count(ctx.real_kv_sources)
    buf = check_tensor(op, "context.canary_buf", ctx.canary_buf, dtypes=(torch.uint8,), ndim=2)
    dev = buf.device
    if buf.stride(1) != 1 or buf.stride(0) != buf.shape[1]:
        raise KvCanaryValueError(
            f"kv-canary: {op} context.canary_buf must be a contiguous [num_slots, stride_bytes] array, "
            f"got shape {tuple(buf.shape)} strides {tuple(buf.stride())}"
        )
    ring = check_tensor(op, "context.violation_ring", ctx.violation_ring, dtypes=(torch.int64,), ndim=2, device=dev)
    if ring.shape[1] != 8 or not ring.is_contiguous():
        raise KvCanaryValueError(f"kv-canary: {op} context.violation_ring must be contiguous int64 [cap, 8], got shape {tuple(ring.shape)}")
    check_tensor(op, "context.violation_write_index", ctx.violation_write_index, dtypes=(torch.int32,), numel=1, device=dev)
    check_tensor(op, "context.slot_run_counter", ctx.slot_run_counter, dtypes=(torch.int64,), numel=1, device=dev)
    check_tensor(op, "context.kernel_run_counter", ctx.kernel_run_counter, dtypes=(torch.int64,), numel=1, device=dev)
    check_tensor(
        op, "context.enable_chain_position_assert", ctx.enable_chain_position_assert,
        dtypes=(torch.int32,), numel=1, device=dev,
    )
    for i, src in enumerate(ctx.real_kv_sources):
        if not isinstance(src, RealKvSource):
            raise KvCanaryTypeError(f"kv-canary: {op} context.real_kv_sources[{i}] must be a RealKvSource")
        if src.tensor.device != dev:
            raise KvCanaryValueError(
                f"kv-canary: {op} context.real_kv_sources[{i}].tensor is on {src.tensor.device}, expected {dev}"
            )
    return dev


def check_verify_plan(op: str, plan: object, dev: torch.device) -> None:
    if not isinstance(plan, VerifyPlan):
        raise KvCanaryTypeError(f"kv-canary: {op} plan must be a VerifyPlan, got {type(plan).__name__}")
    cap = None
    for name in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices"):
        t = check_tensor(op, f"plan.{name}", getattr(plan, name), dtypes=(torch.int64,), ndim=1, device=dev, contiguous=True)
        if cap is None:
            cap = t.shape[0]
        elif t.shape[0] != cap:
            raise KvCanaryValueError(f"kv-canary: {op} plan.{name} has {t.shape[0]} entries, verify_slot_indices has {cap}")
    check_tensor(op, "plan.verify_num_valid", plan.verify_num_valid, dtypes=(torch.int32,), numel=1, device=dev)
    check_tensor(op, "plan.enable", plan.enable, dtypes=(torch.int32,), numel=1, device=dev)


def check_write_plan(op: str, plan: object, dev: torch.device) -> None:
    if not isinstance(plan, WritePlan):
        raise KvCanaryTypeError(f"kv-canary: {op} plan must be a WritePlan, got {type(plan).__name__}")
    offs = check_tensor(op, "plan.write_offsets", plan.write_offsets, dtypes=(torch.int64,), ndim=1, device=dev, contiguous=True)
    seeds = check_tensor(
        op, "plan.write_seed_slot_indices", plan.write_seed_slot_indices, dtypes=(torch.int64,), ndim=1, device=dev, contiguous=True
    )
    if offs.shape[0] != seeds.shape[0] + 1:
        raise KvCanaryValueError(
            f"kv-canary: {op} plan.write_offsets must have len(write_seed_slot_indices) + 1 = {seeds.shape[0] + 1} "
            f"entries, got {offs.shape[0]}"
        )
    check_tensor(op, "plan.write_num_valid_reqs", plan.write_num_valid_reqs, dtypes=(torch.int32,), numel=1, device=dev)
