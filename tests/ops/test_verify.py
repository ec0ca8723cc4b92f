"""Hand cases for the verify op (docs/design.md §3.7), on the twin and on the public launcher."""
from __future__ import annotations

import pytest
import torch

from kvcanary.ops import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    CanaryLaunchTag,
    FailReason,
    RealKvHashMode,
    RealKvSource,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel_torch_reference,
)

from . import oracle
from .oracle import H0, mix3, s64

VERIFIES = pytest.mark.parametrize(
    "verify", [launch_canary_verify_kernel_torch_reference, launch_canary_verify_kernel], ids=["twin", "launcher"]
)
CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
POS = int(FailReason.VERIFY_POSITION_MISMATCH)
KV = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
TOK = int(FailReason.VERIFY_TOKEN_MISMATCH)
KIND = int(CanaryLaunchTag.TAIL_K_FULL)


def put(ctx, slot, token, position, prev_hash, kv=0):
    f = ctx.canary_buf.view(torch.int64)
    f[slot, CANARY_FIELD_TOKEN] = token
    f[slot, CANARY_FIELD_POSITION] = position
    f[slot, CANARY_FIELD_PREV_HASH] = s64(prev_hash)
    f[slot, CANARY_FIELD_REAL_KV_HASH] = s64(kv)


def put_chain(ctx, slots, tokens, positions, start=H0):
    """Hand-write a clean chain (independent of the write op); returns each slot's prev_hash."""
    h = start
    out = []
    for s, t, p in zip(slots, tokens, positions):
        put(ctx, s, t, p, h)
        out.append(s64(h))
        h = mix3(h, t, p)
    return out


def rows(ctx):
    n = min(int(ctx.violation_write_index[0]), ctx.violation_ring.shape[0])
    return [list(map(int, r)) for r in ctx.violation_ring[:n].tolist()]


def snapshot(*tensors):
    return [t.clone() for t in tensors]


def plan_tensors(plan):
    return [plan.verify_slot_indices, plan.verify_expected_tokens, plan.verify_expected_positions,
            plan.verify_prev_slot_indices, plan.verify_num_valid, plan.enable]


SLOTS = [5, 9, 3, 12]
TOKENS = [10, 20, 30, 40]
POSITIONS = [0, 1, 2, 3]
PREVS = [-1, 5, 9, 3]


@VERIFIES
def test_chain_head_clean_and_any_negative_prev_is_head(verify, make_context, make_verify_plan):
    ctx = make_context()
    put(ctx, 5, 10, 0, H0)
    put(ctx, 6, 11, 0, H0)
    verify(context=ctx, plan=make_verify_plan([5, 6], [0, 0], [-1, -7]), check_verify_expected_token=False)
    assert rows(ctx) == [] and int(ctx.violation_write_index[0]) == 0
    assert int(ctx.slot_run_counter[0]) == 2 and int(ctx.kernel_run_counter[0]) == 1


@VERIFIES
def test_chain_head_with_wrong_prev_hash(verify, make_context, make_verify_plan):
    ctx = make_context()
    put(ctx, 5, 10, 0, 0x1234)
    verify(context=ctx, plan=make_verify_plan([5], [0], [-1]), check_verify_expected_token=False)
    assert rows(ctx) == [[KIND, 5, 0, 10, -1, 0x1234, s64(H0), CHAIN]]


