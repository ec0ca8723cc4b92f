"""Triton verify (docs/design.md §3.7): one persistent kernel, sized from the device.

Each program walks blocks of plan entries (coalesced int64 plan reads), loads the entry's and
its predecessor's 32-byte records as [BLOCK, 4] tiles, recomputes the chain link and the real-KV
fingerprint (16-byte strip loads), and appends violation rows with one atomic per block that has
any. Counters are updated on the device by program 0, so the launch never syncs with the host.

One launch may verify the same plan against two contexts (``launch_verify_many``: e.g. the TAIL K
and TAIL V buffers of a forward): the plan is read once, both contexts' records and real-KV strips
are loaded before either appends rows (more loads in flight per entry), and each context keeps its
own counters and ring.

With a `KernelJitter` (``JITTER``, docs/design.md §3.11) each block first draws its entries' stalls per context,
counts them and, on a GPU, spins before loading the records; without one the branch is not compiled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.jitter import KernelJitter
from kvcanary.ops.records import VerifyOrWriteContext, VerifyPlan
from kvcanary.ops.reference.verify import launch_canary_verify_kernel_torch_reference
from kvcanary.ops.triton.constants import (
    F_POSITION, F_PREV_HASH, F_REAL_KV, F_TOKEN, SLOT_PADDING, VERIFY_CHAIN, VERIFY_POSITION, VERIFY_REAL_KV,
    VERIFY_SLOT_OOR, VERIFY_TOKEN,
)
from kvcanary.ops.triton.hashing import H0_SIGNED, as_i64, fingerprint, slot_hash_of_fields, source_args, static_error
from kvcanary.ops.triton.jitter import jitter_args, jitter_stall
from kvcanary.ops.dispatch import capturing
from kvcanary.ops.triton.launch import (
    jit_batch_sized, launch_in_pairs, num_sms, pdl_enabled, pdl_release, pdl_wait, two_context_args,
)
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
def _judge(
    fields_ptr, stride_words, num_slots, slot, prev, exp_pos, exp_tok, live, h0,
    s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
    NSRC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    LANES_CH: tl.constexpr, ALIGNED16: tl.constexpr,
):
    """One context's verdict on a block of entries: (bits, stored position, stored token, stored
    chain, expected chain); loads only, no stores."""
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
    fp = as_i64(fingerprint(slot, ok, s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
                            NSRC, W0, W1, W2, W3, LANES_CH))
    bits = tl.where(reachable & (chain != expected_chain), VERIFY_CHAIN, 0)
    bits += tl.where((exp_tok != -1) & (token != exp_tok), VERIFY_TOKEN, 0)
    bits += tl.where(position != exp_pos, VERIFY_POSITION, 0)
    bits += tl.where(real_kv != fp, VERIFY_REAL_KV, 0)
    bits = tl.where(ok, bits, 0)
    bits = tl.where(oor, VERIFY_SLOT_OOR, bits)
    expected_chain = tl.where(oor, prev, expected_chain)
    return bits, position, token, chain, expected_chain


@triton.jit
def _report(ring_ptr, widx_ptr, ring_cap, kind, slot, exp_tok, bits, position, token, chain, expected_chain):
    """Append the block's violation rows (one atomic when there are any)."""
    bad = bits != 0
    if tl.sum(bad.to(tl.int32), 0) > 0:
        row = reserve_rows(widx_ptr, bad.to(tl.int32))
        store_rows(ring_ptr, ring_cap, row, bad, tl.zeros(slot.shape, tl.int64) + kind, slot, position, token,
                   exp_tok, chain, expected_chain, bits.to(tl.int64))


@triton.jit
def _count_launch(kca, sca, kcb, scb, enable, active, NCTX: tl.constexpr):
    """Add the launch to each context's kernel counter and, when the plan is enabled, its ``active`` entries to
    the slot counter (relaxed atomics: read after the launch)."""
    tl.atomic_add(kca, 1, sem="relaxed")
    if NCTX == 2:
        tl.atomic_add(kcb, 1, sem="relaxed")
    if enable != 0:
        tl.atomic_add(sca, active, sem="relaxed")
        if NCTX == 2:
            tl.atomic_add(scb, active, sem="relaxed")


@jit_batch_sized('capacity', 'kinda', 'kindb', scalar_ptrs=(
    'num_valid_ptr', 'enable_ptr', 'widxa', 'sca', 'kca', 'widxb', 'scb', 'kcb', 'jit_params', 'jit_key', 'jit_counts'))
