"""Hand cases for the write op (docs/design.md §3.6), on the twin and on the public launcher."""
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
    VerifyOrWriteContext,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
)

from . import oracle
from .oracle import H0, mix3, s64

WRITES = pytest.mark.parametrize(
    "write", [launch_canary_write_kernel_torch_reference, launch_canary_write_kernel], ids=["twin", "launcher"]
)
WTOK = int(FailReason.WRITE_TOKEN_MISMATCH)
WPOS = int(FailReason.WRITE_POSITION_MISMATCH)
KIND = int(CanaryLaunchTag.TAIL_K_FULL)
CHAIN_10_20_30 = [s64(0xDE7FAE23A9A1B716), s64(0xCD6D3FC64AB68B75), s64(0x2C17D4BB20B967A5)]


def run(write, ctx, plan, ids, pos, loc, *, dtype=torch.int64, assert_tokens=None, assert_positions=None):
    on = assert_tokens is not None
    write(
        context=ctx, plan=plan,
        input_ids=torch.tensor(ids, dtype=dtype), positions=torch.tensor(pos, dtype=dtype),
        out_cache_loc=torch.tensor(loc, dtype=dtype), enable_write_input_assert=on,
        expected_input_tokens=torch.tensor(assert_tokens, dtype=dtype) if on else None,
        expected_input_positions=torch.tensor(assert_positions, dtype=dtype) if on else None,
    )


def record(ctx, slot):
    f = ctx.canary_buf.view(torch.int64)[slot]
    return [int(f[CANARY_FIELD_TOKEN]), int(f[CANARY_FIELD_POSITION]), int(f[CANARY_FIELD_PREV_HASH]),
            int(f[CANARY_FIELD_REAL_KV_HASH])]


def rows(ctx):
    n = min(int(ctx.violation_write_index[0]), ctx.violation_ring.shape[0])
    return [list(map(int, r)) for r in ctx.violation_ring[:n].tolist()]


@WRITES
def test_chain_head_stores_h0(write, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([1], [-1]), [10], [0], [6])
    assert record(ctx, 6) == [10, 0, s64(H0), 0]
    assert int(ctx.slot_run_counter[0]) == 1 and int(ctx.kernel_run_counter[0]) == 1


@WRITES
@pytest.mark.parametrize("seed", [-1, -9])
def test_any_negative_seed_is_chain_head(write, seed, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([3], [seed]), [10, 20, 30], [0, 1, 2], [5, 2, 7])
    assert [record(ctx, s)[2] for s in (5, 2, 7)] == CHAIN_10_20_30


@WRITES
def test_multi_step_chain_continues_from_seed(write, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([2], [-1]), [10, 20], [0, 1], [5, 2])
    run(write, ctx, make_write_plan([1], [2]), [30], [2], [7])
    assert [record(ctx, s) for s in (5, 2, 7)] == [[10, 0, CHAIN_10_20_30[0], 0], [20, 1, CHAIN_10_20_30[1], 0],
                                                   [30, 2, CHAIN_10_20_30[2], 0]]
    assert int(ctx.slot_run_counter[0]) == 3 and int(ctx.kernel_run_counter[0]) == 2


@WRITES
def test_negative_slots_skipped_not_counted_not_chained(write, make_context, make_write_plan):
    ctx = make_context(fill="random")
    before = ctx.canary_buf.clone()
    run(write, ctx, make_write_plan([5], [-1]), [10, 99, 20, 98, 30], [0, 7, 1, 8, 2], [5, -1, 2, -3, 7])
    assert [record(ctx, s)[2] for s in (5, 2, 7)] == CHAIN_10_20_30
    assert int(ctx.slot_run_counter[0]) == 3
    untouched = [s for s in range(32) if s not in (5, 2, 7)]
    assert torch.equal(ctx.canary_buf[untouched], before[untouched])
    assert torch.equal(ctx.canary_buf[:, 32:], before[:, 32:])


@WRITES
def test_negative_slot_not_tracked_by_chain_position_assert(write, make_context, make_write_plan):
    ctx = make_context(chain_assert=1)
    run(write, ctx, make_write_plan([1], [-1]), [10], [0], [5])
    run(write, ctx, make_write_plan([3], [5]), [20, 21, 30], [1, 9, 2], [2, -1, 7])
    assert rows(ctx) == []


