"""Triton write (docs/design.md §3.6): two launches that keep the sequential contract.

The chain recurrence is serial per request; everything else is parallel:

1. ``_write_prepare_kernel`` (persistent, sized from the device) walks every entry once:
   fingerprints its slot's real KV and stores the REAL_KV field (a slot's fingerprint does not
   depend on which entry stores it, so duplicates store the same bytes), counts the entries, and
   detects intra-launch aliasing — a slot stored twice, a seed that some entry of the launch
   stores, offsets that go backwards — with one epoch-tagged atomic per entry and per seed on a
   per-device scratch table. Counts and conflicts are added to scratch words; nothing waits for
   the other programs (the launch boundary is the barrier).
2. ``_write_chain_kernel`` reads the conflict words: none -> parallel mode, else serial mode.
   Parallel: program p owns requests p, p + P, p + 2P, ... (P programs), 32 at a time in lanes.
   A request of one entry (decode) is done in its lane: seed record, one chain step, store, rows.
   A longer request runs the per-request path in the program's single warp: the running hash
   advances one entry per step (the only serial work: its scalar inputs are read two steps ahead
   from lines that an L1 prefetch asked for two chunks ahead), then the chunk's tiles are re-read
   (L1 hits) and its token / position / prev_hash fields, the chain-position ``last_pos`` (a
   scan, only when rows are possible) and its violation rows are done in parallel. No tile is
   carried across chunks: ptxas sinks such loads past the serial loop and the back-edge copy
   then waits a full memory round trip per chunk (docs/lab/NOTES.md, run 6).
   Serial (aliasing seen): program 0 runs every request in batch order on the per-request path;
   every store lands before the next request reads its seed, and within a chunk only a slot's
   last entry stores. Program 0 also closes the launch: slot counter (parallel mode), epoch.

Small launches (request capacity and entries both <= ``WriteLaunchConfig.small_lanes``, known from
shapes: decode batches) run ``_write_small_kernel`` instead: one CTA holds every entry and request
in lanes, so the aliasing check needs no second launch (its table atomics return before the same
program decides), and a one-entry request is chained in its lane. Its atomics are relaxed (only their
old values matter; the launch boundary orders them for the next launch), so the seed records, the table
atomics and the real-KV loads are in flight together: two dependent memory round trips, then the stores.

Scratch words: the epoch (tags the table), the entry count, and two conflict counters used in
turns (launch e adds to word e % 2 after zeroing word (e + 1) % 2, so the chain kernel reads
their sum without knowing e). No host sync: counts are read on the device, grids come from
capacities. Launches whose lazy checks would fail (known from shapes) run the torch twin, or
raise at once under capture.

Timing jitter (``JITTER``, docs/design.md §3.11): the prepare kernel (or the single-CTA kernel, per context) draws
the stalls of the entries it stores, counts them and, on a GPU, spins before it fingerprints their KV; the chain
kernel never stalls. Without a `KernelJitter` the branch is not compiled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.jitter import KernelJitter
from kvcanary.ops.records import VerifyOrWriteContext, WritePlan
from kvcanary.ops.reference.write import launch_canary_write_kernel_torch_reference
from kvcanary.ops.triton.constants import (
    F_POSITION, F_PREV_HASH, F_REAL_KV, F_TOKEN, WRITE_POSITION, WRITE_SLOT_OOR, WRITE_TOKEN,
)
from kvcanary.ops.triton.hashing import (
    H0_SIGNED, as_i64, as_u64, fingerprint, mix3, slot_hash_of_fields, source_args, static_error,
)
from kvcanary.ops.dispatch import capturing
from kvcanary.ops.triton.jitter import jitter_args, jitter_stall
from kvcanary.ops.triton.launch import (
    jit_batch_sized, launch_in_pairs, num_sms, pdl_enabled, pdl_release, pdl_wait, two_context_args,
)
from kvcanary.ops.triton.ring import reserve_rows, store_rows


@dataclass(frozen=True, kw_only=True)
class WriteLaunchConfig:
    """Launch shape of the two write kernels.

    chunk: entries per chunk of the per-request path (= lanes of the chain kernel's one warp);
    unroll: unroll factor of the serial loop; prefetch: L1 prefetch two chunks ahead (GPU only);
    prep_block / prep_warps / prep_programs_per_sm: the prepare kernel's block of entries, warps
    and resident programs per multiprocessor; chain_programs_per_sm: chain programs per
    multiprocessor (each owns every P-th request); small_lanes: a launch whose request capacity and
    entry count are both at most this (decode batches) runs as one single-CTA kernel instead
    (0: never; at most 256); pdl: programmatic dependent launch.
    """

    chunk: int = 32
    unroll: int = 8
    prefetch: bool = True
    prep_block: int = 128
    prep_warps: int = 4
    prep_programs_per_sm: int = 16
    chain_programs_per_sm: int = 8
    small_lanes: int = 256
    pdl: bool = True


DEFAULT_WRITE_CONFIG = WriteLaunchConfig()

# Scratch state words (int64).
_EPOCH = tl.constexpr(0)
_COUNT = tl.constexpr(1)
_CONFLICTS = tl.constexpr(2)  # two words: 2 + epoch % 2
_STATE_WORDS = 8
_MAX_SMALL_LANES = 256


@triton.jit
def _claim(table_ptr, s, sd, inside, reads, writer_tag, seed_tag, LANES: tl.constexpr):
    """Tag the stored slots ``s`` (mask ``inside``) and the read seeds ``sd`` (mask ``reads``) in the epoch table;
    returns the old tags (relaxed atomics: only the old values matter)."""
    old_w = tl.atomic_max(table_ptr + s, tl.zeros([LANES], tl.int64) + writer_tag, mask=inside, sem="relaxed")
    old_r = tl.atomic_max(table_ptr + sd, tl.zeros([LANES], tl.int64) + seed_tag, mask=reads, sem="relaxed")
    return old_w, old_r


@triton.jit
def _publish_prepare(state_ptr, epoch, conflicts, count):
    """Add one prepare program's conflicts and stored-entry count to the scratch words."""
    if conflicts > 0:
        tl.atomic_add(state_ptr + _CONFLICTS + epoch % 2, conflicts, sem="relaxed")
    if count > 0:
        tl.atomic_add(state_ptr + _COUNT, count, sem="relaxed")


@jit_batch_sized('n_entries', 'seed_cap', 'kind', scalar_ptrs=(
    'num_reqs_ptr', 'kernel_counter_ptr', 'jit_params', 'jit_key', 'jit_counts'))
def _write_prepare_kernel(
    fields_ptr, stride_words, num_slots,       # canary buffer as int64 [num_slots, stride_words]
    slot_ptr, n_entries,                       # out_cache_loc, int32/int64 [n_entries]
    off_ptr, seed_ptr, num_reqs_ptr, seed_cap, # write plan
    table_ptr, state_ptr,                      # scratch: int64 [>= num_slots], int64 [8]
    kernel_counter_ptr,
    s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
    kind, jit_params, jit_key, jit_counts,     # launch tag; timing jitter (JITTER): int64 [3], [1], [2]
    NSRC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    LANES_CH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, JITTER: tl.constexpr, SPIN: tl.constexpr,
):
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(state_ptr + _EPOCH)
    if pid == 0:
        tl.atomic_add(kernel_counter_ptr, 1, sem="relaxed")
        tl.store(state_ptr + _CONFLICTS + (epoch + 1) % 2, 0)
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
    # The loop runs over the capacities (host ints), so the slot and request loads of an
    # iteration are issued together with the num_reqs -> offsets[a] chain (in bounds: they read
    # within the tensors' shapes; what lies past the work gate is loaded but never used). Only
    # the atomics, stores and real-KV reads wait for the gate.
    for start in range(pid * BLOCK, tl.maximum(n_entries, seed_cap), nprog * BLOCK):
        i = start + lanes
        s = tl.load(slot_ptr + i, mask=i < n_entries, other=-1).to(tl.int64)
        r = i
        rc = r < seed_cap
        o0 = tl.load(off_ptr + r, mask=rc, other=0)
        o1 = tl.load(off_ptr + r + 1, mask=rc, other=0)
        sd = tl.load(seed_ptr + r, mask=rc, other=-1)
        m = (i < end) & (i >= begin)
        rm = r < n_req
        w = m & (s >= 0)
        inside = w & (s < num_slots)  # a slot past the buffer: reported by the chain kernel, not stored
        if JITTER:  # seeded stalls before the KV is read (docs/design.md §3.11)
            jitter_stall(jit_params, jit_key, jit_counts, kind, s, inside, SPIN)
        count += tl.sum(inside.to(tl.int64), 0)
        reads = rm & (sd >= 0) & (sd < num_slots) & (o1 > o0)
        old_w, old_r = _claim(table_ptr, s, sd, inside, reads, writer_tag, seed_tag, BLOCK)
        fp = fingerprint(s, inside, s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
                         NSRC, W0, W1, W2, W3, LANES_CH)
        tl.store(fields_ptr + s * stride_words + F_REAL_KV, as_i64(fp), mask=inside)
        conflicts += tl.sum((inside & (old_w >= seed_tag)).to(tl.int64), 0)
        conflicts += tl.sum((rm & (o1 < o0)).to(tl.int64), 0)
        conflicts += tl.sum((reads & (old_r == writer_tag)).to(tl.int64), 0)
    _publish_prepare(state_ptr, epoch, conflicts, count)


@triton.jit
def _prefetch_l1(ptr):
    """Ask L1 for the lines of ``ptr`` (a tensor of pointers); no result, GPU only."""
    tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _later_max(i1, p1, i2, p2):
    """Scan combine: the (index, position) pair of the later valid entry (index -1: none)."""
    take = i2 >= i1
    return tl.where(take, i2, i1), tl.where(take, p2, p1)


@triton.jit
def _seed_state(fields_ptr, stride_words, num_slots, seed, h0):
    """(running hash, seed's stored position) a request starts from: H0 and 0 without a seed; a
    seed past the buffer reads as an all-zero record (never loaded)."""
    has_seed = seed >= 0
    readable = has_seed & (seed < num_slots)
    srec = fields_ptr + tl.where(readable, seed, 0) * stride_words
    seed_tok = tl.load(srec + F_TOKEN, mask=readable, other=0)
    seed_pos = tl.load(srec + F_POSITION, mask=readable, other=0)
    seed_prev = tl.load(srec + F_PREV_HASH, mask=readable, other=0)
    running = tl.where(has_seed, slot_hash_of_fields(seed_prev, seed_tok, seed_pos), as_u64(h0 + seed * 0))
    return running, seed_pos


@triton.jit
def _entry_rows(
    ring_ptr, widx_ptr, ring_cap, kind, slot, pos, tok, etok, epos, hs, lp, valid, oor, chain_on,
    INPUT_ASSERT: tl.constexpr,
):
    """Violation rows of write entries (one per lane): the input-assert row, then the chain row;
    or, for an entry whose slot is past the buffer (``oor``, never ``valid``), its one
    WRITE_SLOT_OUT_OF_RANGE row.

    ``hs`` is the running hash each entry stores, ``lp`` the chain's ``last_pos`` before it;
    ``chain_on`` says whether the entry's request has the chain-position assert active."""
    chain_bad = valid & chain_on & (pos != lp + 1)
    if INPUT_ASSERT:
        in_bits = tl.where(tok != etok, WRITE_TOKEN, 0) + tl.where(pos != epos, WRITE_POSITION, 0)
    else:
        in_bits = tl.zeros(slot.shape, tl.int32)
    in_bad = valid & (in_bits != 0)
    nrows = in_bad.to(tl.int32) + chain_bad.to(tl.int32) + oor.to(tl.int32)
    if tl.sum(nrows, 0) > 0:
        row_in = reserve_rows(widx_ptr, nrows)
        kinds = tl.zeros(slot.shape, tl.int64) + kind
        store_rows(ring_ptr, ring_cap, row_in, oor, kinds, slot, pos, tok, tok, hs, pos,
                   tl.zeros(slot.shape, tl.int64) + WRITE_SLOT_OOR)
        if INPUT_ASSERT:
            store_rows(ring_ptr, ring_cap, row_in, in_bad, kinds, slot, pos, tok, etok, hs, epos,
                       in_bits.to(tl.int64))
        store_rows(ring_ptr, ring_cap, row_in + in_bad.to(tl.int64), chain_bad, kinds, slot, pos, tok, tok, hs,
                   lp + 1, tl.zeros(slot.shape, tl.int64) + WRITE_POSITION)


@triton.jit
def _first_entries(slot_ptr, tok_ptr, pos_ptr, o0, o1, n_entries):
    """(slot, token, position) of a request's first two entries, int64: masked by the unclamped end (never past
    the tensor); a missing entry reads as slot -1."""
    lim = tl.minimum(o1, n_entries)
    k0 = (o0 < lim) & (o0 >= 0)
    k1 = (o0 + 1 < lim) & (o0 >= 0)
    s_n = tl.load(slot_ptr + o0, mask=k0, other=-1).to(tl.int64)
    t_n = tl.load(tok_ptr + o0, mask=k0, other=0).to(tl.int64)
    p_n = tl.load(pos_ptr + o0, mask=k0, other=0).to(tl.int64)
    s_nn = tl.load(slot_ptr + o0 + 1, mask=k1, other=-1).to(tl.int64)
    t_nn = tl.load(tok_ptr + o0 + 1, mask=k1, other=0).to(tl.int64)
    p_nn = tl.load(pos_ptr + o0 + 1, mask=k1, other=0).to(tl.int64)
    return s_n, t_n, p_n, s_nn, t_nn, p_nn


@triton.jit
def _prefetch_entries(slot_ptr, tok_ptr, pos_ptr, pf):
    """`_prefetch_l1` of the slot, token and position lines of entries ``pf``."""
    _prefetch_l1(slot_ptr + pf)
    _prefetch_l1(tok_ptr + pf)
    _prefetch_l1(pos_ptr + pf)


@triton.jit
def _serial_chunk(
    slot_ptr, tok_ptr, pos_ptr, num_slots, o0, c, n, cnt, last_chunk, lanes,
    s_n, t_n, p_n, s_nn, t_nn, p_nn, running, CHUNK: tl.constexpr, UNROLL: tl.constexpr,
):
    """The serial part of chunk ``c``, only the recurrence on the dependency path: the running hash before each
    entry (``hs``, one per lane), each entry's scalars read two steps ahead; the request's last entry needs no
    step after it. Returns the next two entries' scalars, ``hs`` and the running hash."""
    steps = tl.where(last_chunk, cnt - 1, cnt)
    hs = tl.zeros([CHUNK], tl.int64)
    base_k = o0 + c + 2
    for j in tl.range(0, steps, loop_unroll_factor=UNROLL):
        s_j = s_n
        t_j = t_n
        p_j = p_n
        s_n = s_nn
        t_n = t_nn
        p_n = p_nn
        k = base_k + j
        km = c + j + 2 < n
        s_nn = tl.load(slot_ptr + k, mask=km, other=-1).to(tl.int64)
        t_nn = tl.load(tok_ptr + k, mask=km, other=0).to(tl.int64)
        p_nn = tl.load(pos_ptr + k, mask=km, other=0).to(tl.int64)
        hs = tl.where(lanes == j, as_i64(running), hs)
        running = tl.where((s_j >= 0) & (s_j < num_slots), mix3(running, as_u64(t_j), as_u64(p_j)), running)
    return s_n, t_n, p_n, s_nn, t_nn, p_nn, hs, running


@triton.jit
def _load_entries(slot_ptr, tok_ptr, pos_ptr, idx, mask, num_slots):
    """(slot, token, position) of entries ``idx`` under ``mask``, int64, and which of them are stored (``valid``)
    or past the buffer (``oor``)."""
    slot = tl.load(slot_ptr + idx, mask=mask, other=-1).to(tl.int64)
    tok = tl.load(tok_ptr + idx, mask=mask, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + idx, mask=mask, other=0).to(tl.int64)
    valid = mask & (slot >= 0) & (slot < num_slots)
    oor = mask & (slot >= num_slots)
    return slot, tok, pos, valid, oor


@triton.jit
def _store_entries(fields_ptr, stride_words, slot, tok, pos, hs, valid, later, SERIAL: tl.constexpr):
    """Store the entries' token, position and prev_hash (``hs``) fields; in serial mode (duplicates possible) only
    a slot's last entry (``later``: lane j after lane i) stores."""
    if SERIAL:  # duplicates exist only in serial mode: keep a slot's last entry
        dup = (slot[:, None] == slot[None, :]) & valid[None, :] & later
        keep = valid & (tl.max(dup.to(tl.int32), 1) == 0)
    else:
        keep = valid
    rec = fields_ptr + tl.where(keep, slot, 0) * stride_words
    tl.store(rec + F_TOKEN, tok, mask=keep)
    tl.store(rec + F_POSITION, pos, mask=keep)
    tl.store(rec + F_PREV_HASH, hs, mask=keep)


@triton.jit
def _expected_entries(exp_tok_ptr, exp_pos_ptr, idx, mask, tok, pos, INPUT_ASSERT: tl.constexpr):
    """The write-input assert's expected (token, position) of entries ``idx`` under ``mask``, int64; without the
    assert the entries' own (nothing loaded)."""
    if INPUT_ASSERT:
        etok = tl.load(exp_tok_ptr + idx, mask=mask, other=0).to(tl.int64)
        epos = tl.load(exp_pos_ptr + idx, mask=mask, other=0).to(tl.int64)
    else:
        etok = tok
        epos = pos
    return etok, epos


@triton.jit
def _chunk_rows(
    slot_ptr, pos_ptr, exp_tok_ptr, exp_pos_ptr, idx, m_c, lanes, num_slots, slot_c, tok_c, pos_c, hs, valid,
    oor_c, last_pos, chain_on, ring_ptr, widx_ptr, ring_cap, kind, INPUT_ASSERT: tl.constexpr,
):
    """The chunk's violation rows (`_entry_rows`); ``last_pos`` before each entry, in parallel: the latest stored
    entry before it in the chunk (a scan over the entries shifted by one), else the carried value. Returns the
    carried ``last_pos`` after the chunk."""
    pm = m_c & (lanes > 0)
    slot_p = tl.load(slot_ptr + idx - 1, mask=pm, other=-1)
    pos_p = tl.load(pos_ptr + idx - 1, mask=pm, other=0).to(tl.int64)
    i_p = tl.where(pm & (slot_p >= 0) & (slot_p < num_slots), lanes - 1, -1)
    i_s, p_s = tl.associative_scan((i_p, pos_p), 0, _later_max)
    lp = tl.where(i_s >= 0, p_s, last_pos)
    i_l, p_l = tl.reduce((tl.where(valid, lanes, -1), pos_c), 0, _later_max)
    last_pos = tl.where(i_l >= 0, p_l, last_pos)
    etok_c, epos_c = _expected_entries(exp_tok_ptr, exp_pos_ptr, idx, m_c, tok_c, pos_c, INPUT_ASSERT)
    _entry_rows(ring_ptr, widx_ptr, ring_cap, kind, slot_c, pos_c, tok_c, etok_c, epos_c, hs, lp, valid,
                oor_c, (lanes >= 0) & chain_on, INPUT_ASSERT)
    return last_pos


@triton.jit
def _chain_request(
    fields_ptr, stride_words, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,
    o0, o1, end_all, seed, chain_flag, ring_ptr, widx_ptr, ring_cap, kind, h0,
    INPUT_ASSERT: tl.constexpr, SERIAL: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """One request on the program's single warp: entries [o0, min(o1, end_all)). Returns the
    number of entries written (int64)."""
    lanes = tl.arange(0, CHUNK)
    later = lanes[None, :] > lanes[:, None]
    n = tl.maximum(tl.minimum(o1, end_all) - o0, 0)
    s_n, t_n, p_n, s_nn, t_nn, p_nn = _first_entries(slot_ptr, tok_ptr, pos_ptr, o0, o1, n_entries)
    running, last_pos = _seed_state(fields_ptr, stride_words, num_slots, seed, h0)
    chain_on = (seed >= 0) & chain_flag
    check = chain_on | INPUT_ASSERT
    count_v = tl.zeros([CHUNK], tl.int32)
    if PREFETCH:
        if CHUNK < n:
            _prefetch_entries(slot_ptr, tok_ptr, pos_ptr, o0 + CHUNK + tl.minimum(lanes, n - CHUNK - 1))
    for c in range(0, n, CHUNK):
        if PREFETCH:  # two chunks ahead: the serial loop's scalar loads then hit L1
            if c + 2 * CHUNK < n:
                pf = o0 + c + 2 * CHUNK + tl.minimum(lanes, n - c - 2 * CHUNK - 1)
                _prefetch_entries(slot_ptr, tok_ptr, pos_ptr, pf)
                if INPUT_ASSERT:
                    _prefetch_l1(exp_tok_ptr + pf)
                    _prefetch_l1(exp_pos_ptr + pf)
        cnt = tl.minimum(n - c, CHUNK).to(tl.int32)
        last_chunk = c + CHUNK >= n
        s_n, t_n, p_n, s_nn, t_nn, p_nn, hs, running = _serial_chunk(
            slot_ptr, tok_ptr, pos_ptr, num_slots, o0, c, n, cnt, last_chunk, lanes,
            s_n, t_n, p_n, s_nn, t_nn, p_nn, running, CHUNK, UNROLL)
        hs = tl.where(last_chunk & (lanes == cnt - 1), as_i64(running), hs)
        # Parallel part: the chunk's tiles (L1 hits), stores (a slot's last entry in the chunk
        # wins) and violation rows.
        idx = o0 + c + lanes
        m_c = lanes < cnt
        slot_c, tok_c, pos_c, valid, oor_c = _load_entries(slot_ptr, tok_ptr, pos_ptr, idx, m_c, num_slots)
        count_v += valid.to(tl.int32)
        _store_entries(fields_ptr, stride_words, slot_c, tok_c, pos_c, hs, valid, later, SERIAL)
        if check | (tl.sum(oor_c.to(tl.int32), 0) > 0):
            last_pos = _chunk_rows(slot_ptr, pos_ptr, exp_tok_ptr, exp_pos_ptr, idx, m_c, lanes, num_slots, slot_c,
                                   tok_c, pos_c, hs, valid, oor_c, last_pos, chain_on, ring_ptr, widx_ptr, ring_cap,
                                   kind, INPUT_ASSERT)
        if SERIAL:
            tl.debug_barrier()  # this chunk's stores land before later reads
    return tl.sum(count_v.to(tl.int64), 0)


@triton.jit
def _serial_requests(
    fields_ptr, stride_words, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,
    off_ptr, seed_ptr, a, end_all, chain_flag, ring_ptr, widx_ptr, ring_cap, slot_counter_ptr, kind, h0,
    INPUT_ASSERT: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Aliasing seen: every request of one context in batch order on the per-request path, then the slot counter."""
    total = tl.zeros([], tl.int64)
    for r in range(0, a):
        total += _chain_request(
            fields_ptr, stride_words, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,
            tl.load(off_ptr + r).to(tl.int64), tl.load(off_ptr + r + 1).to(tl.int64), end_all,
            tl.load(seed_ptr + r).to(tl.int64), chain_flag, ring_ptr, widx_ptr, ring_cap, kind, h0,
            INPUT_ASSERT, True, CHUNK, UNROLL, PREFETCH)
    tl.atomic_add(slot_counter_ptr, total, sem="relaxed")


@triton.jit
def _next_long(todo, lanes, o0, o1, seed, NONE: tl.constexpr):
    """The first lane of ``todo`` (``NONE``: the lane count): ``todo`` without it and its request's (o0, o1,
    seed) as scalars."""
    k = tl.min(tl.where(todo, lanes, NONE), 0)
    todo = todo & (lanes != k)
    pick = lanes == k
    return todo, tl.sum(tl.where(pick, o0, 0), 0), tl.sum(tl.where(pick, o1, 0), 0), tl.sum(tl.where(pick, seed, 0), 0)


@triton.jit
def _close_chain_launch(state_ptr, slot_counter_ptr, serial):
    """Program 0 of the chain kernel: advance the epoch, take the prepare kernel's entry count (to the slot
    counter in parallel mode; serial mode counts its own) and zero it."""
    tl.store(state_ptr + _EPOCH, tl.load(state_ptr + _EPOCH) + 1)
    counted = tl.load(state_ptr + _COUNT)
    tl.store(state_ptr + _COUNT, 0)
    if not serial:
        tl.atomic_add(slot_counter_ptr, counted, sem="relaxed")


@jit_batch_sized('n_entries', 'seed_cap', 'kind', scalar_ptrs=(
    'num_reqs_ptr', 'chain_assert_ptr', 'widx_ptr', 'slot_counter_ptr'))
def _write_chain_kernel(
    fields_ptr, stride_words, num_slots,
    tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,  # flattened entries
    off_ptr, seed_ptr, num_reqs_ptr, seed_cap,
    state_ptr, chain_assert_ptr,
    ring_ptr, widx_ptr, ring_cap, slot_counter_ptr,
    kind, h0,
    INPUT_ASSERT: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    serial = (tl.load(state_ptr + _CONFLICTS) + tl.load(state_ptr + _CONFLICTS + 1)) != 0
    a = tl.minimum(tl.maximum(tl.load(num_reqs_ptr).to(tl.int64), 0), seed_cap)
    chain_flag = tl.load(chain_assert_ptr) != 0
    end_all = tl.load(off_ptr + a)
    a = tl.where(end_all > 0, a, 0)  # work gate
    if pid == 0:  # close the launch (nobody else reads these words in this kernel)
        _close_chain_launch(state_ptr, slot_counter_ptr, serial)
    if serial:
        if pid == 0:
            _serial_requests(fields_ptr, stride_words, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr,
                             n_entries, off_ptr, seed_ptr, a, end_all, chain_flag, ring_ptr, widx_ptr, ring_cap,
                             slot_counter_ptr, kind, h0, INPUT_ASSERT, CHUNK, UNROLL, PREFETCH)
    else:
        lanes = tl.arange(0, CHUNK)
        owned = tl.maximum(a - pid + nprog - 1, 0) // nprog  # requests pid, pid + nprog, ... < a
        for kc in range(0, owned, CHUNK):
            rr = pid + (kc + lanes).to(tl.int64) * nprog
            mr = rr < a
            o0 = tl.load(off_ptr + rr, mask=mr, other=0).to(tl.int64)
            o1 = tl.load(off_ptr + rr + 1, mask=mr, other=0).to(tl.int64)
            seed = tl.load(seed_ptr + rr, mask=mr, other=-1).to(tl.int64)
            # One-entry requests, one per lane (no aliasing in parallel mode: order is free).
            running, seed_pos = _one_entry_seed_state(o0, o1, seed, mr, end_all, fields_ptr, stride_words, num_slots, h0)
            todo = _one_entry_lanes(o0, o1, seed, mr, end_all, chain_flag, fields_ptr, stride_words, num_slots, tok_ptr,
                                    pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, ring_ptr, widx_ptr, ring_cap, kind,
                                    running, seed_pos, INPUT_ASSERT)
            # Longer requests, one at a time on the per-request path.
            for _t in range(0, tl.sum(todo.to(tl.int32), 0)):
                todo, o0_k, o1_k, seed_k = _next_long(todo, lanes, o0, o1, seed, CHUNK)
                _chain_request(
                    fields_ptr, stride_words, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,
                    o0_k, o1_k, end_all, seed_k, chain_flag, ring_ptr, widx_ptr, ring_cap, kind, h0,
                    INPUT_ASSERT, False, CHUNK, UNROLL, PREFETCH)


@triton.jit
def _one_entry_seed_state(o0, o1, seed, mr, end_all, fields_ptr, stride_words, num_slots, h0):
    """`_seed_state` of the one-entry requests among lanes ``mr`` (others: unused values). Its loads
    depend only on the plan, so a caller may issue them early, with other loads in flight."""
    n = tl.maximum(tl.minimum(o1, end_all) - o0, 0)
    return _seed_state(fields_ptr, stride_words, num_slots, tl.where(mr & (n == 1), seed, -1), h0)


@triton.jit
def _one_entry_lanes(
    o0, o1, seed, mr, end_all, chain_flag, fields_ptr, stride_words, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr,
    exp_pos_ptr, ring_ptr, widx_ptr, ring_cap, kind, running, seed_pos, INPUT_ASSERT: tl.constexpr,
):
    """Parallel mode: the requests (one per lane, mask ``mr``) that have exactly one entry are
    chained from (``running``, ``seed_pos``) = `_one_entry_seed_state` and stored in their lanes.
    Returns the mask of the longer requests."""
    n = tl.maximum(tl.minimum(o1, end_all) - o0, 0)
    one = mr & (n == 1)
    e = tl.where(one, o0, 0)
    slot, tok, pos, valid, oor = _load_entries(slot_ptr, tok_ptr, pos_ptr, e, one, num_slots)
    hs = as_i64(running)
    _store_entries(fields_ptr, stride_words, slot, tok, pos, hs, valid, None, False)
    etok, epos = _expected_entries(exp_tok_ptr, exp_pos_ptr, e, valid, tok, pos, INPUT_ASSERT)
    _entry_rows(ring_ptr, widx_ptr, ring_cap, kind, slot, pos, tok, etok, epos, hs, seed_pos, valid, oor,
                (seed >= 0) & chain_flag, INPUT_ASSERT)
    return mr & (n > 1)


@triton.jit
def _small_open(state_ptr, kca, kcb, off_ptr, seed_ptr, slot_ptr, num_reqs_ptr, seed_cap, n_entries, caa, cab, lanes,
                NCTX: tl.constexpr):
    """Open the single-CTA launch: count it in each context's kernel counter, then read the plan in lanes.
    Returns the epoch, request i's offsets (o0, o1) and seed, entry i's slot, the request count after the work
    gate, the work range (begin, end_all) and each context's chain-position assert flag."""
    epoch = tl.load(state_ptr + _EPOCH)
    tl.atomic_add(kca, 1, sem="relaxed")
    if NCTX == 2:
        tl.atomic_add(kcb, 1, sem="relaxed")
    rc = lanes < seed_cap
    o0 = tl.load(off_ptr + lanes, mask=rc, other=0).to(tl.int64)
    o1 = tl.load(off_ptr + lanes + 1, mask=rc, other=0).to(tl.int64)
    sd = tl.load(seed_ptr + lanes, mask=rc, other=-1).to(tl.int64)
    s = tl.load(slot_ptr + lanes, mask=lanes < n_entries, other=-1).to(tl.int64)
    a = tl.minimum(tl.maximum(tl.load(num_reqs_ptr).to(tl.int64), 0), seed_cap)
    chain_a = tl.load(caa) != 0
    chain_b = chain_a
    if NCTX == 2:
        chain_b = tl.load(cab) != 0
    begin = tl.sum(tl.where(lanes == 0, o0, 0), 0)
    end_all = tl.sum(tl.where(lanes == a - 1, o1, 0), 0)  # offsets[a], 0 when a == 0 (the work gate)
    a = tl.where(end_all > 0, a, 0)
    return epoch, o0, o1, sd, s, a, begin, end_all, chain_a, chain_b


@triton.jit
def _early_seed_states(o0, o1, sd, a, end_all, lanes, fa, swa, fb, swb, num_slots, h0, NCTX: tl.constexpr):
    """`_one_entry_seed_state` of each context (B's is A's with one context)."""
    run_a, seed_pos_a = _one_entry_seed_state(o0, o1, sd, lanes < a, end_all, fa, swa, num_slots, h0)
    run_b = run_a
    seed_pos_b = seed_pos_a
    if NCTX == 2:
        run_b, seed_pos_b = _one_entry_seed_state(o0, o1, sd, lanes < a, end_all, fb, swb, num_slots, h0)
    return run_a, seed_pos_a, run_b, seed_pos_b


@triton.jit
def _small_masks(epoch, s, sd, o0, o1, begin, end_all, a, lanes, num_slots):
    """The epoch's (writer, seed) tags, entries stored (``inside``: in the work range, in the buffer), live
    requests (``rm``) and seeds read (``reads``), as the prepare kernel decides them."""
    writer_tag = epoch * 4 + 2
    seed_tag = epoch * 4 + 1
    w = (lanes < end_all) & (lanes >= begin) & (s >= 0)
    inside = w & (s < num_slots)
    rm = lanes < a
    reads = rm & (sd >= 0) & (sd < num_slots) & (o1 > o0)
    return writer_tag, seed_tag, inside, rm, reads


@triton.jit
def _small_serial(
    tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries, num_slots, h0, off_ptr, seed_ptr, a, end_all,
    fa, swa, chain_a, ringa, widxa, capa, sca, kinda,   # context A
    fb, swb, chain_b, ringb, widxb, capb, scb, kindb,   # context B (NCTX == 2)
    NCTX: tl.constexpr, INPUT_ASSERT: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Aliasing seen: `_serial_requests` of context A, then of B."""
    _serial_requests(fa, swa, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,
                     off_ptr, seed_ptr, a, end_all, chain_a, ringa, widxa, capa, sca, kinda, h0,
                     INPUT_ASSERT, CHUNK, UNROLL, PREFETCH)
    if NCTX == 2:
        _serial_requests(fb, swb, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,
                         off_ptr, seed_ptr, a, end_all, chain_b, ringb, widxb, capb, scb, kindb, h0,
                         INPUT_ASSERT, CHUNK, UNROLL, PREFETCH)


@triton.jit
def _small_parallel(
    tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries, num_slots, h0, o0, o1, sd, rm, end_all,
    inside, lanes,
    fa, swa, chain_a, ringa, widxa, capa, sca, kinda, run_a, seed_pos_a,   # context A
    fb, swb, chain_b, ringb, widxb, capb, scb, kindb, run_b, seed_pos_b,   # context B (NCTX == 2)
    NCTX: tl.constexpr, INPUT_ASSERT: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr,
    PREFETCH: tl.constexpr, LANES: tl.constexpr,
):
    """No aliasing: count the stored entries, chain the one-entry requests in their lanes from the early seed
    states (``run``, ``seed_pos``), then the longer ones one at a time on the per-request path; per request,
    context A then B."""
    count = tl.sum(inside.to(tl.int64), 0)
    tl.atomic_add(sca, count, sem="relaxed")
    todo = _one_entry_lanes(o0, o1, sd, rm, end_all, chain_a, fa, swa, num_slots, tok_ptr, pos_ptr,
                            slot_ptr, exp_tok_ptr, exp_pos_ptr, ringa, widxa, capa, kinda, run_a, seed_pos_a,
                            INPUT_ASSERT)
    if NCTX == 2:
        tl.atomic_add(scb, count, sem="relaxed")
        _one_entry_lanes(o0, o1, sd, rm, end_all, chain_b, fb, swb, num_slots, tok_ptr, pos_ptr,
                         slot_ptr, exp_tok_ptr, exp_pos_ptr, ringb, widxb, capb, kindb, run_b, seed_pos_b,
                         INPUT_ASSERT)
    for _t in range(0, tl.sum(todo.to(tl.int32), 0)):
        todo, o0_k, o1_k, sd_k = _next_long(todo, lanes, o0, o1, sd, LANES)
        _chain_request(
            fa, swa, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,
            o0_k, o1_k, end_all, sd_k, chain_a, ringa, widxa, capa, kinda, h0,
            INPUT_ASSERT, False, CHUNK, UNROLL, PREFETCH)
        if NCTX == 2:
            _chain_request(
                fb, swb, num_slots, tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,
                o0_k, o1_k, end_all, sd_k, chain_b, ringb, widxb, capb, kindb, h0,
                INPUT_ASSERT, False, CHUNK, UNROLL, PREFETCH)


@jit_batch_sized('n_entries', 'seed_cap', 'kinda', 'kindb', scalar_ptrs=(
    'num_reqs_ptr', 'caa', 'widxa', 'sca', 'kca', 'cab', 'widxb', 'scb', 'kcb', 'jit_params', 'jit_key', 'jit_counts'))
def _write_small_kernel(
    tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries,   # flattened entries (<= LANES)
    off_ptr, seed_ptr, num_reqs_ptr, seed_cap,                          # write plan (seed_cap <= LANES)
    table_ptr, state_ptr, num_slots, h0,                                # scratch; canary rows (both contexts)
    # context A: int64 view of canary_buf, row words; chain assert int32 [1]; ring, index, ring cap;
    # counters; launch tag; real-KV sources
    fa, swa, caa, ringa, widxa, capa, sca, kca, kinda,
    a_s0, a_p0, a_n0, a_r0, a_s1, a_p1, a_n1, a_r1, a_s2, a_p2, a_n2, a_r2, a_s3, a_p3, a_n3, a_r3,
    # context B (NCTX == 2; else the same as A and unused)
    fb, swb, cab, ringb, widxb, capb, scb, kcb, kindb,
    b_s0, b_p0, b_n0, b_r0, b_s1, b_p1, b_n1, b_r1, b_s2, b_p2, b_n2, b_r2, b_s3, b_p3, b_n3, b_r3,
    jit_params, jit_key, jit_counts,        # timing jitter (JITTER): int64 [3], [1], [2]; else unused
    A_NSRC: tl.constexpr, A_W0: tl.constexpr, A_W1: tl.constexpr, A_W2: tl.constexpr, A_W3: tl.constexpr,
    A_LANES_CH: tl.constexpr,
    B_NSRC: tl.constexpr, B_W0: tl.constexpr, B_W1: tl.constexpr, B_W2: tl.constexpr, B_W3: tl.constexpr,
    B_LANES_CH: tl.constexpr,
    NCTX: tl.constexpr, INPUT_ASSERT: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr,
    PREFETCH: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr, JITTER: tl.constexpr, SPIN: tl.constexpr,
):
    """The whole write in one program: lane i holds entry i and request i. With NCTX == 2 the same
    entries are written into a second buffer of as many rows (its own records, sources, counters and
    ring): the aliasing check is the entries', so it is done once for both."""
    pdl_wait(PDL)
    pdl_release(PDL)
    lanes = tl.arange(0, LANES)
    epoch, o0, o1, sd, s, a, begin, end_all, chain_a, chain_b = _small_open(
        state_ptr, kca, kcb, off_ptr, seed_ptr, slot_ptr, num_reqs_ptr, seed_cap, n_entries, caa, cab, lanes, NCTX)
    # The parallel path's seed records, loaded now (with the atomics and fingerprint loads below in flight):
    # without aliasing no entry of this launch stores a seed's fields, so they are what that path reads.
    run_a, seed_pos_a, run_b, seed_pos_b = _early_seed_states(o0, o1, sd, a, end_all, lanes, fa, swa, fb, swb,
                                                              num_slots, h0, NCTX)
    # Aliasing, as the prepare kernel detects it (same epoch-tagged table).
    writer_tag, seed_tag, inside, rm, reads = _small_masks(epoch, s, sd, o0, o1, begin, end_all, a, lanes, num_slots)
    if JITTER:  # seeded stalls before the KV is read (docs/design.md §3.11), per context
        jitter_stall(jit_params, jit_key, jit_counts, kinda, s, inside, SPIN)
        if NCTX == 2:
            jitter_stall(jit_params, jit_key, jit_counts, kindb, s, inside, SPIN)
    old_w, old_r = _claim(table_ptr, s, sd, inside, reads, writer_tag, seed_tag, LANES)
    fp_a = fingerprint(s, inside, a_s0, a_p0, a_n0, a_r0, a_s1, a_p1, a_n1, a_r1, a_s2, a_p2, a_n2, a_r2,
                       a_s3, a_p3, a_n3, a_r3, A_NSRC, A_W0, A_W1, A_W2, A_W3, A_LANES_CH)
    if NCTX == 2:
        fp_b = fingerprint(s, inside, b_s0, b_p0, b_n0, b_r0, b_s1, b_p1, b_n1, b_r1, b_s2, b_p2, b_n2, b_r2,
                           b_s3, b_p3, b_n3, b_r3, B_NSRC, B_W0, B_W1, B_W2, B_W3, B_LANES_CH)
        tl.store(fb + s * swb + F_REAL_KV, as_i64(fp_b), mask=inside)
    tl.store(fa + s * swa + F_REAL_KV, as_i64(fp_a), mask=inside)
    conflicts = tl.sum((inside & (old_w >= seed_tag)).to(tl.int32), 0)
    conflicts += tl.sum((rm & (o1 < o0)).to(tl.int32), 0)
    conflicts += tl.sum((reads & (old_r == writer_tag)).to(tl.int32), 0)
    tl.store(state_ptr + _EPOCH, epoch + 1)
    tl.store(state_ptr + _CONFLICTS + (epoch + 1) % 2, 0)  # the word the next two-kernel launch uses
    if conflicts != 0:
        _small_serial(tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries, num_slots, h0, off_ptr, seed_ptr,
                      a, end_all, fa, swa, chain_a, ringa, widxa, capa, sca, kinda,
                      fb, swb, chain_b, ringb, widxb, capb, scb, kindb, NCTX, INPUT_ASSERT, CHUNK, UNROLL, PREFETCH)
    else:
        _small_parallel(tok_ptr, pos_ptr, slot_ptr, exp_tok_ptr, exp_pos_ptr, n_entries, num_slots, h0, o0, o1, sd,
                        rm, end_all, inside, lanes,
                        fa, swa, chain_a, ringa, widxa, capa, sca, kinda, run_a, seed_pos_a,
                        fb, swb, chain_b, ringb, widxb, capb, scb, kindb, run_b, seed_pos_b,
                        NCTX, INPUT_ASSERT, CHUNK, UNROLL, PREFETCH, LANES)


class _Scratch:
    """Per-device scratch of the aliasing detector: an epoch-tagged word per canary slot and
    the state words. Allocated on first use (do it before graph capture) and grown on demand;
    launches on one device share it, so they must be ordered (one stream)."""

    _by_device: dict = {}

    @classmethod
    def get(cls, device: torch.device, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device.type, device.index)
        entry = cls._by_device.get(key)
        if entry is None or entry[0].shape[0] < num_slots:
            table = torch.zeros(max(num_slots, 1), dtype=torch.int64, device=device)
            state = torch.zeros(_STATE_WORDS, dtype=torch.int64, device=device)
            state[_EPOCH.value] = 1  # zeroed table words never match a live epoch
            entry = (table, state)
            cls._by_device[key] = entry
        return entry


def _kernel_sources(ctx: VerifyOrWriteContext, assert_args: tuple):
    """SourceArgs for the kernels, or None when the launch needs the torch twin (or must raise)."""
    if static_error(ctx, check_input_assert=assert_args) is not None:
        return None
    return source_args(ctx.real_kv_sources, ctx.real_kv_hash_mode, ctx.canary_buf)


def _launch_twin(ctx: VerifyOrWriteContext, assert_args: tuple, plan: WritePlan, inputs: dict,
                 jitter: Optional[KernelJitter] = None) -> None:
    """The torch twin for a launch the kernels cannot take; under capture the error is raised at once (the
    twin would read the host)."""
    if capturing(ctx.canary_buf.device):
        raise static_error(ctx, check_input_assert=assert_args) or KvCanaryValueError(
            "kv-canary: real-KV sources with non-contiguous rows cannot be captured in a CUDA graph")
    launch_canary_write_kernel_torch_reference(context=ctx, plan=plan, jitter=jitter, **inputs)


def _small(plan: WritePlan, out_cache_loc: torch.Tensor, config: WriteLaunchConfig) -> bool:
    """True when the launch runs as the single-CTA kernel (sizes known from shapes: decode batches)."""
    return max(plan.write_seed_slot_indices.shape[0], out_cache_loc.shape[0]) <= min(config.small_lanes, _MAX_SMALL_LANES)


def _small_context_args(ctx: VerifyOrWriteContext, srcs, prefix: str) -> tuple[tuple, dict]:
    fields = ctx.canary_buf.view(torch.int64)
    args = (fields, fields.shape[1], ctx.enable_chain_position_assert, ctx.violation_ring, ctx.violation_write_index,
            ctx.violation_ring.shape[0], ctx.slot_run_counter, ctx.kernel_run_counter, int(ctx.kernel_kind),
            *srcs.args)
    return args, {f"{prefix}_{k}": v for k, v in srcs.consts.items()}


def _launch_small(contexts, sources, plan, inputs: dict, config: WriteLaunchConfig,
                  jitter: Optional[KernelJitter] = None) -> None:
    """One single-CTA launch writing the entries into one or two contexts (same row count)."""
    buf = contexts[0].canary_buf
    dev = buf.device
    num_slots = buf.shape[0]
    table, state = _Scratch.get(dev, num_slots)
    seed_cap = plan.write_seed_slot_indices.shape[0]
    out_cache_loc = inputs["out_cache_loc"]
    n_entries = out_cache_loc.shape[0]
    pdl = pdl_enabled(dev, config.pdl)
    assert_on = bool(inputs["enable_write_input_assert"])
    exp_tok = inputs["expected_input_tokens"] if assert_on else inputs["input_ids"]
    exp_pos = inputs["expected_input_positions"] if assert_on else inputs["positions"]
    ctx_args, consts = two_context_args(contexts, sources, _small_context_args)
    jit_args, jit_consts = jitter_args(jitter, contexts[0].kernel_run_counter)
    lanes = max(32, triton.next_power_of_2(max(seed_cap, n_entries)))
    _write_small_kernel[(1,)](
        inputs["input_ids"], inputs["positions"], out_cache_loc, exp_tok, exp_pos, n_entries,
        plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs, seed_cap,
        table, state, num_slots, H0_SIGNED, *ctx_args, *jit_args, **consts, **jit_consts,
        NCTX=len(contexts), INPUT_ASSERT=assert_on, CHUNK=config.chunk, UNROLL=config.unroll,
        PREFETCH=config.prefetch and dev.type == "cuda", LANES=lanes, PDL=pdl, num_warps=lanes // 32, launch_pdl=pdl,
    )


def _launch_two_kernels(ctx: VerifyOrWriteContext, srcs, plan: WritePlan, inputs: dict,
                        config: WriteLaunchConfig, jitter: Optional[KernelJitter] = None) -> None:
    """The prepare + chain kernel pair of one context (any size)."""
    buf = ctx.canary_buf
    dev = buf.device
    fields = buf.view(torch.int64)
    num_slots, stride_words = fields.shape
    table, state = _Scratch.get(dev, num_slots)
    seed_cap = plan.write_seed_slot_indices.shape[0]
    out_cache_loc = inputs["out_cache_loc"]
    n_entries = out_cache_loc.shape[0]
    sms = num_sms(dev)
    pdl = pdl_enabled(dev, config.pdl)
    assert_on = bool(inputs["enable_write_input_assert"])
    exp_tok = inputs["expected_input_tokens"] if assert_on else inputs["input_ids"]
    exp_pos = inputs["expected_input_positions"] if assert_on else inputs["positions"]
    prefetch = config.prefetch and dev.type == "cuda"
    pb = config.prep_block
    grid = (max(1, min(triton.cdiv(max(n_entries, seed_cap), pb), sms * config.prep_programs_per_sm)),)
    jit_args, jit_consts = jitter_args(jitter, ctx.kernel_run_counter)
    _write_prepare_kernel[grid](
        fields, stride_words, num_slots, out_cache_loc, n_entries,
        plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs, seed_cap,
        table, state, ctx.kernel_run_counter,
        *srcs.args, int(ctx.kernel_kind), *jit_args, **srcs.consts, **jit_consts,
        BLOCK=pb, PDL=pdl, num_warps=config.prep_warps, launch_pdl=pdl,
    )
    grid = (max(1, min(seed_cap, sms * config.chain_programs_per_sm)),)
    _write_chain_kernel[grid](
        fields, stride_words, num_slots, inputs["input_ids"], inputs["positions"], out_cache_loc, exp_tok, exp_pos,
        n_entries, plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs, seed_cap,
        state, ctx.enable_chain_position_assert,
        ctx.violation_ring, ctx.violation_write_index, ctx.violation_ring.shape[0], ctx.slot_run_counter,
        int(ctx.kernel_kind), H0_SIGNED,
        INPUT_ASSERT=assert_on, CHUNK=config.chunk, UNROLL=config.unroll,
        PREFETCH=prefetch, PDL=pdl, num_warps=1, launch_pdl=pdl,
    )


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
    config: WriteLaunchConfig = DEFAULT_WRITE_CONFIG,
    jitter: Optional[KernelJitter] = None,
) -> None:
    """Triton twin of ``launch_canary_write_kernel_torch_reference`` (same bytes; violation rows
    of different requests may land in another order in parallel mode).

    A launch whose lazy checks would fail (canary stride, input-assert tensors, narrow rows: all
    known from shapes) runs the torch twin, which bumps the kernel counter and raises only when
    there is work; under CUDA-graph capture that needs a host read, so the error is raised at once.
    ``jitter``: seeded stalls (docs/design.md §3.11); None compiles the kernels without them.
    """
    launch_write_many(
        contexts=(context,), plan=plan, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        enable_write_input_assert=enable_write_input_assert, expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions, config=config, jitter=jitter,
    )


def launch_write_many(
    *,
    contexts: Sequence[VerifyOrWriteContext],
    plan: WritePlan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: Optional[torch.Tensor],
    expected_input_positions: Optional[torch.Tensor],
    config: WriteLaunchConfig = DEFAULT_WRITE_CONFIG,
    jitter: Optional[KernelJitter] = None,
) -> tuple[int, ...]:
    """``launch_write`` for each context in order, on the same entries. Small launches (decode batches) write
    two contexts per single-CTA launch where both can take the kernel, their buffers have as many rows and
    differ, and their rings differ (the same bytes, counters and rings as one launch per context). Returns the
    number of contexts of each launch, in order: a single-CTA launch (one or two), or a prepare + chain pair
    (always one); contexts that ran the torch twin are not counted."""
    inputs = dict(input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                  enable_write_input_assert=enable_write_input_assert, expected_input_tokens=expected_input_tokens,
                  expected_input_positions=expected_input_positions)
    assert_args = (bool(enable_write_input_assert), expected_input_tokens, expected_input_positions)
    if _small(plan, out_cache_loc, config):
        pairable, launch = _pairable, lambda ctxs, srcs: _launch_small(ctxs, srcs, plan, inputs, config, jitter)
    else:  # the two-kernel path takes one context per launch pair
        pairable, launch = (lambda a, b: False), lambda ctxs, srcs: _launch_two_kernels(
            ctxs[0], srcs[0], plan, inputs, config, jitter)
    return launch_in_pairs(contexts, sources=lambda ctx: _kernel_sources(ctx, assert_args), pairable=pairable,
                           launch=launch, alone=lambda ctx: _launch_twin(ctx, assert_args, plan, inputs, jitter))


def _pairable(a: VerifyOrWriteContext, b: VerifyOrWriteContext) -> bool:
    """Two contexts one small launch may write: other buffers of as many rows, other rings."""
    return (a.canary_buf.shape[0] == b.canary_buf.shape[0]
            and a.canary_buf.data_ptr() != b.canary_buf.data_ptr()
            and a.violation_ring.data_ptr() != b.violation_ring.data_ptr()
            and a.violation_write_index.data_ptr() != b.violation_write_index.data_ptr())
