"""Triton verify (SPEC §3.7): one persistent kernel, sized from the device.

Each program walks blocks of plan entries (coalesced int64 plan reads), loads the entry's and
its predecessor's 32-byte records as [BLOCK, 4] tiles, recomputes the chain link and the real-KV
fingerprint (16-byte strip loads), and appends violation rows with one atomic per block that has
any. Counters are updated on the device by program 0, so the launch never syncs with the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.records import VerifyOrWriteContext, VerifyPlan
from kvcanary.ops.reference.verify import launch_canary_verify_kernel_torch_reference
from kvcanary.ops.triton.constants import (
    F_POSITION, F_PREV_HASH, F_REAL_KV, F_TOKEN, SLOT_PADDING, VERIFY_CHAIN, VERIFY_POSITION, VERIFY_REAL_KV,
    VERIFY_SLOT_OOR, VERIFY_TOKEN,
)
from kvcanary.ops.triton.hashing import H0_SIGNED, as_i64, fingerprint, slot_hash_of_fields, source_args, static_error
from kvcanary.ops.triton.launch import capturing, num_sms, pdl_enabled, pdl_release, pdl_wait
from kvcanary.ops.triton.ring import reserve_rows, store_rows


@dataclass(frozen=True, kw_only=True)
class VerifyLaunchConfig:
    """Launch shape: entries per block, resident programs per multiprocessor, warps per program;
    ``pdl``: launch with programmatic dependent launch where the device has it."""

    block: int = 128
    programs_per_sm: int = 32
    num_warps: int = 4
    pdl: bool = True


DEFAULT_VERIFY_CONFIG = VerifyLaunchConfig()


@triton.jit
def _pick(c0, c1, c2, c3, K: tl.constexpr):
    """Column K of a record tile split into its four columns (compile-time choice)."""
    if K == 0:
        return c0
    elif K == 1:
        return c1
    elif K == 2:
        return c2
    else:
        return c3


@triton.jit
def _load_record(fields_ptr, slot, mask, stride_words, ALIGNED16: tl.constexpr):
    """(token, position, prev_hash, real_kv) int64 of each slot: one [BLOCK, 4] tile load."""
    base = slot * stride_words
    if ALIGNED16:
        base = tl.multiple_of(base, 2)
    rec = tl.load(fields_ptr + base[:, None] + tl.arange(0, 4)[None, :], mask=mask[:, None], other=0)
    even, odd = tl.split(tl.reshape(rec, (rec.shape[0], 2, 2)))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return (_pick(c0, c1, c2, c3, F_TOKEN), _pick(c0, c1, c2, c3, F_POSITION),
            _pick(c0, c1, c2, c3, F_PREV_HASH), _pick(c0, c1, c2, c3, F_REAL_KV))


@triton.jit
def _verify_kernel(
    fields_ptr,          # int64 view of canary_buf: [num_slots, stride_words]
    stride_words,        # int64 fields per canary row
    num_slots,           # canary rows: slots outside [0, num_slots) are reported, never loaded
    slot_ptr, tok_ptr, pos_ptr, prev_ptr,   # plan arrays, int64 [capacity]
    num_valid_ptr, enable_ptr,              # int32 [1] each
    ring_ptr, widx_ptr, ring_cap,           # int64 [ring_cap, 8], int32 [1]
    slot_counter_ptr, kernel_counter_ptr,   # int64 [1] each
    capacity, kind, h0,
    s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
    NSRC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    CHECK_TOKEN: tl.constexpr, ALIGNED16: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    enable = tl.load(enable_ptr)
    active = tl.minimum(tl.maximum(tl.load(num_valid_ptr).to(tl.int64), 0), capacity)
    if pid == 0:
        tl.atomic_add(kernel_counter_ptr, 1)
        if enable != 0:
            tl.atomic_add(slot_counter_ptr, active)
    if enable == 0:
        active = active * 0
    lanes = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, active, nprog * BLOCK):
        idx = start + lanes
        m = idx < active
        slot = tl.load(slot_ptr + idx, mask=m, other=SLOT_PADDING)
        prev = tl.load(prev_ptr + idx, mask=m, other=SLOT_PADDING)
        exp_pos = tl.load(pos_ptr + idx, mask=m, other=0)
        live = m & (slot != SLOT_PADDING)
        # Out-of-range slots / predecessors: reported, never loaded (FailReason docstring).
        slot_in = live & (slot >= 0) & (slot < num_slots)
        oor = live & ((slot < 0) | (slot >= num_slots) | (prev >= num_slots))
        ok = slot_in & (prev < num_slots)
        token, position, chain, real_kv = _load_record(fields_ptr, slot, slot_in, stride_words, ALIGNED16)
        reachable = ok & (prev != SLOT_PADDING)
        from_slot = reachable & (prev > 0)
        p_tok, p_pos, p_chain, _unused = _load_record(fields_ptr, prev, from_slot, stride_words, ALIGNED16)
        linked = as_i64(slot_hash_of_fields(p_chain, p_tok, p_pos))
        expected_chain = tl.where(from_slot, linked, tl.where(reachable, h0, chain))
        if CHECK_TOKEN:
            exp_tok = tl.load(tok_ptr + idx, mask=live, other=-1)
        else:
            exp_tok = tl.full([BLOCK], -1, tl.int64)
        fp = as_i64(fingerprint(slot, ok, s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
                                NSRC, W0, W1, W2, W3))
        bits = tl.where(reachable & (chain != expected_chain), VERIFY_CHAIN, 0)
        bits += tl.where((exp_tok != -1) & (token != exp_tok), VERIFY_TOKEN, 0)
        bits += tl.where(position != exp_pos, VERIFY_POSITION, 0)
        bits += tl.where(real_kv != fp, VERIFY_REAL_KV, 0)
        bits = tl.where(ok, bits, 0)
        bits = tl.where(oor, VERIFY_SLOT_OOR, bits)
        expected_chain = tl.where(oor, prev, expected_chain)
        bad = bits != 0
        if tl.sum(bad.to(tl.int32), 0) > 0:
            row = reserve_rows(widx_ptr, bad.to(tl.int32))
            store_rows(ring_ptr, ring_cap, row, bad, tl.full([BLOCK], 0, tl.int64) + kind, slot, position, token,
                       exp_tok, chain, expected_chain, bits.to(tl.int64))


def launch_verify(
    *, context: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool,
    config: VerifyLaunchConfig = DEFAULT_VERIFY_CONFIG,
) -> None:
    """Triton twin of ``launch_canary_verify_kernel_torch_reference`` (same bytes; rows of
    different blocks may land in another order).

    A launch whose lazy checks would fail (canary stride, narrow real-KV rows: both known from
    shapes) runs the torch twin, which updates the counters and raises only if the plan has
    work. Under CUDA-graph capture that needs a host read, so the error is raised at once.
    Sources whose rows are not contiguous in memory also take the twin (not capturable).
    """
    ctx = context
    buf = ctx.canary_buf
    err = static_error(ctx)
    srcs = None if err else source_args(ctx.real_kv_sources, ctx.real_kv_hash_mode, buf)
    if err is not None or srcs is None:
        if capturing(buf.device):
            raise err or KvCanaryValueError("kv-canary: real-KV sources with non-contiguous rows cannot be captured in a CUDA graph")
        launch_canary_verify_kernel_torch_reference(
            context=ctx, plan=plan, check_verify_expected_token=check_verify_expected_token
        )
        return
    capacity = plan.verify_slot_indices.shape[0]
    stride_words = buf.shape[1] // 8
    block = config.block
    grid = (max(1, min(triton.cdiv(capacity, block), num_sms(buf.device) * config.programs_per_sm)),)
    pdl = pdl_enabled(buf.device, config.pdl)
    _verify_kernel[grid](
        buf.view(torch.int64), stride_words, buf.shape[0],
        plan.verify_slot_indices, plan.verify_expected_tokens, plan.verify_expected_positions,
        plan.verify_prev_slot_indices, plan.verify_num_valid, plan.enable,
        ctx.violation_ring, ctx.violation_write_index, ctx.violation_ring.shape[0],
        ctx.slot_run_counter, ctx.kernel_run_counter,
        capacity, int(ctx.kernel_kind), H0_SIGNED,
        *srcs.args, **srcs.consts,
        CHECK_TOKEN=bool(check_verify_expected_token), ALIGNED16=(stride_words % 2 == 0 and buf.data_ptr() % 16 == 0),
        BLOCK=block, PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl,
    )