@VERIFIES
def test_multi_step_chain_written_then_verified_clean(verify, make_context, make_write_plan, make_verify_plan):
    ctx = make_context(num_slots=32, chain_assert=1)
    write = launch_canary_write_kernel_torch_reference
    slots = [4, 17, 2, 9, 30, 11]
    toks = [101, 102, 103, 104, 105, 106]
    # prefill of 3, chunked prefill of 2, one decode step
    for lo, hi, seed in [(0, 3, -1), (3, 5, 2), (5, 6, 30)]:
        write(
            context=ctx, plan=make_write_plan([hi - lo], [seed]),
            input_ids=torch.tensor(toks[lo:hi]), positions=torch.arange(lo, hi),
            out_cache_loc=torch.tensor(slots[lo:hi]),
            enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
        )
    want = put_chain(make_context(num_slots=32), slots, toks, range(6))
    f = ctx.canary_buf.view(torch.int64)
    assert [int(f[s, CANARY_FIELD_PREV_HASH]) for s in slots] == want
    plan = make_verify_plan(slots, list(range(6)), [-1] + slots[:-1], toks)
    verify(context=ctx, plan=plan, check_verify_expected_token=True)
    assert rows(ctx) == [] and int(ctx.violation_write_index[0]) == 0
    assert int(ctx.kernel_run_counter[0]) == 4 and int(ctx.slot_run_counter[0]) == 12


@VERIFIES
@pytest.mark.parametrize("field, value", [(CANARY_FIELD_TOKEN, 77), (CANARY_FIELD_POSITION, 55)])
def test_corrupting_token_or_position_flags_chain_on_next_slot(verify, field, value, make_context, make_verify_plan):
    ctx = make_context()
    prev_hashes = put_chain(ctx, SLOTS, TOKENS, POSITIONS)
    ctx.canary_buf.view(torch.int64)[9, field] = value  # entry 1
    tok1 = value if field == CANARY_FIELD_TOKEN else 20
    pos1 = value if field == CANARY_FIELD_POSITION else 1
    verify(context=ctx, plan=make_verify_plan(SLOTS, POSITIONS, PREVS, TOKENS), check_verify_expected_token=False)
    want = []
    if field == CANARY_FIELD_POSITION:
        want.append([KIND, 9, 55, 20, -1, prev_hashes[1], prev_hashes[1], POS])
    want.append([KIND, 3, 2, 30, -1, prev_hashes[2], s64(mix3(prev_hashes[1], tok1, pos1)), CHAIN])
    assert rows(ctx) == want
    assert int(ctx.violation_write_index[0]) == len(want)


@VERIFIES
def test_corrupting_token_with_token_check_flags_slot_and_next(verify, make_context, make_verify_plan):
    ctx = make_context()
    ph = put_chain(ctx, SLOTS, TOKENS, POSITIONS)
    ctx.canary_buf.view(torch.int64)[9, CANARY_FIELD_TOKEN] = 77
    verify(context=ctx, plan=make_verify_plan(SLOTS, POSITIONS, PREVS, TOKENS), check_verify_expected_token=True)
    assert rows(ctx) == [
        [KIND, 9, 1, 77, 20, ph[1], ph[1], TOK],
        [KIND, 3, 2, 30, 30, ph[2], s64(mix3(ph[1], 77, 1)), CHAIN],
    ]


@VERIFIES
def test_corrupting_prev_hash_flags_the_slot_itself(verify, make_context, make_verify_plan):
    ctx = make_context()
    ph = put_chain(ctx, SLOTS, TOKENS, POSITIONS)
    ctx.canary_buf.view(torch.int64)[12, CANARY_FIELD_PREV_HASH] = 99  # last entry: only itself
    verify(context=ctx, plan=make_verify_plan(SLOTS, POSITIONS, PREVS, TOKENS), check_verify_expected_token=True)
    assert rows(ctx) == [[KIND, 12, 3, 40, 40, 99, ph[3], CHAIN]]


@VERIFIES
def test_corrupting_middle_prev_hash_flags_it_and_its_successor(verify, make_context, make_verify_plan):
    ctx = make_context()
    ph = put_chain(ctx, SLOTS, TOKENS, POSITIONS)
    ctx.canary_buf.view(torch.int64)[9, CANARY_FIELD_PREV_HASH] = -99
    verify(context=ctx, plan=make_verify_plan(SLOTS, POSITIONS, PREVS), check_verify_expected_token=False)
    assert rows(ctx) == [
        [KIND, 9, 1, 20, -1, -99, ph[1], CHAIN],
        [KIND, 3, 2, 30, -1, ph[2], s64(mix3(-99, 20, 1)), CHAIN],
    ]