@WRITES
def test_slot_zero_is_written_and_counted_and_seed_zero_chains(write, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([2], [-1]), [10, 20], [0, 1], [3, 0])
    assert record(ctx, 0) == [20, 1, CHAIN_10_20_30[1], 0]
    assert int(ctx.slot_run_counter[0]) == 2
    run(write, ctx, make_write_plan([1], [0]), [30], [2], [9])
    assert record(ctx, 9) == [30, 2, CHAIN_10_20_30[2], 0]


@WRITES
def test_multiple_requests_in_batch_order(write, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([2, 1, 0, 2], [-1, -1, -1, -1]), [10, 20, 10, 7, 8], [0, 1, 0, 0, 1],
        [5, 2, 3, 8, 9])
    assert [record(ctx, s)[2] for s in (5, 2, 3, 8, 9)] == [
        CHAIN_10_20_30[0], CHAIN_10_20_30[1], CHAIN_10_20_30[0], s64(H0), s64(mix3(H0, 7, 0))]
    assert int(ctx.slot_run_counter[0]) == 5


@WRITES
def test_slot_written_twice_keeps_last_write(write, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([3, 1], [-1, -1]), [10, 20, 30, 40], [0, 1, 2, 0], [5, 6, 5, 5])
    assert record(ctx, 5) == [40, 0, s64(H0), 0]
    assert record(ctx, 6) == [20, 1, CHAIN_10_20_30[1], 0]
    assert int(ctx.slot_run_counter[0]) == 4


@WRITES
def test_seed_written_earlier_in_the_same_launch_is_read_live(write, make_context, make_write_plan):
    ctx = make_context()
    # stale record in slot 2 that the second request must NOT chain from
    ctx.canary_buf.view(torch.int64)[2, :4] = torch.tensor([1, 2, 3, 4])
    run(write, ctx, make_write_plan([2, 1], [-1, 2]), [10, 20, 30], [0, 1, 2], [5, 2, 7])
    assert [record(ctx, s)[2] for s in (5, 2, 7)] == CHAIN_10_20_30


@WRITES
def test_seed_rewritten_later_in_launch_uses_value_at_read_time(write, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([1], [-1]), [10], [0], [5])
    # request 0 seeds from slot 5 (as stored), request 1 then overwrites slot 5, request 2 seeds from new slot 5
    run(write, ctx, make_write_plan([1, 1, 1], [5, -1, 5]), [20, 50, 60], [1, 0, 1], [2, 5, 9])
    assert record(ctx, 2) == [20, 1, CHAIN_10_20_30[1], 0]
    assert record(ctx, 5) == [50, 0, s64(H0), 0]
    assert record(ctx, 9) == [60, 1, s64(mix3(H0, 50, 0)), 0]


@WRITES
def test_input_assert_rows(write, make_context, make_write_plan):
    ctx = make_context(ring_capacity=8)
    run(write, ctx, make_write_plan([3], [-1]), [10, 20, 30], [0, 1, 2], [5, 2, 7],
        assert_tokens=[10, 21, 31], assert_positions=[0, 1, 9])
    c = CHAIN_10_20_30
    assert rows(ctx) == [
        [KIND, 2, 1, 20, 21, c[1], 1, WTOK],
        [KIND, 7, 2, 30, 31, c[2], 9, WTOK | WPOS],
    ]
    # stored regardless of the mismatch, with the actual values
    assert [record(ctx, s)[2] for s in (5, 2, 7)] == c
    assert int(ctx.slot_run_counter[0]) == 3


@WRITES
def test_input_assert_position_only(write, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([1], [-1]), [10], [0], [5], assert_tokens=[10], assert_positions=[-1])
    assert rows(ctx) == [[KIND, 5, 0, 10, 10, s64(H0), -1, WPOS]]


@WRITES
def test_chain_position_assert_rows(write, make_context, make_write_plan):
    ctx = make_context(chain_assert=1)
    run(write, ctx, make_write_plan([1], [-1]), [10], [4], [5])  # seed record at position 4
    assert rows(ctx) == []  # head request: assert inactive
    run(write, ctx, make_write_plan([3], [5]), [20, 30, 40], [5, 7, 8], [2, 7, 9])
    h2 = s64(mix3(H0, 10, 4))
    h7 = s64(mix3(h2, 20, 5))
    assert rows(ctx) == [[KIND, 7, 7, 30, 30, h7, 6, WPOS]]  # last_pos then follows the actual 7
    assert record(ctx, 9)[2] == s64(mix3(h7, 30, 7))


