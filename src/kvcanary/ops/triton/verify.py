"""Triton verify (SPEC §3.7): one persistent kernel, sized from the device.

Each program walks blocks of plan entries (coalesced int64 plan reads), loads the entry's and
its predecessor's 32-byte records as [BLOCK, 4] tiles, recomputes the chain link and the real-KV
fingerprint (16-byte strip loads), and appends violation rows with one atomic per block that has
any. Counters are updated on the device by program 0, so the launch never syncs with the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcanary.ops.constants import FailReason
from kvcanary.ops.records import VerifyOrWriteContext, VerifyPlan
from kvcanary.ops.reference.verify import launch_canary_verify_kernel_torch_reference
from kvcanary.ops.triton.hashing import (
    H0_SIGNED, as_i64, capturing, fingerprint, num_sms, slot_hash_of_fields, source_args, static_error,
)

CONFIG = {"block": 128, "programs_per_sm": 32, "num_warps": 4}
"""Launch shape: entries per block, resident programs per multiprocessor, warps per program."""

_CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
_POSITION = int(FailReason.VERIFY_POSITION_MISMATCH)
_REAL_KV = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
_TOKEN = int(FailReason.VERIFY_TOKEN_MISMATCH)


@triton.jit
def _load_record(fields_ptr, slot, mask, stride_words, ALIGNED16: tl.constexpr):
    """(token, position, prev_hash, real_kv) int64 of each slot: one [BLOCK, 4] tile load."""
    base = slot * stride_words
    if ALIGNED16:
        base = tl.multiple_of(base, 2)
    rec = tl.load(fields_ptr + base[:, None] + tl.arange(0, 4)[None, :], mask=mask[:, None], other=0)
    even, odd = tl.split(tl.reshape(rec, (rec.shape[0], 2, 2)))
    token, prev_hash = tl.split(even)
    position, real_kv = tl.split(odd)
    return token, position, prev_hash, real_kv


@triton.jit
def _verify_kernel(
    fields_ptr,          # int64 view of canary_buf: [num_slots, stride_words]
    stride_words,        # int64 fields per canary row
    slot_ptr, tok_ptr, pos_ptr, prev_ptr,   # plan arrays, int64 [capacity]
    num_valid_ptr, enable_ptr,              # int32 [1] each
    ring_ptr, widx_ptr, ring_cap,           # int64 [ring_cap, 8], int32 [1]
    slot_counter_ptr, kernel_counter_ptr,   # int64 [1] each
    capacity, kind, h0,
    s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
    NSRC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    CHECK_TOKEN: tl.constexpr, ALIGNED16: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    enable = tl.load(enable_ptr)
    active = tl.minimum(tl.maximum(tl.load(num_valid_ptr).to(tl.int64), 0), capacity)
    if pid == 0:
        tl.store(kernel_counter_ptr, tl.load(kernel_counter_ptr) + 1)
        if enable != 0:
            tl.store(slot_counter_ptr, tl.load(slot_counter_ptr) + active)
    if enable == 0:
        active = active * 0
    lanes = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, active, nprog * BLOCK):
        idx = start + lanes
        m = idx < active
        slot = tl.load(slot_ptr + idx, mask=m, other=0)
        prev = tl.load(prev_ptr + idx, mask=m, other=0)
        exp_pos = tl.load(pos_ptr + idx, mask=m, other=0)
        live = m & (slot != 0)
        token, position, chain, real_kv = _load_record(fields_ptr, slot, live, stride_words, ALIGNED16)
        reachable = live & (prev != 0)
        from_slot = reachable & (prev > 0)
        p_tok, p_pos, p_chain, _unused = _load_record(fields_ptr, prev, from_slot, stride_words, ALIGNED16)
        linked = as_i64(slot_hash_of_fields(p_chain, p_tok, p_pos))
        expected_chain = tl.where(from_slot, linked, tl.where(reachable, h0, chain))
        if CHECK_TOKEN:
            exp_tok = tl.load(tok_ptr + idx, mask=live, other=-1)
        else:
            exp_tok = tl.full([BLOCK], -1, tl.int64)
        fp = as_i64(fingerprint(slot, live, s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
                                NSRC, W0, W1, W2, W3))
        bits = tl.where(reachable & (chain != expected_chain), 1, 0)
        bits += tl.where((exp_tok != -1) & (token != exp_tok), 32, 0)
        bits += tl.where(position != exp_pos, 2, 0)
        bits += tl.where(real_kv != fp, 4, 0)
        bits = tl.where(live, bits, 0)
        bad = bits != 0
        n_bad = tl.sum(bad.to(tl.int32), 0)
        if n_bad > 0:
            base = tl.atomic_add(widx_ptr, n_bad).to(tl.int64)
            row = base + tl.cumsum(bad.to(tl.int64), 0) - 1
            keep = bad & (row >= 0) & (row < ring_cap)
            out = ring_ptr + row * 8
            tl.store(out + 0, tl.full([BLOCK], 0, tl.int64) + kind, mask=keep)
            tl.store(out + 1, slot, mask=keep)
            tl.store(out + 2, position, mask=keep)
            tl.store(out + 3, token, mask=keep)
            tl.store(out + 4, exp_tok, mask=keep)
            tl.store(out + 5, chain, mask=keep)
            tl.store(out + 6, expected_chain, mask=keep)
            tl.store(out + 7, bits.to(tl.int64), mask=keep)


def launch_verify(*, context: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool) -> None:
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
            raise err or ValueError("kv-canary: real-KV sources with non-contiguous rows cannot be captured in a CUDA graph")
        launch_canary_verify_kernel_torch_reference(
            context=ctx, plan=plan, check_verify_expected_token=check_verify_expected_token
        )
        return
    capacity = plan.verify_slot_indices.shape[0]
    stride_words = buf.shape[1] // 8
    block, per_sm, warps = CONFIG["block"], CONFIG["programs_per_sm"], CONFIG["num_warps"]
    grid = (max(1, min(triton.cdiv(capacity, block), num_sms(buf.device) * per_sm)),)
    _verify_kernel[grid](
        buf.view(torch.int64), stride_words,
        plan.verify_slot_indices, plan.verify_expected_tokens, plan.verify_expected_positions,
        plan.verify_prev_slot_indices, plan.verify_num_valid, plan.enable,
        ctx.violation_ring, ctx.violation_write_index, ctx.violation_ring.shape[0],
        ctx.slot_run_counter, ctx.kernel_run_counter,
        capacity, int(ctx.kernel_kind), H0_SIGNED,
        *srcs.args, **srcs.consts,
        CHECK_TOKEN=bool(check_verify_expected_token), ALIGNED16=(stride_words % 2 == 0 and buf.data_ptr() % 16 == 0),
        BLOCK=block, num_warps=warps,
    )