@VERIFIES
def test_position_mismatch(verify, make_context, make_verify_plan):
    ctx = make_context()
    ph = put_chain(ctx, SLOTS, TOKENS, POSITIONS)
    verify(context=ctx, plan=make_verify_plan(SLOTS, [0, 1, 5, 3], PREVS), check_verify_expected_token=False)
    assert rows(ctx) == [[KIND, 3, 2, 30, -1, ph[2], ph[2], POS]]


@VERIFIES
def test_token_check_on_off_and_sentinel(verify, make_context, make_verify_plan):
    ctx = make_context()
    ph = put_chain(ctx, SLOTS, TOKENS, POSITIONS)
    expected = [10, 21, -1, 41]  # entry 2: sentinel (no expectation) though stored 30
    verify(context=ctx, plan=make_verify_plan(SLOTS, POSITIONS, PREVS, expected), check_verify_expected_token=True)
    assert rows(ctx) == [
        [KIND, 9, 1, 20, 21, ph[1], ph[1], TOK],
        [KIND, 12, 3, 40, 41, ph[3], ph[3], TOK],
    ]
    ctx2 = make_context()
    put_chain(ctx2, SLOTS, TOKENS, POSITIONS)
    verify(context=ctx2, plan=make_verify_plan(SLOTS, POSITIONS, PREVS, expected), check_verify_expected_token=False)
    assert rows(ctx2) == [] and int(ctx2.violation_write_index[0]) == 0


@VERIFIES
def test_token_check_off_reports_minus_one_expected(verify, make_context, make_verify_plan):
    ctx = make_context()
    put(ctx, 5, 10, 0, H0)
    verify(context=ctx, plan=make_verify_plan([5], [3], [-1], [999]), check_verify_expected_token=False)
    assert rows(ctx) == [[KIND, 5, 0, 10, -1, s64(H0), s64(H0), POS]]


@VERIFIES
def test_slot_zero_skipped_but_counted(verify, make_context, make_verify_plan):
    ctx = make_context(slot_count=40, kernel_count=7)
    put(ctx, 0, 1, 2, 3, 4)  # garbage in the padding slot
    put(ctx, 5, 10, 0, H0)
    verify(context=ctx, plan=make_verify_plan([0, 5, 0], [9, 0, 9], [-1, -1, 0]), check_verify_expected_token=False)
    assert rows(ctx) == []
    assert int(ctx.slot_run_counter[0]) == 43 and int(ctx.kernel_run_counter[0]) == 8


@VERIFIES
def test_only_padding_entries_counted_no_rows(verify, make_context, make_verify_plan):
    ctx = make_context()
    put(ctx, 0, 1, 2, 3, 4)
    verify(context=ctx, plan=make_verify_plan([0, 0], [5, 5], [-1, 3]), check_verify_expected_token=True)
    assert int(ctx.violation_write_index[0]) == 0
    assert int(ctx.slot_run_counter[0]) == 2 and int(ctx.kernel_run_counter[0]) == 1


@VERIFIES
def test_prev_zero_skips_only_the_chain_check(verify, make_context, make_verify_plan):
    ctx = make_context()
    put(ctx, 5, 10, 4, 0xABCDEF)  # prev_hash garbage, but predecessor unreachable
    put(ctx, 0, 11, 3, 0x77)
    verify(context=ctx, plan=make_verify_plan([5], [4], [0]), check_verify_expected_token=False)
    assert rows(ctx) == []
    verify(context=ctx, plan=make_verify_plan([5], [6], [0], [11]), check_verify_expected_token=True)
    # expected_chain is the stored prev_hash when the predecessor is unreachable
    assert rows(ctx) == [[KIND, 5, 4, 10, 11, 0xABCDEF, 0xABCDEF, POS | TOK]]


@VERIFIES
def test_prev_slot_zero_is_not_hashed_even_if_matching(verify, make_context, make_verify_plan):
    ctx = make_context()
    put(ctx, 0, 11, 3, 0x77)
    put(ctx, 5, 10, 4, mix3(0x77, 11, 3))  # would match slot 0's hash; still not checked
    put(ctx, 6, 10, 4, 1)
    verify(context=ctx, plan=make_verify_plan([5, 6], [4, 4], [0, 0]), check_verify_expected_token=False)
    assert rows(ctx) == []