@WRITES
def test_chain_position_assert_first_entry_against_seed(write, make_context, make_write_plan):
    ctx = make_context(chain_assert=5)  # any non-zero value enables it
    run(write, ctx, make_write_plan([1], [-1]), [10], [0], [5])
    run(write, ctx, make_write_plan([2], [5]), [20, 30], [3, 4], [2, 7])
    h = s64(mix3(H0, 10, 0))
    assert rows(ctx) == [[KIND, 2, 3, 20, 20, h, 1, WPOS]]


@WRITES
def test_input_assert_row_before_chain_row(write, make_context, make_write_plan):
    ctx = make_context(chain_assert=1)
    run(write, ctx, make_write_plan([1], [-1]), [10], [0], [5])
    run(write, ctx, make_write_plan([2], [5]), [20, 30], [3, 4], [2, 7], assert_tokens=[21, 30], assert_positions=[3, 4])
    h = s64(mix3(H0, 10, 0))
    assert rows(ctx) == [[KIND, 2, 3, 20, 21, h, 3, WTOK], [KIND, 2, 3, 20, 20, h, 1, WPOS]]


@WRITES
def test_chain_position_assert_off_or_head(write, make_context, make_write_plan):
    ctx = make_context(chain_assert=0)
    run(write, ctx, make_write_plan([1], [-1]), [10], [0], [5])
    run(write, ctx, make_write_plan([2, 2], [5, -1]), [20, 30, 1, 2], [9, 4, 7, 3], [2, 7, 8, 9])
    assert rows(ctx) == []


@WRITES
def test_ring_overflow_keeps_counting(write, make_context, make_write_plan):
    ctx = make_context(ring_capacity=2)
    run(write, ctx, make_write_plan([3], [-1]), [1, 2, 3], [0, 1, 2], [5, 6, 7], assert_tokens=[0, 0, 0],
        assert_positions=[0, 1, 2])
    assert [r[1] for r in rows(ctx)] == [5, 6] and int(ctx.violation_write_index[0]) == 3
    ring = ctx.violation_ring.clone()
    run(write, ctx, make_write_plan([1], [-1]), [1], [0], [8], assert_tokens=[0], assert_positions=[0])
    assert torch.equal(ctx.violation_ring, ring) and int(ctx.violation_write_index[0]) == 4
    assert record(ctx, 8)[0] == 1


@WRITES
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL, RealKvHashMode.LANES])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_fingerprints_stored(write, mode, page_size, make_context, make_source, gen, make_write_plan):
    sources = [make_source(num_slots=40, page_size=page_size, num_bytes_per_token=32, generator=gen,
                           row_pad_bytes=16, stride_pad_bytes=16) for _ in range(3)]
    ctx = make_context(num_slots=40, sources=sources, mode=mode)
    st = oracle.OracleCanary.of(ctx)
    run(write, ctx, make_write_plan([3], [-1]), [10, 20, 30], [0, 1, 2], [5, 17, 39])
    for s in (5, 17, 39):
        assert record(ctx, s)[3] == oracle.fingerprint(st.sources, st.mode, s) != 0
    assert [record(ctx, s)[2] for s in (5, 17, 39)] == CHAIN_10_20_30  # real KV is not in the chain


@WRITES
def test_none_mode_stores_zero_fingerprint(write, make_context, make_source, gen, make_write_plan):
    ctx = make_context(sources=[make_source(num_slots=32, generator=gen)], mode=RealKvHashMode.NONE, fill="random")
    run(write, ctx, make_write_plan([1], [-1]), [10], [0], [5])
    assert record(ctx, 5) == [10, 0, s64(H0), 0]


