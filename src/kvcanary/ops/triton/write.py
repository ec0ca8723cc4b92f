"""Triton write (SPEC §3.6): two launches that keep the sequential contract.

The chain recurrence is serial per request; everything else is parallel:

1. ``_write_prepare_kernel`` (persistent, sized from the device) walks every entry once:
   fingerprints its slot's real KV and stores the REAL_KV field (a slot's fingerprint does not
   depend on which entry stores it, so duplicates store the same bytes), counts the entries, and
   detects intra-launch aliasing — a slot stored twice, or a seed that some entry of the launch
   stores — with one epoch-tagged atomic per entry and per seed on a per-device scratch table.
   The last program to finish publishes "parallel" or "serial" for step 2 and bumps the epoch.
2. ``_write_chain_kernel``: one single-warp program per request (parallel mode) or program 0
   for all requests in batch order (serial mode, when aliasing was seen: every store lands
   before the next request reads its seed, and within a chunk only a slot's last entry stores).
   Each program walks its request in chunks of 32 entries: the running hash advances one entry
   per step (the only serial work, its inputs prefetched two steps ahead), then the chunk's token /
   position / prev_hash fields and its violation rows are stored in parallel.

No host sync: counts are read on the device, grids come from capacities. Launches whose lazy
checks would fail (known from shapes) run the torch twin, or raise at once under capture.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvcanary.ops.records import VerifyOrWriteContext, WritePlan
from kvcanary.ops.reference.write import launch_canary_write_kernel_torch_reference
from kvcanary.ops.triton.hashing import (
    H0_SIGNED, as_i64, as_u64, capturing, fingerprint, mix3, num_sms, slot_hash_of_fields, source_args,
    static_error,
)

_PREP_BLOCK = 256
_CHUNK = 32
_PROGRAMS_PER_SM = 16
_CHAIN_PROGRAMS_PER_SM = 32

# Scratch state words (int64): epoch, arrivals, conflicts, entry count, serial flag.
_EPOCH = tl.constexpr(0)
_ARRIVE = tl.constexpr(1)
_CONFLICTS = tl.constexpr(2)
_COUNT = tl.constexpr(3)
_SERIAL = tl.constexpr(4)


@triton.jit
def _write_prepare_kernel(
    fields_ptr, stride_words, num_slots,       # canary buffer as int64 [num_slots, stride_words]
    slot_ptr,                                  # out_cache_loc, int32/int64 [N]
    off_ptr, seed_ptr, num_reqs_ptr, seed_cap, # write plan
    table_ptr, state_ptr,                      # scratch: int64 [>= num_slots], int64 [8]
    kernel_counter_ptr, slot_counter_ptr,
    s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
    NSRC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if pid == 0:
        tl.store(kernel_counter_ptr, tl.load(kernel_counter_ptr) + 1)
    epoch = tl.load(state_ptr + _EPOCH)
    a = tl.minimum(tl.maximum(tl.load(num_reqs_ptr).to(tl.int64), 0), seed_cap)
    end = tl.load(off_ptr + a)
    begin = tl.load(off_ptr)
    end = tl.where(a > 0, end, 0)  # work gate: a > 0 and offsets[a] > 0
    writer_tag = epoch * 4 + 2
    seed_tag = epoch * 4 + 1
    conflicts = tl.zeros([], tl.int64)
    count = tl.zeros([], tl.int64)
    lanes = tl.arange(0, BLOCK)
    n_req = tl.where(end > 0, a, 0)
    # Entry block and request block of one iteration are independent: their loads and atomics
    # are issued together, so the per-launch latency chain stays short.
    for start in range(pid * BLOCK, tl.maximum(end, n_req), nprog * BLOCK):
        i = start + lanes
        m = (i < end) & (i >= begin)
        s = tl.load(slot_ptr + i, mask=m, other=-1).to(tl.int64)
        r = i
        rm = r < n_req
        o0 = tl.load(off_ptr + r, mask=rm, other=0)
        o1 = tl.load(off_ptr + r + 1, mask=rm, other=0)
        sd = tl.load(seed_ptr + r, mask=rm, other=-1)
        w = m & (s >= 0)
        count += tl.sum(w.to(tl.int64), 0)
        inside = w & (s < num_slots)
        reads = rm & (sd >= 0) & (sd < num_slots) & (o1 > o0)
        old_w = tl.atomic_max(table_ptr + s, tl.zeros([BLOCK], tl.int64) + writer_tag, mask=inside)
        old_r = tl.atomic_max(table_ptr + sd, tl.zeros([BLOCK], tl.int64) + seed_tag, mask=reads)
        fp = fingerprint(s, inside, s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
                         NSRC, W0, W1, W2, W3)
        tl.store(fields_ptr + s * stride_words + 3, as_i64(fp), mask=inside)
        conflicts += tl.sum((inside & (old_w >= seed_tag)).to(tl.int64), 0)
        conflicts += tl.sum((rm & (o1 < o0)).to(tl.int64), 0)
        conflicts += tl.sum((reads & (old_r == writer_tag)).to(tl.int64), 0)
    if conflicts > 0:
        tl.atomic_add(state_ptr + _CONFLICTS, conflicts)
    if count > 0:
        tl.atomic_add(state_ptr + _COUNT, count)
    arrived = tl.atomic_add(state_ptr + _ARRIVE, 1)
    if arrived == nprog - 1:  # last program: every other one has read the epoch and finished
        total_conflicts = tl.atomic_xchg(state_ptr + _CONFLICTS, 0)
        total_count = tl.atomic_xchg(state_ptr + _COUNT, 0)
        serial = total_conflicts > 0
        tl.store(state_ptr + _SERIAL, serial.to(tl.int64))
        if not serial:
            tl.store(slot_counter_ptr, tl.load(slot_counter_ptr) + total_count)
        tl.store(state_ptr + _ARRIVE, 0)
        tl.store(state_ptr + _EPOCH, epoch + 1)


@triton.jit
def _write_chain_kernel(
    fields_ptr, stride_words,
    tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr,  # flattened entries
    off_ptr, seed_ptr, num_reqs_ptr, seed_cap,
    state_ptr, chain_assert_ptr,
    ring_ptr, widx_ptr, ring_cap, slot_counter_ptr,
    kind, h0,
    INPUT_ASSERT: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    a = tl.minimum(tl.maximum(tl.load(num_reqs_ptr).to(tl.int64), 0), seed_cap)
    end_all = tl.load(off_ptr + a)
    a = tl.where(end_all > 0, a, 0)  # work gate
    serial = tl.load(state_ptr + _SERIAL) != 0
    first = tl.where(serial, tl.where(pid == 0, 0, a), pid)
    step = tl.where(serial, 1, nprog)
    chain_flag = tl.load(chain_assert_ptr) != 0
    lanes = tl.arange(0, CHUNK)
    later = lanes[None, :] > lanes[:, None]
    count = tl.zeros([], tl.int64)
    for r in range(first, a, step):
        o0 = tl.load(off_ptr + r)
        o1 = tl.minimum(tl.load(off_ptr + r + 1), end_all)
        n = tl.maximum(o1 - o0, 0)
        seed = tl.load(seed_ptr + r)
        has_seed = seed >= 0
        srec = fields_ptr + tl.where(has_seed, seed, 0) * stride_words
        seed_tok = tl.load(srec + 0, mask=has_seed, other=0)
        seed_pos = tl.load(srec + 1, mask=has_seed, other=0)
        seed_prev = tl.load(srec + 2, mask=has_seed, other=0)
        running = tl.where(has_seed, slot_hash_of_fields(seed_prev, seed_tok, seed_pos), as_u64(h0 + seed * 0))
        last_pos = seed_pos
        chain_on = has_seed & chain_flag
        # Chunk 0's tiles and first scalars; later chunks are prefetched one chunk ahead.
        idx = o0 + lanes
        m = lanes < n
        slot_t = tl.load(slot_ptr + idx, mask=m, other=-1).to(tl.int64)
        tok_t = tl.load(tok_ptr + idx, mask=m, other=0).to(tl.int64)
        pos_t = tl.load(pos_ptr + idx, mask=m, other=0).to(tl.int64)
        if INPUT_ASSERT:
            etok_t = tl.load(exp_tok_ptr + idx, mask=m, other=0).to(tl.int64)
            epos_t = tl.load(exp_pos_ptr + idx, mask=m, other=0).to(tl.int64)
        # The serial loop reads its scalars two steps ahead (an L2 hit outlasts one step).
        s_n = tl.load(slot_ptr + o0, mask=n > 0, other=-1).to(tl.int64)
        t_n = tl.load(tok_ptr + o0, mask=n > 0, other=0).to(tl.int64)
        p_n = tl.load(pos_ptr + o0, mask=n > 0, other=0).to(tl.int64)
        s_nn = tl.load(slot_ptr + o0 + 1, mask=n > 1, other=-1).to(tl.int64)
        t_nn = tl.load(tok_ptr + o0 + 1, mask=n > 1, other=0).to(tl.int64)
        p_nn = tl.load(pos_ptr + o0 + 1, mask=n > 1, other=0).to(tl.int64)
        for c in range(0, n, CHUNK):
            slot_c = slot_t
            tok_c = tok_t
            pos_c = pos_t
            if INPUT_ASSERT:
                etok_c = etok_t
                epos_c = epos_t
            m_c = lanes < n - c
            nidx = o0 + c + CHUNK + lanes
            nm = lanes < n - c - CHUNK
            slot_t = tl.load(slot_ptr + nidx, mask=nm, other=-1).to(tl.int64)
            tok_t = tl.load(tok_ptr + nidx, mask=nm, other=0).to(tl.int64)
            pos_t = tl.load(pos_ptr + nidx, mask=nm, other=0).to(tl.int64)
            if INPUT_ASSERT:
                etok_t = tl.load(exp_tok_ptr + nidx, mask=nm, other=0).to(tl.int64)
                epos_t = tl.load(exp_pos_ptr + nidx, mask=nm, other=0).to(tl.int64)
            # Serial part: the running hash before each entry (hs) and the last position (lp).
            hs = tl.zeros([CHUNK], tl.int64)
            lp = tl.zeros([CHUNK], tl.int64)
            cnt = tl.minimum(n - c, CHUNK)
            for j in tl.range(0, cnt, loop_unroll_factor=UNROLL):
                s_j = s_n
                t_j = t_n
                p_j = p_n
                s_n = s_nn
                t_n = t_nn
                p_n = p_nn
                k = o0 + c + j + 2
                km = c + j + 2 < n
                s_nn = tl.load(slot_ptr + k, mask=km, other=-1).to(tl.int64)
                t_nn = tl.load(tok_ptr + k, mask=km, other=0).to(tl.int64)
                p_nn = tl.load(pos_ptr + k, mask=km, other=0).to(tl.int64)
                sel = lanes == j
                hs = tl.where(sel, as_i64(running), hs)
                lp = tl.where(sel, last_pos, lp)
                stored = s_j >= 0
                running = tl.where(stored, mix3(running, as_u64(t_j), as_u64(p_j)), running)
                last_pos = tl.where(stored, p_j, last_pos)
            # Parallel part: stores (a slot's last entry in the chunk wins) and violation rows.
            valid = m_c & (slot_c >= 0)
            count += tl.sum(valid.to(tl.int64), 0)
            if serial:  # duplicates exist only in serial mode: keep a slot's last entry
                dup = (slot_c[:, None] == slot_c[None, :]) & valid[None, :] & later
                keep = valid & (tl.max(dup.to(tl.int32), 1) == 0)
            else:
                keep = valid
            rec = fields_ptr + tl.where(keep, slot_c, 0) * stride_words
            tl.store(rec + 0, tok_c, mask=keep)
            tl.store(rec + 1, pos_c, mask=keep)
            tl.store(rec + 2, hs, mask=keep)
            chain_bad = valid & chain_on & (pos_c != lp + 1)
            if INPUT_ASSERT:
                in_bits = tl.where(tok_c != etok_c, 8, 0) + tl.where(pos_c != epos_c, 16, 0)
                in_bad = valid & (in_bits != 0)
            else:
                in_bits = tl.zeros([CHUNK], tl.int32)
                in_bad = valid & (in_bits != 0)
            nrows = in_bad.to(tl.int64) + chain_bad.to(tl.int64)
            total_rows = tl.sum(nrows, 0)
            if total_rows > 0:
                base = tl.atomic_add(widx_ptr, total_rows.to(tl.int32)).to(tl.int64)
                row_in = base + tl.cumsum(nrows, 0) - nrows
                row_ch = row_in + in_bad.to(tl.int64)
                kinds = tl.zeros([CHUNK], tl.int64) + kind
                if INPUT_ASSERT:
                    ok = in_bad & (row_in >= 0) & (row_in < ring_cap)
                    out = ring_ptr + row_in * 8
                    tl.store(out + 0, kinds, mask=ok)
                    tl.store(out + 1, slot_c, mask=ok)
                    tl.store(out + 2, pos_c, mask=ok)
                    tl.store(out + 3, tok_c, mask=ok)
                    tl.store(out + 4, etok_c, mask=ok)
                    tl.store(out + 5, hs, mask=ok)
                    tl.store(out + 6, epos_c, mask=ok)
                    tl.store(out + 7, in_bits.to(tl.int64), mask=ok)
                ok = chain_bad & (row_ch >= 0) & (row_ch < ring_cap)
                out = ring_ptr + row_ch * 8
                tl.store(out + 0, kinds, mask=ok)
                tl.store(out + 1, slot_c, mask=ok)
                tl.store(out + 2, pos_c, mask=ok)
                tl.store(out + 3, tok_c, mask=ok)
                tl.store(out + 4, tok_c, mask=ok)
                tl.store(out + 5, hs, mask=ok)
                tl.store(out + 6, lp + 1, mask=ok)
                tl.store(out + 7, tl.zeros([CHUNK], tl.int64) + 16, mask=ok)
            tl.debug_barrier()  # serial mode: this chunk's stores land before later reads
    if serial:
        if pid == 0:
            tl.store(slot_counter_ptr, tl.load(slot_counter_ptr) + count)


class _Scratch:
    """Per-device scratch of the aliasing detector: an epoch-tagged word per canary slot and
    the state words. Allocated on first use (do it before graph capture) and grown on demand."""

    _by_device: dict = {}

    @classmethod
    def get(cls, device: torch.device, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device.type, device.index)
        entry = cls._by_device.get(key)
        if entry is None or entry[0].shape[0] < num_slots:
            table = torch.zeros(max(num_slots, 1), dtype=torch.int64, device=device)
            state = torch.zeros(8, dtype=torch.int64, device=device)
            state[_EPOCH.value] = 1  # zeroed table words never match a live epoch
            entry = (table, state)
            cls._by_device[key] = entry
        return entry


def launch_write(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: Optional[torch.Tensor],
    expected_input_positions: Optional[torch.Tensor],
) -> None:
    """Triton twin of ``launch_canary_write_kernel_torch_reference`` (same bytes; violation rows
    of different requests may land in another order in parallel mode).

    Assumes non-decreasing ``write_offsets`` (what the plan makes). A launch whose lazy checks
    would fail (canary stride, input-assert tensors, narrow rows: all known from shapes) runs the
    torch twin, which bumps the kernel counter and raises only when there is work; under CUDA-graph
    capture that needs a host read, so the error is raised at once.
    """
    ctx = context
    buf = ctx.canary_buf
    err = static_error(
        ctx, check_input_assert=(bool(enable_write_input_assert), expected_input_tokens, expected_input_positions)
    )
    srcs = None if err else source_args(ctx.real_kv_sources, ctx.real_kv_hash_mode, buf)
    if err is not None or srcs is None:
        if capturing(buf.device):
            raise err or ValueError("kv-canary: real-KV sources with non-contiguous rows cannot be captured in a CUDA graph")
        launch_canary_write_kernel_torch_reference(
            context=ctx, plan=plan, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
            enable_write_input_assert=enable_write_input_assert, expected_input_tokens=expected_input_tokens,
            expected_input_positions=expected_input_positions,
        )
        return
    dev = buf.device
    fields = buf.view(torch.int64)
    num_slots, stride_words = fields.shape
    table, state = _Scratch.get(dev, num_slots)
    seed_cap = plan.write_seed_slot_indices.shape[0]
    n_entries = out_cache_loc.shape[0]
    sms = num_sms(dev)
    grid = (max(1, min(triton.cdiv(max(n_entries, seed_cap), _PREP_BLOCK), sms * _PROGRAMS_PER_SM)),)
    _write_prepare_kernel[grid](
        fields, stride_words, num_slots, out_cache_loc,
        plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs, seed_cap,
        table, state, ctx.kernel_run_counter, ctx.slot_run_counter,
        *srcs.args, **srcs.consts, BLOCK=_PREP_BLOCK, num_warps=4,
    )
    assert_on = bool(enable_write_input_assert)
    grid = (max(1, min(seed_cap, sms * _CHAIN_PROGRAMS_PER_SM)),)
    _write_chain_kernel[grid](
        fields, stride_words, input_ids, positions, out_cache_loc,
        expected_input_tokens if assert_on else input_ids, expected_input_positions if assert_on else positions,
        plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs, seed_cap,
        state, ctx.enable_chain_position_assert,
        ctx.violation_ring, ctx.violation_write_index, ctx.violation_ring.shape[0], ctx.slot_run_counter,
        int(ctx.kernel_kind), H0_SIGNED,
        INPUT_ASSERT=assert_on, CHUNK=_CHUNK, UNROLL=4, num_warps=1,
    )