@VERIFIES
def test_ring_overflow_keeps_counting(verify, make_context, make_verify_plan):
    ctx = make_context(ring_capacity=3, write_index=1)
    for s in range(1, 6):
        put(ctx, s, s, 0, H0)
    plan = make_verify_plan([1, 2, 3, 4, 5], [1, 1, 1, 1, 1], [-1] * 5)
    verify(context=ctx, plan=plan, check_verify_expected_token=False)
    ring = [list(map(int, r)) for r in ctx.violation_ring.tolist()]
    assert ring[0] == [-77] * 8  # rows before the base are untouched
    assert ring[1] == [KIND, 1, 0, 1, -1, s64(H0), s64(H0), POS]
    assert ring[2] == [KIND, 2, 0, 2, -1, s64(H0), s64(H0), POS]
    assert int(ctx.violation_write_index[0]) == 6
    before = ctx.violation_ring.clone()
    verify(context=ctx, plan=plan, check_verify_expected_token=False)
    assert torch.equal(ctx.violation_ring, before)
    assert int(ctx.violation_write_index[0]) == 11
    assert int(ctx.slot_run_counter[0]) == 10 and int(ctx.kernel_run_counter[0]) == 2


@VERIFIES
def test_enable_zero_only_counts_the_launch(verify, make_context, make_verify_plan):
    ctx = make_context(slot_count=3)
    put(ctx, 5, 10, 0, 1)
    buf = ctx.canary_buf.clone()
    verify(context=ctx, plan=make_verify_plan([5], [7], [-1], enable=0), check_verify_expected_token=True)
    assert int(ctx.kernel_run_counter[0]) == 1 and int(ctx.slot_run_counter[0]) == 3
    assert int(ctx.violation_write_index[0]) == 0 and torch.equal(ctx.canary_buf, buf)
    verify(context=ctx, plan=make_verify_plan([5], [7], [-1], enable=-3), check_verify_expected_token=True)
    assert int(ctx.violation_write_index[0]) == 1 and int(ctx.slot_run_counter[0]) == 4


@VERIFIES
@pytest.mark.parametrize("num_valid, active", [(2, 2), (0, 0), (-4, 0), (9, 3)])
def test_num_valid_is_clamped_to_capacity(verify, num_valid, active, make_context, make_verify_plan):
    ctx = make_context()
    for s in (5, 6, 7):
        put(ctx, s, 1, 0, H0)
    verify(context=ctx, plan=make_verify_plan([5, 6, 7], [1, 1, 1], [-1] * 3, num_valid=num_valid),
           check_verify_expected_token=False)
    assert int(ctx.slot_run_counter[0]) == active
    assert [r[1] for r in rows(ctx)] == [5, 6, 7][:active]


@VERIFIES
def test_empty_plan(verify, make_context):
    from kvcanary.ops import VerifyPlan
    ctx = make_context(slot_count=5)
    plan = VerifyPlan.allocate(4, "cpu")
    verify(context=ctx, plan=plan, check_verify_expected_token=True)
    assert int(ctx.kernel_run_counter[0]) == 1 and int(ctx.slot_run_counter[0]) == 5
    assert int(ctx.violation_write_index[0]) == 0


@VERIFIES
def test_kernel_kind_as_int_and_stride_past_32(verify, make_context, make_verify_plan):
    ctx = make_context(kind=int(CanaryLaunchTag.SWEEP_V_SWA), stride_bytes=48, fill="random")
    put(ctx, 5, 10, 0, 7)
    tail = ctx.canary_buf[:, 32:].clone()
    verify(context=ctx, plan=make_verify_plan([5], [0], [-1]), check_verify_expected_token=False)
    assert rows(ctx) == [[11, 5, 0, 10, -1, 7, s64(H0), CHAIN]]
    assert torch.equal(ctx.canary_buf[:, 32:], tail)