def _verify_kernel(
    slot_ptr, tok_ptr, pos_ptr, prev_ptr,   # plan arrays, int64 [capacity]
    num_valid_ptr, enable_ptr,              # int32 [1] each
    capacity, h0,
    # context A: int64 view of canary_buf [num_slots, stride_words]; ring int64 [ring_cap, 8], int32 [1];
    # counters int64 [1] each; launch tag; real-KV sources
    fa, swa, nsa, ringa, widxa, capa, sca, kca, kinda,
    a_s0, a_p0, a_n0, a_r0, a_s1, a_p1, a_n1, a_r1, a_s2, a_p2, a_n2, a_r2, a_s3, a_p3, a_n3, a_r3,
    # context B (NCTX == 2; else the same as A and unused)
    fb, swb, nsb, ringb, widxb, capb, scb, kcb, kindb,
    b_s0, b_p0, b_n0, b_r0, b_s1, b_p1, b_n1, b_r1, b_s2, b_p2, b_n2, b_r2, b_s3, b_p3, b_n3, b_r3,
    jit_params, jit_key, jit_counts,        # timing jitter (JITTER): int64 [3], [1], [2]; else unused
    A_NSRC: tl.constexpr, A_W0: tl.constexpr, A_W1: tl.constexpr, A_W2: tl.constexpr, A_W3: tl.constexpr,
    A_LANES_CH: tl.constexpr, A_ALIGNED16: tl.constexpr,
    B_NSRC: tl.constexpr, B_W0: tl.constexpr, B_W1: tl.constexpr, B_W2: tl.constexpr, B_W3: tl.constexpr,
    B_LANES_CH: tl.constexpr, B_ALIGNED16: tl.constexpr,
    NCTX: tl.constexpr, CHECK_TOKEN: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    JITTER: tl.constexpr, SPIN: tl.constexpr,
):
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    enable = tl.load(enable_ptr)
    active = tl.minimum(tl.maximum(tl.load(num_valid_ptr).to(tl.int64), 0), capacity)
    if pid == 0:  # counters: relaxed atomics (read after the launch), so the plan loads need not wait for them
        _count_launch(kca, sca, kcb, scb, enable, active, NCTX)
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
        if JITTER:  # seeded stalls before the block's records and KV are read (docs/design.md §3.11)
            jitter_stall(jit_params, jit_key, jit_counts, kinda, slot, live, SPIN)
            if NCTX == 2:
                jitter_stall(jit_params, jit_key, jit_counts, kindb, slot, live, SPIN)
        if CHECK_TOKEN:
            exp_tok = tl.load(tok_ptr + idx, mask=live, other=-1)
        else:
            exp_tok = tl.full([BLOCK], -1, tl.int64)
        bits_a, pos_a, tok_a, chain_a, exp_chain_a = _judge(
            fa, swa, nsa, slot, prev, exp_pos, exp_tok, live, h0,
            a_s0, a_p0, a_n0, a_r0, a_s1, a_p1, a_n1, a_r1, a_s2, a_p2, a_n2, a_r2, a_s3, a_p3, a_n3, a_r3,
            A_NSRC, A_W0, A_W1, A_W2, A_W3, A_LANES_CH, A_ALIGNED16)
        if NCTX == 2:  # B's loads are issued before A's rows are stored
            bits_b, pos_b, tok_b, chain_b, exp_chain_b = _judge(
                fb, swb, nsb, slot, prev, exp_pos, exp_tok, live, h0,
                b_s0, b_p0, b_n0, b_r0, b_s1, b_p1, b_n1, b_r1, b_s2, b_p2, b_n2, b_r2, b_s3, b_p3, b_n3, b_r3,
                B_NSRC, B_W0, B_W1, B_W2, B_W3, B_LANES_CH, B_ALIGNED16)
            _report(ringa, widxa, capa, kinda, slot, exp_tok, bits_a, pos_a, tok_a, chain_a, exp_chain_a)
            _report(ringb, widxb, capb, kindb, slot, exp_tok, bits_b, pos_b, tok_b, chain_b, exp_chain_b)
        else:
            _report(ringa, widxa, capa, kinda, slot, exp_tok, bits_a, pos_a, tok_a, chain_a, exp_chain_a)


def _context_args(ctx: VerifyOrWriteContext, srcs, prefix: str) -> tuple[tuple, dict]:
    """Runtime arguments and constexprs of one context slot (``prefix`` 'A' or 'B')."""
    buf = ctx.canary_buf
    stride_words = buf.shape[1] // 8
    args = (buf.view(torch.int64), stride_words, buf.shape[0], ctx.violation_ring, ctx.violation_write_index,
            ctx.violation_ring.shape[0], ctx.slot_run_counter, ctx.kernel_run_counter, int(ctx.kernel_kind),
            *srcs.args)
    consts = {f"{prefix}_{k}": v for k, v in srcs.consts.items()}
    consts[f"{prefix}_ALIGNED16"] = stride_words % 2 == 0 and buf.data_ptr() % 16 == 0
    return args, consts