@WRITES
@pytest.mark.parametrize("num_valid, lengths", [(0, [2]), (1, [0]), (-2, [2]), (2, [0, 0])])
def test_no_work_only_counts_the_launch(write, num_valid, lengths, make_context, make_write_plan):
    ctx = make_context(fill="random", slot_count=4)
    before = ctx.canary_buf.clone()
    run(write, ctx, make_write_plan(lengths, [-1] * len(lengths), num_valid=num_valid), [1, 2], [0, 1], [3, 4])
    assert torch.equal(ctx.canary_buf, before)
    assert int(ctx.kernel_run_counter[0]) == 1 and int(ctx.slot_run_counter[0]) == 4
    assert int(ctx.violation_write_index[0]) == 0


@WRITES
def test_num_valid_reqs_clamped_and_padding_never_read(write, make_context, make_write_plan):
    ctx = make_context()
    plan = make_write_plan([2, 1], [-1, -1], num_valid=7)  # clamped to 2 requests
    # entries past write_offsets[2] = 3 are CUDA-graph padding: huge slots, never read
    run(write, ctx, plan, [10, 20, 30, 1, 1], [0, 1, 0, 0, 0], [5, 2, 7, 10**6, 10**9])
    assert int(ctx.slot_run_counter[0]) == 3
    assert record(ctx, 7) == [30, 0, s64(H0), 0]
    plan = make_write_plan([2, 1], [-1, -1], num_valid=1)
    run(write, ctx, plan, [11, 21, 31], [0, 1, 0], [5, 2, 10**6])
    assert int(ctx.slot_run_counter[0]) == 5 and record(ctx, 5)[0] == 11


@WRITES
def test_int32_inputs_are_widened(write, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([3], [-1]), [10, -20, 2**31 - 1], [0, -1, 2], [5, 2, 7], dtype=torch.int32,
        assert_tokens=[10, -20, -1], assert_positions=[0, -1, 2])
    h1 = s64(mix3(H0, 10, 0))
    h2 = s64(mix3(h1, -20, -1))
    assert record(ctx, 2) == [-20, -1, h1, 0]
    assert record(ctx, 7) == [2**31 - 1, 2, h2, 0]
    assert rows(ctx) == [[KIND, 7, 2, 2**31 - 1, -1, h2, 2, WTOK]]


@WRITES
def test_int32_skip_slots(write, make_context, make_write_plan):
    ctx = make_context()
    run(write, ctx, make_write_plan([4], [-1]), [10, 5, 20, 30], [0, 0, 1, 2], [5, -1, 2, 7], dtype=torch.int32)
    assert [record(ctx, s)[2] for s in (5, 2, 7)] == CHAIN_10_20_30


@WRITES
def test_outputs_are_views_updated_in_place_nothing_else_touched(write, make_write_plan):
    big_buf = torch.randint(0, 256, (40, 48), dtype=torch.uint8)
    big_ring = torch.full((10, 8), -5, dtype=torch.int64)
    idx_all = torch.tensor([3, 8, 4], dtype=torch.int32)
    slot_counts = torch.arange(12, dtype=torch.int64) * 10
    kernel_counts = torch.arange(12, dtype=torch.int64) * 100
    chain_flags = torch.tensor([0, 1, 0], dtype=torch.int32)
    ctx = VerifyOrWriteContext(
        canary_buf=big_buf[4:36], kernel_kind=CanaryLaunchTag.HEAD_V_SWA, violation_ring=big_ring[2:6],
        violation_write_index=idx_all[1:2], slot_run_counter=slot_counts[7:8], kernel_run_counter=kernel_counts[7:8],
        real_kv_sources=(), real_kv_hash_mode=RealKvHashMode.NONE, enable_chain_position_assert=chain_flags[1:2],
    )
    before = big_buf.clone()
    plan = make_write_plan([2], [-1])
    plan_before = [plan.write_offsets.clone(), plan.write_seed_slot_indices.clone(), plan.write_num_valid_reqs.clone()]
    ids, pos, loc = torch.tensor([10, 20]), torch.tensor([0, 1]), torch.tensor([5, 2])
    et, ep = torch.tensor([11, 20]), torch.tensor([0, 1])
    inputs_before = [t.clone() for t in (ids, pos, loc, et, ep)]
    write(context=ctx, plan=plan, input_ids=ids, positions=pos, out_cache_loc=loc, enable_write_input_assert=True,
          expected_input_tokens=et, expected_input_positions=ep)
    changed = (big_buf != before).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= {4 + 5, 4 + 2}
    assert torch.equal(big_buf[:, 32:], before[:, 32:])
    assert big_buf[9].view(torch.int64)[:4].tolist() == [10, 0, s64(H0), 0]
    assert big_ring[:2].eq(-5).all() and big_ring[3:].eq(-5).all()
    # index 8 >= capacity 4: the row is not kept, the count still grows
    assert idx_all.tolist() == [3, 9, 4]
    assert slot_counts.tolist() == [i * 10 for i in range(7)] + [72] + [i * 10 for i in range(8, 12)]
    assert kernel_counts.tolist() == [i * 100 for i in range(7)] + [701] + [i * 100 for i in range(8, 12)]
    assert chain_flags.tolist() == [0, 1, 0]
    for a, b in zip([plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs], plan_before):
        assert torch.equal(a, b)
    for a, b in zip((ids, pos, loc, et, ep), inputs_before):
        assert torch.equal(a, b)