@VERIFIES
def test_outputs_are_views_updated_in_place_nothing_else_touched(verify, make_verify_plan):
    from kvcanary.ops import VerifyOrWriteContext
    big_buf = torch.zeros(40, 32, dtype=torch.uint8)
    buf = big_buf[4:36]
    big_ring = torch.full((10, 8), -5, dtype=torch.int64)
    idx_all = torch.tensor([3, 1, 4], dtype=torch.int32)
    slot_counts = torch.arange(12, dtype=torch.int64) * 10
    kernel_counts = torch.arange(12, dtype=torch.int64) * 100
    ctx = VerifyOrWriteContext(
        canary_buf=buf, kernel_kind=CanaryLaunchTag.HEAD_V_FULL, violation_ring=big_ring[2:6],
        violation_write_index=idx_all[1:2], slot_run_counter=slot_counts[1:2], kernel_run_counter=kernel_counts[1:2],
        real_kv_sources=(), real_kv_hash_mode=RealKvHashMode.NONE,
        enable_chain_position_assert=torch.tensor([1], dtype=torch.int32),
    )
    put(ctx, 5, 10, 0, 1)
    big_before = big_buf.clone()
    plan = make_verify_plan([5, 0], [0, 0], [-1, -1], [3, 3])
    plan_before = snapshot(*plan_tensors(plan))
    verify(context=ctx, plan=plan, check_verify_expected_token=True)
    assert big_ring[:3].eq(-5).all() and big_ring[4:].eq(-5).all()
    assert big_ring[3].tolist() == [1, 5, 0, 10, 3, 1, s64(H0), CHAIN | TOK]
    assert idx_all.tolist() == [3, 2, 4]
    assert slot_counts.tolist() == [0, 12] + [i * 10 for i in range(2, 12)]
    assert kernel_counts.tolist() == [0, 101] + [i * 100 for i in range(2, 12)]
    assert torch.equal(big_buf, big_before)
    for a, b in zip(plan_tensors(plan), plan_before):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------- real KV
def _hashed_context(make_context, make_source, gen, *, mode, n_sources, page_size, row_pad=0, stride_pad=0,
                    dtype=torch.uint8, nbpt=32, inner_shape=None, num_slots=40):
    sources = [
        make_source(num_slots=num_slots, page_size=page_size, num_bytes_per_token=nbpt, dtype=dtype,
                    row_pad_bytes=row_pad, stride_pad_bytes=stride_pad, inner_shape=inner_shape, generator=gen)
        for _ in range(n_sources)
    ]
    ctx = make_context(num_slots=num_slots, sources=sources, mode=mode)
    return ctx, sources


def _store_true_fingerprints(ctx, slots):
    st = oracle.OracleCanary.of(ctx)
    for s in slots:
        put(ctx, s, s, 0, H0, oracle.fingerprint(st.sources, st.mode, s) & ((1 << 64) - 1))