def _kernel_sources(ctx: VerifyOrWriteContext):
    """SourceArgs for the kernel, or None when the launch needs the torch twin (or must raise)."""
    if static_error(ctx) is not None:
        return None
    return source_args(ctx.real_kv_sources, ctx.real_kv_hash_mode, ctx.canary_buf)


def _launch_twin(ctx: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool,
                 jitter: Optional[KernelJitter] = None) -> None:
    """The torch twin for a launch the kernel cannot take (a lazy-check error, or sources whose rows
    are not contiguous); under capture the error is raised at once (the twin would read the host)."""
    if capturing(ctx.canary_buf.device):
        raise static_error(ctx) or KvCanaryValueError(
            "kv-canary: real-KV sources with non-contiguous rows cannot be captured in a CUDA graph")
    launch_canary_verify_kernel_torch_reference(
        context=ctx, plan=plan, check_verify_expected_token=check_verify_expected_token, jitter=jitter,
    )


def _launch(contexts: Sequence[VerifyOrWriteContext], sources: Sequence, plan: VerifyPlan,
            check_verify_expected_token: bool, config: VerifyLaunchConfig,
            jitter: Optional[KernelJitter] = None) -> None:
    ctx_args, consts = two_context_args(contexts, sources, _context_args)
    jit_args, jit_consts = jitter_args(jitter, contexts[0].kernel_run_counter)
    buf = contexts[0].canary_buf
    capacity = plan.verify_slot_indices.shape[0]
    block = config.block
    grid = (max(1, min(triton.cdiv(capacity, block), num_sms(buf.device) * config.programs_per_sm)),)
    pdl = pdl_enabled(buf.device, config.pdl)
    _verify_kernel[grid](
        plan.verify_slot_indices, plan.verify_expected_tokens, plan.verify_expected_positions,
        plan.verify_prev_slot_indices, plan.verify_num_valid, plan.enable, capacity, H0_SIGNED,
        *ctx_args, *jit_args, **consts, **jit_consts,
        NCTX=len(contexts), CHECK_TOKEN=bool(check_verify_expected_token), BLOCK=block, PDL=pdl,
        num_warps=config.num_warps, launch_pdl=pdl,
    )


def launch_verify(
    *, context: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool,
    config: VerifyLaunchConfig = DEFAULT_VERIFY_CONFIG, jitter: Optional[KernelJitter] = None,
) -> None:
    """Triton twin of ``launch_canary_verify_kernel_torch_reference`` (same bytes; rows of
    different blocks may land in another order).

    A launch whose lazy checks would fail (canary stride, narrow real-KV rows: both known from
    shapes) runs the torch twin, which updates the counters and raises only if the plan has
    work. Under CUDA-graph capture that needs a host read, so the error is raised at once.
    Sources whose rows are not contiguous in memory also take the twin (not capturable). ``jitter``: seeded
    stalls (docs/design.md §3.11); None compiles the kernel without them.
    """
    srcs = _kernel_sources(context)
    if srcs is None:
        _launch_twin(context, plan, check_verify_expected_token, jitter)
        return
    _launch((context,), (srcs,), plan, check_verify_expected_token, config, jitter)


def _shares_ring(a: VerifyOrWriteContext, b: VerifyOrWriteContext) -> bool:
    return (a.violation_ring.data_ptr() == b.violation_ring.data_ptr()
            or a.violation_write_index.data_ptr() == b.violation_write_index.data_ptr())


def launch_verify_many(
    *, contexts: Sequence[VerifyOrWriteContext], plan: VerifyPlan, check_verify_expected_token: bool,
    config: VerifyLaunchConfig = DEFAULT_VERIFY_CONFIG, jitter: Optional[KernelJitter] = None,
) -> tuple[int, ...]:
    """``launch_verify`` for each context in order, two contexts per launch where both can take the kernel
    and their rings differ (the same counters, rings and bytes as one launch per context; rows of one ring
    may land in another order, as within one launch). A context the kernel cannot take runs alone, in
    its turn (the torch twin). Returns the number of contexts of each kernel launch, in order (twin runs not
    counted)."""
    return launch_in_pairs(
        contexts, sources=_kernel_sources, pairable=lambda a, b: not _shares_ring(a, b),
        launch=lambda ctxs, srcs: _launch(ctxs, srcs, plan, check_verify_expected_token, config, jitter),
        alone=lambda ctx: _launch_twin(ctx, plan, check_verify_expected_token, jitter),
    )