@WRITES
def test_ring_view_receives_rows(write, make_write_plan):
    big_ring = torch.full((10, 8), -5, dtype=torch.int64)
    idx_all = torch.tensor([3, 1, 4], dtype=torch.int32)
    ctx = VerifyOrWriteContext(
        canary_buf=torch.zeros(16, 32, dtype=torch.uint8), kernel_kind=3, violation_ring=big_ring[2:6],
        violation_write_index=idx_all[1:2], slot_run_counter=torch.zeros(1, dtype=torch.int64),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64), real_kv_sources=(),
        real_kv_hash_mode=0, enable_chain_position_assert=torch.zeros(1, dtype=torch.int32),
    )
    run(write, ctx, make_write_plan([1], [-1]), [10], [0], [5], assert_tokens=[11], assert_positions=[0])
    assert big_ring[3].tolist() == [3, 5, 0, 10, 11, s64(H0), 0, WTOK]
    assert big_ring[:3].eq(-5).all() and big_ring[4:].eq(-5).all() and idx_all.tolist() == [3, 2, 4]


@WRITES
@pytest.mark.parametrize("chain_assert, input_assert", [(1, False), (0, True), (1, True)])
def test_work_but_every_entry_skipped_with_asserts_on(write, chain_assert, input_assert, make_context, make_write_plan):
    # Regression: a launch with work whose entries are all negative records no rows and stores nothing.
    ctx = make_context(chain_assert=chain_assert, fill="random")
    ctx.canary_buf.view(torch.int64)[5, CANARY_FIELD_POSITION] = 3
    before = ctx.canary_buf.clone()
    kw = dict(assert_tokens=[1, 2], assert_positions=[0, 0]) if input_assert else {}
    run(write, ctx, make_write_plan([2], [5]), [7, 8], [9, 9], [-1, -2], **kw)
    assert torch.equal(ctx.canary_buf, before)
    assert int(ctx.violation_write_index[0]) == 0 and int(ctx.slot_run_counter[0]) == 0
    assert int(ctx.kernel_run_counter[0]) == 1


@WRITES
def test_request_with_only_skipped_entries_between_others(write, make_context, make_write_plan):
    ctx = make_context(chain_assert=1)
    run(write, ctx, make_write_plan([1, 2, 1], [-1, 5, 5]), [10, 1, 2, 20], [0, 4, 4, 1], [5, -1, -1, 2],
        assert_tokens=[10, 0, 0, 20], assert_positions=[0, 0, 0, 1])
    assert rows(ctx) == []
    assert record(ctx, 2) == [20, 1, CHAIN_10_20_30[1], 0]
    assert int(ctx.slot_run_counter[0]) == 2


@WRITES
def test_offsets_not_starting_at_zero(write, make_context, make_write_plan):
    ctx = make_context()
    plan = make_write_plan([2, 1], [-1, -1])
    plan.write_offsets.copy_(torch.tensor([1, 3, 4]))
    run(write, ctx, plan, [99, 10, 20, 30], [0, 0, 1, 0], [9, 5, 2, 7])
    assert record(ctx, 9) == [0, 0, 0, 0]
    assert [record(ctx, s)[2] for s in (5, 2, 7)] == [CHAIN_10_20_30[0], CHAIN_10_20_30[1], s64(H0)]