def _flip(src: RealKvSource, slot: int, byte: int):
    """Flip one bit in byte ``byte`` of ``slot``'s strip (logical addressing, in place)."""
    rowmat = src.tensor[slot // src.page_size].reshape(-1).view(torch.uint8)
    col = (slot % src.page_size) * src.num_bytes_per_token + byte
    rowmat[col] ^= 0x10


@VERIFIES
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL, RealKvHashMode.LANES])
@pytest.mark.parametrize("n_sources", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_real_kv_clean_then_flip_detected(verify, mode, n_sources, page_size, make_context, make_source, gen, make_verify_plan):
    ctx, sources = _hashed_context(make_context, make_source, gen, mode=mode, n_sources=n_sources, page_size=page_size)
    slots = [1, 5, 17, 33]
    _store_true_fingerprints(ctx, slots)
    plan = make_verify_plan(slots, [0] * 4, [-1] * 4)
    verify(context=ctx, plan=plan, check_verify_expected_token=False)
    assert int(ctx.violation_write_index[0]) == 0
    _flip(sources[-1], 17, 3)  # inside the first 16 bytes: caught in every mode
    verify(context=ctx, plan=plan, check_verify_expected_token=False)
    stored_kv = int(ctx.canary_buf.view(torch.int64)[17, CANARY_FIELD_REAL_KV_HASH])
    assert rows(ctx) == [[KIND, 17, 0, 17, -1, s64(H0), s64(H0), KV]]
    assert stored_kv != 0


@VERIFIES
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(
    "layout", [dict(), dict(row_pad=48), dict(stride_pad=32), dict(row_pad=16, stride_pad=16, dtype=torch.bfloat16),
               dict(dtype=torch.float32, inner_shape=(2, -1)), dict(stride_pad=64, dtype=torch.float16, inner_shape=(4, -1))],
    ids=["dense", "rowpad", "strided", "pad+stride-bf16", "3d-f32", "3d-strided-f16"],
)
def test_flip_past_byte_16_missed_in_partial_caught_in_all(verify, page_size, layout, make_context, make_source, gen, make_verify_plan):
    found = {}
    for mode in (RealKvHashMode.PARTIAL, RealKvHashMode.ALL, RealKvHashMode.LANES):
        g = torch.Generator().manual_seed(7)
        ctx, sources = _hashed_context(make_context, make_source, g, mode=mode, n_sources=2, page_size=page_size, **layout)
        slots = [2, 3, 21]
        _store_true_fingerprints(ctx, slots)
        _flip(sources[0], 3, 20)  # past byte 16 of slot 3's strip (strip is 32 bytes)
        if layout.get("row_pad"):
            rowmat = sources[1].tensor[21 // page_size].reshape(-1).view(torch.uint8)
            rowmat[page_size * 32] ^= 0xFF  # a padding byte past the strips: never hashed
        verify(context=ctx, plan=make_verify_plan(slots, [0] * 3, [-1] * 3), check_verify_expected_token=False)
        found[mode] = [r[1] for r in rows(ctx)]
        if mode != RealKvHashMode.PARTIAL:
            assert rows(ctx)[0][7] == KV
    assert found == {RealKvHashMode.PARTIAL: [], RealKvHashMode.ALL: [3], RealKvHashMode.LANES: [3]}


@VERIFIES
@pytest.mark.parametrize("mode, flip_byte, caught", [
    (RealKvHashMode.PARTIAL, 20, False), (RealKvHashMode.ALL, 20, True),
    (RealKvHashMode.ALL, 40, False), (RealKvHashMode.PARTIAL, 15, True), (RealKvHashMode.ALL, 0, True),
    (RealKvHashMode.LANES, 20, True), (RealKvHashMode.LANES, 40, False), (RealKvHashMode.LANES, 31, True),
])
def test_partial_ignores_read_bytes_all_stops_at_read_bytes(verify, mode, flip_byte, caught, make_context, make_verify_plan):
    raw = torch.randint(0, 256, (8, 64), dtype=torch.uint8)
    src = RealKvSource(tensor=raw, page_size=1, num_bytes_per_token=64, read_bytes=32)
    ctx = make_context(num_slots=8, sources=[src], mode=mode)
    _store_true_fingerprints(ctx, [6])
    raw[6, flip_byte] ^= 1
    verify(context=ctx, plan=make_verify_plan([6], [0], [-1]), check_verify_expected_token=False)
    assert [r[1] for r in rows(ctx)] == ([6] if caught else [])


@VERIFIES
def test_none_mode_expects_zero_and_never_reads_sources(verify, make_context, make_verify_plan):
    # a source too narrow for its layout would raise if inspected; NONE mode never looks at it
    narrow = RealKvSource(tensor=torch.zeros(2, 16, dtype=torch.uint8), page_size=4, num_bytes_per_token=16, read_bytes=16)
    ctx = make_context(sources=[narrow], mode=RealKvHashMode.NONE)
    put(ctx, 5, 10, 0, H0, 0)
    put(ctx, 6, 10, 0, H0, 0x55)
    verify(context=ctx, plan=make_verify_plan([5, 6], [0, 0], [-1, -1]), check_verify_expected_token=False)
    assert rows(ctx) == [[KIND, 6, 0, 10, -1, s64(H0), s64(H0), KV]]


@VERIFIES
def test_hash_mode_without_sources_expects_zero(verify, make_context, make_verify_plan):
    ctx = make_context(sources=[], mode=RealKvHashMode.ALL)
    put(ctx, 5, 10, 0, H0, 0)
    put(ctx, 6, 10, 0, H0, 3)
    verify(context=ctx, plan=make_verify_plan([5, 6], [0, 0], [-1, -1]), check_verify_expected_token=False)
    assert [r[1] for r in rows(ctx)] == [6]


@VERIFIES
def test_source_order_matters(verify, make_context, make_source, gen, make_verify_plan):
    a = make_source(num_slots=8, generator=gen)
    b = make_source(num_slots=8, generator=gen)
    ctx = make_context(num_slots=8, sources=[a, b], mode=RealKvHashMode.PARTIAL)
    _store_true_fingerprints(ctx, [3])
    ctx_swapped = make_context(num_slots=8, sources=[b, a], mode=RealKvHashMode.PARTIAL)
    ctx_swapped.canary_buf.copy_(ctx.canary_buf)
    plan = make_verify_plan([3], [0], [-1])
    verify(context=ctx, plan=plan, check_verify_expected_token=False)
    verify(context=ctx_swapped, plan=plan, check_verify_expected_token=False)
    assert int(ctx.violation_write_index[0]) == 0 and [r[7] for r in rows(ctx_swapped)] == [KV]


@VERIFIES
def test_verify_never_writes_buffer_or_sources(verify, make_context, make_source, gen, make_verify_plan):
    ctx, sources = _hashed_context(make_context, make_source, gen, mode=RealKvHashMode.ALL, n_sources=2, page_size=4)
    ctx.canary_buf.copy_(torch.randint(0, 256, ctx.canary_buf.shape, dtype=torch.uint8, generator=gen))
    buf = ctx.canary_buf.clone()
    srcs = [s.tensor.clone() for s in sources]
    verify(context=ctx, plan=make_verify_plan([1, 2, 3], [0, 1, 2], [-1, 1, 2]), check_verify_expected_token=True)
    assert torch.equal(ctx.canary_buf, buf)
    assert all(torch.equal(s.tensor, c) for s, c in zip(sources, srcs))
    assert int(ctx.violation_write_index[0]) == 3


def _odd_layouts():
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 256, (20, 2, 48), dtype=torch.uint8, generator=g)
    yield "gapped-inner-dims", RealKvSource(tensor=base[:, :, :32], page_size=2, num_bytes_per_token=32, read_bytes=32)
    flat = torch.randint(0, 256, (20, 80), dtype=torch.uint8, generator=g)
    yield "column-offset-view", RealKvSource(tensor=flat[:, 4:68], page_size=4, num_bytes_per_token=16, read_bytes=16)
    f32 = torch.randint(0, 256, (20, 160), dtype=torch.uint8, generator=g).view(torch.float32)
    yield "f32-offset-4d", RealKvSource(tensor=f32[:, 2:34].reshape(20, 2, 2, 8), page_size=1, num_bytes_per_token=128,
                                        read_bytes=64)
    yield "row-slice", RealKvSource(tensor=flat[3:15, :64], page_size=4, num_bytes_per_token=16, read_bytes=16)


@pytest.mark.parametrize("name, src", list(_odd_layouts()), ids=[n for n, _ in _odd_layouts()])
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL, RealKvHashMode.LANES])
def test_fingerprint_logical_addressing_matches_oracle(name, src, mode, make_context, make_write_plan, make_verify_plan):
    n_slots = src.tensor.shape[0] * src.page_size
    ctx = make_context(num_slots=n_slots, sources=[src], mode=mode)
    st = oracle.OracleCanary.of(ctx)
    slots = list(range(1, n_slots))
    launch_canary_write_kernel_torch_reference(
        context=ctx, plan=make_write_plan([len(slots)], [-1]), input_ids=torch.tensor(slots),
        positions=torch.arange(len(slots)), out_cache_loc=torch.tensor(slots), enable_write_input_assert=False,
        expected_input_tokens=None, expected_input_positions=None)
    got = ctx.canary_buf.view(torch.int64)[1:, CANARY_FIELD_REAL_KV_HASH].tolist()
    assert got == [oracle.fingerprint(st.sources, mode, s) for s in slots]
    assert len(set(got)) == len(got)
    launch_canary_verify_kernel(context=ctx, plan=make_verify_plan(slots, list(range(len(slots))), [-1] + slots[:-1]),
                                check_verify_expected_token=False)
    assert int(ctx.violation_write_index[0]) == 0


def test_twins_accept_a_column_view_buffer(make_write_plan, make_verify_plan):
    from kvcanary.ops import VerifyOrWriteContext
    big = torch.randint(0, 256, (12, 64), dtype=torch.uint8)
    before = big.clone()
    ctx = VerifyOrWriteContext(
        canary_buf=big[:, 8:48], kernel_kind=0, violation_ring=torch.zeros(2, 8, dtype=torch.int64),
        violation_write_index=torch.zeros(1, dtype=torch.int32), slot_run_counter=torch.zeros(1, dtype=torch.int64),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64), real_kv_sources=(), real_kv_hash_mode=0,
        enable_chain_position_assert=torch.zeros(1, dtype=torch.int32))
    launch_canary_write_kernel_torch_reference(
        context=ctx, plan=make_write_plan([2], [-1]), input_ids=torch.tensor([10, 20]), positions=torch.tensor([0, 1]),
        out_cache_loc=torch.tensor([3, 7]), enable_write_input_assert=False, expected_input_tokens=None,
        expected_input_positions=None)
    changed = big != before
    assert changed[:, :8].sum() == 0 and changed[:, 40:].sum() == 0
    assert set(changed.any(dim=1).nonzero().flatten().tolist()) <= {3, 7}
    assert big[7, 8:40].view(torch.int64).tolist() == [20, 1, s64(mix3(H0, 10, 0)), 0]
    launch_canary_verify_kernel_torch_reference(context=ctx, plan=make_verify_plan([3, 7], [0, 1], [-1, 3]),
                                                check_verify_expected_token=False)
    assert int(ctx.violation_write_index[0]) == 0 and int(ctx.slot_run_counter[0]) == 4


@VERIFIES
def test_ring_and_index_shared_between_contexts(verify, make_verify_plan):
    from kvcanary.ops import VerifyOrWriteContext
    buf = torch.zeros(8, 32, dtype=torch.uint8)
    ring = torch.full((4, 8), -1, dtype=torch.int64)
    index = torch.zeros(1, dtype=torch.int32)
    counters = torch.zeros(2, 12, dtype=torch.int64)

    def ctx_for(tag):
        return VerifyOrWriteContext(
            canary_buf=buf, kernel_kind=tag, violation_ring=ring, violation_write_index=index,
            slot_run_counter=counters[0, tag:tag + 1], kernel_run_counter=counters[1, tag:tag + 1],
            real_kv_sources=(), real_kv_hash_mode=RealKvHashMode.NONE,
            enable_chain_position_assert=torch.zeros(1, dtype=torch.int32))

    plan = make_verify_plan([5], [1], [-1])  # slot 5 holds zeros: H0 and position mismatch
    verify(context=ctx_for(CanaryLaunchTag.HEAD_K_FULL), plan=plan, check_verify_expected_token=False)
    verify(context=ctx_for(CanaryLaunchTag.HEAD_V_FULL), plan=plan, check_verify_expected_token=False)
    assert index.tolist() == [2]
    assert ring[:2, 0].tolist() == [0, 1] and ring[:2, 7].tolist() == [CHAIN | POS] * 2
    assert counters[:, :2].tolist() == [[1, 1], [1, 1]] and counters[:, 2:].eq(0).all()
