"""Out-of-range slots and request rows (issue 10 item 5).

Slots outside the canary buffer in a verify plan or a write are violations with their own reason
bits (``FailReason.VERIFY_SLOT_OUT_OF_RANGE`` / ``WRITE_SLOT_OUT_OF_RANGE``), never memory accesses:
the twin and the Triton kernels (interpreter) agree bit for bit. Request rows outside the request
table are a ``kv-canary:`` error raised before any plan output changes; under CUDA-graph capture
(no host read) the Triton plan treats such a row as padding.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from kvcanary.errors import KvCanaryError, KvCanaryValueError
from kvcanary.ops import (
    FailReason,
    RealKvHashMode,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
)
from kvcanary.ops.constants import WRITE_FAIL_REASONS, reason_label

from .triton_cases import assert_same_state, clone_context, context_state, make_context, make_source
from .triton_cases import write_inputs, write_plan

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    from .test_triton_interpret import _numpy_scalar_index_fix  # noqa: F401  (patches the interpreter)

VOOR = int(FailReason.VERIFY_SLOT_OUT_OF_RANGE)
WOOR = int(FailReason.WRITE_SLOT_OUT_OF_RANGE)


def _triton():
    if not INTERPRET:
        pytest.skip("Triton parity needs TRITON_INTERPRET=1 (CPU) or tests/gpu on a GPU")
    pytest.importorskip("triton")
    from kvcanary.ops import triton as triton_ops
    from kvcanary.ops.triton.write import WriteLaunchConfig

    return triton_ops, WriteLaunchConfig


def _ctx(num_slots=16, seed=7, **kw):
    g = torch.Generator().manual_seed(seed)
    args = dict(num_slots=num_slots, stride_bytes=32, ring_cap=32, sources=(), mode=RealKvHashMode.NONE,
                chain_assert=1, kind=2)
    args.update(kw)
    return make_context(g, "cpu", **args)


def _vplan(slots, prevs, positions, tokens=None, capacity=None):
    n = len(slots)
    vp = VerifyPlan.allocate(capacity or max(n, 1), "cpu")
    vp.verify_slot_indices.fill_(0)
    vp.verify_prev_slot_indices.fill_(0)
    vp.verify_expected_positions.fill_(0)
    vp.verify_expected_tokens.fill_(-1)
    vp.verify_slot_indices[:n] = torch.tensor(slots)
    vp.verify_prev_slot_indices[:n] = torch.tensor(prevs)
    vp.verify_expected_positions[:n] = torch.tensor(positions)
    if tokens is not None:
        vp.verify_expected_tokens[:n] = torch.tensor(tokens)
    vp.verify_num_valid[0] = n
    return vp


def _rows(ctx):
    n = min(int(ctx.violation_write_index[0]), ctx.violation_ring.shape[0])
    return ctx.violation_ring[:n].tolist()


def _verify_both(ctx, vp, check=False):
    """Twin and Triton (interpreter) on clones; asserts identical state; returns the twin's context."""
    triton_ops, _cfg = _triton()
    before = context_state(ctx)
    a, b = clone_context(ctx), clone_context(ctx)
    launch_canary_verify_kernel_torch_reference(context=a, plan=vp, check_verify_expected_token=check)
    triton_ops.launch_verify(context=b, plan=vp, check_verify_expected_token=check)
    assert_same_state(before, context_state(a), context_state(b))
    return a


def _write_both(ctx, wp, **kw):
    triton_ops, cfg = _triton()
    before = context_state(ctx)
    twin = clone_context(ctx)
    launch_canary_write_kernel_torch_reference(context=twin, plan=wp, **kw)
    for config in (cfg(), cfg(small_lanes=0)):  # the single-CTA kernel and the two-kernel path
        fast = clone_context(ctx)
        triton_ops.launch_write(context=fast, plan=wp, config=config, **kw)
        assert_same_state(before, context_state(twin), context_state(fast))
    return twin


# --------------------------------------------------------------------------- labels


def test_new_bits_are_documented_labels():
    assert reason_label(VOOR) == "verify_slot_out_of_range"
    assert reason_label(WOOR) == "write_slot_out_of_range"
    assert reason_label(VOOR | 1) == "verify_chain_hash+verify_slot_out_of_range"
    assert WRITE_FAIL_REASONS & WOOR and not WRITE_FAIL_REASONS & VOOR
    from kvcanary.runtime.attribution import REASON_MEANING

    assert FailReason.VERIFY_SLOT_OUT_OF_RANGE in REASON_MEANING
    assert FailReason.WRITE_SLOT_OUT_OF_RANGE in REASON_MEANING


# --------------------------------------------------------------------------- verify


def test_verify_twin_rows_for_out_of_range_slots_and_predecessors():
    ctx = _ctx(num_slots=16)
    f = ctx.canary_buf.view(torch.int64)
    # entries: slot past the end; negative slot; slot ok but predecessor past the end; padding;
    # far past the end (int64 range); predecessor "chain head" (-1) stays legal.
    vp = _vplan(slots=[16, -3, 5, 0, 2**40, 7], prevs=[4, 2, 99, 30, -1, -1], positions=[1, 2, 3, 4, 5, 6])
    a = launch_twin_verify(ctx, vp)
    rows = _rows(a)
    oor = [r for r in rows if r[7] == VOOR]
    assert [(r[1], r[6]) for r in oor] == [(16, 4), (-3, 2), (5, 99), (2**40, -1)]
    # unreadable stored fields are 0; a readable slot (5) keeps its stored fields
    assert oor[0][2:6] == [0, 0, -1, 0] and oor[1][2:6] == [0, 0, -1, 0]
    assert oor[2][2] == int(f[5, 1]) and oor[2][3] == int(f[5, 0]) and oor[2][5] == int(f[5, 2])
    # slot 7 with a chain-head predecessor is checked as usual (its random record mismatches)
    assert any(r[1] == 7 and r[7] & 3 and not r[7] & VOOR for r in rows)
    assert int(a.slot_run_counter[0]) - int(ctx.slot_run_counter[0]) == 6
    assert torch.equal(a.canary_buf, ctx.canary_buf)


def launch_twin_verify(ctx, vp, check=False):
    a = clone_context(ctx)
    launch_canary_verify_kernel_torch_reference(context=a, plan=vp, check_verify_expected_token=check)
    return a


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("hashing", [False, True])
def test_verify_out_of_range_twin_matches_triton(check, hashing):
    g = torch.Generator().manual_seed(3)
    sources = [make_source(g, "cpu", num_slots=16, page_size=4, nbpt=32, read_bytes=32, dtype=torch.uint8)] if hashing else []
    ctx = _ctx(num_slots=16, sources=sources, mode=RealKvHashMode.ALL if hashing else RealKvHashMode.NONE)
    vp = _vplan(slots=[16, -3, 5, 0, 2**40, 7, 15, 3], prevs=[4, 2, 99, 30, -1, -1, 16, 0],
                positions=[1, 2, 3, 4, 5, 6, 7, 8], tokens=[5, -1, 7, 1, 2, 3, 4, 5])
    a = _verify_both(ctx, vp, check)
    assert sum(r[7] == VOOR for r in _rows(a)) == 5


def test_verify_only_out_of_range_entries_still_counted_and_reported():
    ctx = _ctx(num_slots=8)
    vp = _vplan(slots=[8, 9], prevs=[-1, 8], positions=[0, 1])
    a = _verify_both(ctx, vp)
    assert [r[7] for r in _rows(a)] == [VOOR, VOOR]
    assert int(a.kernel_run_counter[0]) == int(ctx.kernel_run_counter[0]) + 1


# --------------------------------------------------------------------------- write


def test_write_twin_out_of_range_entry_is_reported_not_stored():
    ctx = _ctx(num_slots=16, chain_assert=1)
    ctx.canary_buf.view(torch.int64)[9, 1] = -1  # the seed's position: the request continues at 0
    # one request seeded from slot 9: slots 3, 40 (out of range), 4
    a = clone_context(ctx)
    wp = write_plan([3], [9])
    launch_canary_write_kernel_torch_reference(context=a, plan=wp, **write_inputs([10, 20, 30], [0, 1, 2], [3, 40, 4]))
    rows = _rows(a)
    assert len(rows) == 2  # the out-of-range row, then the chain-position row of slot 4 (1 -> 2 skipped)
    oor = rows[0]
    assert oor[1] == 40 and oor[7] == WOOR and oor[2] == 1 and oor[3] == 20 and oor[4] == 20 and oor[6] == 1
    f = a.canary_buf.view(torch.int64)
    # slot 4 chains from slot 3 (the out-of-range entry does not advance the chain)
    ref = clone_context(ctx)
    launch_canary_write_kernel_torch_reference(context=ref, plan=write_plan([2], [9]), **write_inputs([10, 30], [0, 2], [3, 4]))
    assert torch.equal(f[:, :4], ref.canary_buf.view(torch.int64)[:, :4])
    assert oor[5] == int(f[4, 2])  # running: the prev_hash the next stored entry got
    assert int(a.slot_run_counter[0]) - int(ctx.slot_run_counter[0]) == 2


def test_write_out_of_range_twin_matches_triton_decode_and_prefill():
    ctx = _ctx(num_slots=32, ring_cap=64)
    # decode-style one-entry requests (one out of range) + a prefill request with two bad slots
    wp = write_plan([1, 1, 5, 1], [-1, 7, 9, 33])  # the last seed is past the buffer: reads as zeros
    kw = write_inputs([1, 2, 3, 4, 5, 6, 7, 8], [0, 4, 9, 10, 11, 12, 13, 5], [2, 32, 10, 100, 11, -1, 2**35, 12])
    a = _write_both(ctx, wp, **kw)
    assert sorted(r[1] for r in _rows(a) if r[7] == WOOR) == [32, 100, 2**35]


def test_write_out_of_range_with_input_assert_and_serial_mode():
    ctx = _ctx(num_slots=24, ring_cap=64)
    # request 1 seeds from slot 5, which request 0 stores: serial mode
    wp = write_plan([3, 3], [-1, 5])
    kw = write_inputs([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], [5, 24, 6, 7, 30, 8],
                  expected=([1, 0, 3, 4, 5, 0], [0, 1, 9, 3, 4, 5]))
    a = _write_both(ctx, wp, **kw)
    assert sorted(r[1] for r in _rows(a) if r[7] == WOOR) == [24, 30]


def test_write_long_request_with_out_of_range_slots_many_chunks():
    ctx = _ctx(num_slots=200, ring_cap=256)
    n = 150
    loc = list(range(1, n + 1))
    loc[10], loc[40], loc[77], loc[149] = 500, -1, 200, 10**9
    _write_both(ctx, write_plan([n], [199]), **write_inputs(list(range(1000, 1000 + n)), list(range(n)), loc))


# --------------------------------------------------------------------------- request rows


def _plan_args(rp, prefix, extend, *, rows=4, width=10, table=False):
    rtt = (torch.arange(rows * width, dtype=torch.int32).reshape(rows, width) % 13) + 1
    kw = dict(
        req_pool_indices=torch.tensor(rp), prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(extend),
        req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=32,
        req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
        kv_token_id_vs_position_offset=0,
    )
    if table:
        kw["req_to_verify_expected_tokens"] = torch.arange(2 * (width + 2), dtype=torch.int32).reshape(2, width + 2)
        kw["req_to_verify_expected_tokens_valid_lens"] = torch.full((len(rp),), width, dtype=torch.int64)
    return kw


def _fresh_plans(seed=0):
    g = torch.Generator().manual_seed(seed)
    vp, wp = VerifyPlan.allocate(32, "cpu"), WritePlan.allocate(3, "cpu")
    for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
              vp.verify_prev_slot_indices, wp.write_offsets, wp.write_seed_slot_indices):
        t.copy_(torch.randint(-9, 9, t.shape, generator=g))
    return vp, wp


def _plan_tensors(vp, wp):
    return [t.clone() for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
                                vp.verify_prev_slot_indices, vp.verify_num_valid, vp.enable, wp.write_offsets,
                                wp.write_seed_slot_indices, wp.write_num_valid_reqs)]


@pytest.mark.parametrize("impl", [launch_canary_plan_kernels, launch_canary_plan_kernels_torch_reference])
@pytest.mark.parametrize("rp,table", [([1, 4, 2], False), ([1, -1, 2], False), ([3, 0, 2], True), ([2, 2, 2**33], False)])
def test_plan_request_row_outside_table_raises_before_any_change(impl, rp, table):
    vp, wp = _fresh_plans()
    before = _plan_tensors(vp, wp)
    kw = _plan_args(rp, [3, 2, 1], [1, 2, 3], table=table)
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: .*req_pool_indices\[\d\]=-?\d+ is outside the request table rows"):
        impl(verify_plan_out=vp, write_plan_out=wp, **kw)
    for x, y in zip(before, _plan_tensors(vp, wp)):
        assert torch.equal(x, y)


def test_plan_padding_rows_never_checked():
    vp, wp = _fresh_plans()
    kw = _plan_args([0, 1, 0], [7, 2, 99], [5, 1, -4])
    launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **kw)
    assert int(vp.verify_num_valid[0]) == 2 and wp.write_offsets[:4].tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("bs_rows", [3, 300])
def test_triton_plan_treats_out_of_range_rows_as_padding(bs_rows):
    """What the kernels do under graph capture (no host check): a row outside the table is planned
    like a padding row, so the outputs equal the twin's with that row set to 0."""
    triton_ops, _cfg = _triton()
    g = torch.Generator().manual_seed(bs_rows)
    rows = 6
    rp = torch.randint(1, rows, (bs_rows,), generator=g)
    rp[0], rp[-1] = rows + 3, -2
    prefix = torch.randint(0, 5, (bs_rows,), generator=g)
    extend = torch.randint(0, 3, (bs_rows,), generator=g)
    kw = _plan_args(rp.tolist(), prefix.tolist(), extend.tolist(), rows=rows)
    kw["verify_capacity"] = 4096
    vt, wt = VerifyPlan.allocate(4096, "cpu"), WritePlan.allocate(bs_rows, "cpu")
    vf, wf = VerifyPlan.allocate(4096, "cpu"), WritePlan.allocate(bs_rows, "cpu")
    for p in (vt, vf):
        for t in (p.verify_slot_indices, p.verify_expected_tokens, p.verify_expected_positions, p.verify_prev_slot_indices):
            t.fill_(5)
    wt.write_seed_slot_indices.fill_(5)
    wf.write_seed_slot_indices.fill_(5)
    triton_ops.launch_plan(verify_plan_out=vf, write_plan_out=wf, **kw)
    padded = dict(kw, req_pool_indices=torch.where((rp < 0) | (rp >= rows), 0, rp))
    launch_canary_plan_kernels_torch_reference(verify_plan_out=vt, write_plan_out=wt, **padded)
    for x, y in zip(_plan_tensors(vt, wt), _plan_tensors(vf, wf)):
        assert torch.equal(x, y)


# --------------------------------------------------------------------------- property (seeded)


def _state(ctx, vp, wp):
    return [ctx.canary_buf.clone(), ctx.violation_ring.clone(), ctx.violation_write_index.clone(),
            ctx.slot_run_counter.clone(), ctx.kernel_run_counter.clone(), *_plan_tensors(vp, wp)]


def test_random_out_of_range_inputs_only_raise_kvcanary_errors_and_never_change_state_when_they_do():
    """30 seeded cases: random request rows (some outside the table, some negative), random table
    contents (slots past the buffer, negative), random write slots; plan -> verify -> write through
    the public launchers. Any error is a KvCanaryError raised with nothing changed; otherwise
    every out-of-range slot the ops saw is reported with its bit, and on the interpreter the
    Triton kernels give the same state."""
    rng = random.Random(1234)
    raised = reported = 0
    for case in range(30):
        num_slots = rng.randint(4, 40)
        rows, width = rng.randint(2, 8), rng.randint(4, 16)
        bs = rng.randint(1, 6)
        ctx = _ctx(num_slots=num_slots, seed=case, chain_assert=rng.randint(0, 1), ring_cap=rng.choice([4, 64]))
        rtt = torch.tensor([[rng.choice([rng.randint(1, num_slots - 1), rng.randint(num_slots, 3 * num_slots),
                                         rng.randint(-3, -1), 2**40]) for _ in range(width)] for _ in range(rows)],
                           dtype=torch.int64).clamp(-2**31, 2**31 - 1).to(torch.int32)
        rp = [rng.choice([rows + rng.randint(0, 5), -rng.randint(1, 3)]) if rng.random() < 0.08
              else rng.choice([0, rng.randint(1, rows - 1), rng.randint(1, rows - 1)]) for _ in range(bs)]
        prefix = [rng.randint(0, width // 2) for _ in range(bs)]
        extend = [rng.randint(0, 3) for _ in range(bs)]
        vp, wp = VerifyPlan.allocate(64, "cpu"), WritePlan.allocate(bs, "cpu")
        before = _state(ctx, vp, wp)
        try:
            launch_canary_plan_kernels(
                verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor(rp), prefix_lens=torch.tensor(prefix),
                extend_seq_lens=torch.tensor(extend), req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None,
                verify_capacity=64, req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
                kv_token_id_vs_position_offset=0)
        except Exception as exc:  # noqa: BLE001 - the property is about the type
            assert isinstance(exc, KvCanaryError) and str(exc).startswith("kv-canary:"), repr(exc)
            assert all(torch.equal(x, y) for x, y in zip(before, _state(ctx, vp, wp)))
            raised += 1
            continue
        n = int(wp.write_offsets[min(bs, wp.write_offsets.shape[0] - 1)])
        loc = [rng.choice([rng.randint(0, num_slots - 1), rng.randint(num_slots, 4 * num_slots), -1, 2**33])
               for _ in range(n)]
        winputs = write_inputs([rng.randint(0, 99) for _ in range(n)], [rng.randint(0, 20) for _ in range(n)], loc)
        twin = clone_context(ctx)
        launch_canary_verify_kernel(context=twin, plan=vp, check_verify_expected_token=False)
        launch_canary_write_kernel(context=twin, plan=wp, **winputs)
        seen = [r for r in _rows(twin) if r[7] & (VOOR | WOOR)]
        bad_verify = [s for s, p in zip(vp.verify_slot_indices[: int(vp.verify_num_valid[0])].tolist(),
                                        vp.verify_prev_slot_indices[: int(vp.verify_num_valid[0])].tolist())
                      if s != 0 and (s < 0 or s >= num_slots or p >= num_slots)]
        bad_write = [s for s in loc if s >= num_slots]
        if int(twin.violation_write_index[0]) <= twin.violation_ring.shape[0]:
            assert sorted(r[1] for r in seen if r[7] == VOOR) == sorted(bad_verify)
            assert sorted(r[1] for r in seen if r[7] == WOOR) == sorted(bad_write)
        reported += len(bad_verify) + len(bad_write)
        if INTERPRET:
            triton_ops, cfg = _triton()
            fast = clone_context(ctx)
            triton_ops.launch_verify(context=fast, plan=vp, check_verify_expected_token=False)
            triton_ops.launch_write(context=fast, plan=wp, config=cfg(small_lanes=rng.choice([0, 256])), **winputs)
            assert_same_state(context_state(ctx), context_state(twin), context_state(fast))
    assert raised > 0 and reported > 0  # both paths were exercised



def test_counters_moved_by_a_raising_launch_are_the_documented_ones():
    """Launcher docstrings: an argument error moves nothing; a lazy error (bad canary stride) has
    moved kernel +1 and slot + active entries (verify) or kernel +1 only (write); a plan error
    changes no output."""
    ctx = _ctx(num_slots=8, stride_bytes=24)  # 3 int64 fields: the lazy stride error
    vp = _vplan(slots=[1, 9, 2], prevs=[-1, 1, 1], positions=[0, 1, 1])
    before = context_state(ctx)
    with pytest.raises(KvCanaryValueError, match="slot stride must hold at least 4 int64 fields"):
        launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)
    assert int(ctx.kernel_run_counter[0]) == int(before["counters"][14]) + 1
    assert int(ctx.slot_run_counter[0]) == int(before["counters"][2]) + 3
    assert torch.equal(ctx.violation_ring, before["ring"]) and int(ctx.violation_write_index[0]) == before["index"]
    before = context_state(ctx)
    with pytest.raises(KvCanaryValueError, match="slot stride must hold at least 4 int64 fields"):
        launch_canary_write_kernel(context=ctx, plan=write_plan([2], [-1]), **write_inputs([1, 2], [0, 1], [3, 40]))
    assert int(ctx.kernel_run_counter[0]) == int(before["counters"][14]) + 1
    assert int(ctx.slot_run_counter[0]) == int(before["counters"][2])
    assert torch.equal(ctx.canary_buf, before["buf"])
    before = context_state(ctx)
    with pytest.raises(KvCanaryError):  # argument error: positions shorter than input_ids
        launch_canary_write_kernel(context=ctx, plan=write_plan([2], [-1]), **dict(
            write_inputs([1, 2], [0, 1], [3, 4]), positions=torch.tensor([0])))
    after = context_state(ctx)
    assert torch.equal(after["counters"], before["counters"]) and torch.equal(after["buf"], before["buf"])


# --------------------------------------------------------------------------- prefix lengths past the table width
# An active row's verify entries and seed read req_to_token[rp, pos] for pos < P only, so P > width
# is the out-of-range case (P + extend > width is legal: the write op does not read the table).

SENTINEL = 777_777


def _guarded(values, rows, fill=SENTINEL):
    """``values`` (int32 [rows, w]) as the leading rows of a larger tensor whose extra row holds
    ``fill``: a load past the last row's end reads the sentinel instead of unknown memory."""
    big = torch.full((rows + 1, values.shape[1]), fill, dtype=torch.int32)
    big[:rows] = values
    return big[:rows]


@pytest.mark.parametrize("impl", [launch_canary_plan_kernels, launch_canary_plan_kernels_torch_reference])
@pytest.mark.parametrize("rp,prefix,extend,bad_row", [
    ([1, 2], [12, 3], [1, 1], 0),  # the repro: prefix 12 in a width-10 table
    ([0, 3, 2], [50, 4, 11], [1, 0, 1], 2),  # the padding row's 50 is never checked; row 2 is
    ([3, 1], [10, 11], [0, 0], 1),  # prefix == width is legal; width + 1 is not (even with no extend)
])
def test_plan_prefix_past_width_raises_before_any_change(impl, rp, prefix, extend, bad_row):
    vp, wp = _fresh_plans()
    before = _plan_tensors(vp, wp)
    kw = _plan_args(rp, prefix, extend)
    msg = rf"^kv-canary: {impl.__name__} row {bad_row}: prefix {prefix[bad_row]} exceeds the request table width 10$"
    with pytest.raises(KvCanaryValueError, match=msg):
        impl(verify_plan_out=vp, write_plan_out=wp, **kw)
    for x, y in zip(before, _plan_tensors(vp, wp)):
        assert torch.equal(x, y)


def test_plan_launcher_checks_prefix_on_cpu_even_when_host_checks_are_off():
    vp, wp = _fresh_plans()
    before = _plan_tensors(vp, wp)
    with pytest.raises(KvCanaryValueError, match=r"row 0: prefix 11 exceeds the request table width 10"):
        launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, check_request_rows_on_host=False,
                                   **_plan_args([1], [11], [1]))
    assert all(torch.equal(x, y) for x, y in zip(before, _plan_tensors(vp, wp)))


def test_plan_request_row_error_comes_before_prefix_error():
    vp, wp = _fresh_plans()
    with pytest.raises(KvCanaryValueError, match=r"req_pool_indices\[1\]=9 is outside the request table rows"):
        launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp,
                                                   **_plan_args([1, 9], [40, 2], [1, 1]))


@pytest.mark.parametrize("impl", [launch_canary_plan_kernels, launch_canary_plan_kernels_torch_reference])
def test_plan_prefix_at_width_with_extend_past_it_is_planned(impl):
    """P == width with E > 0 (P + E > width) is in the contract: every position of the row is an
    entry and the seed is the row's last slot."""
    vp, wp = _fresh_plans()
    kw = _plan_args([2, 1], [10, 1], [6, 2])
    impl(verify_plan_out=vp, write_plan_out=wp, **kw)
    rtt = kw["req_to_token"]
    n = int(vp.verify_num_valid[0])
    assert n == 11 and vp.verify_slot_indices[:10].tolist() == rtt[2].tolist()
    assert vp.verify_expected_positions[:n].tolist() == list(range(10)) + [0]
    assert wp.write_seed_slot_indices[:2].tolist() == [int(rtt[2, 9]), int(rtt[1, 0])]
    assert wp.write_offsets[:3].tolist() == [0, 6, 8]


def _capture_model(kw, width):
    """What the Triton kernels plan under capture (no host check): the twin's plan of the same batch
    on the table widened with zero columns up to the longest prefix, minus every entry at a position
    at or past ``width`` (the window start still comes from the full prefix); a seed that would come
    from such a column is -1. The verify capacity must hold the widened plan."""
    rp, prefix, extend = kw["req_pool_indices"], kw["prefix_lens"], kw["extend_seq_lens"]
    rtt = kw["req_to_token"]
    extra = max(0, int(prefix.max()) - width) if prefix.numel() else 0
    wide = torch.cat([rtt, torch.zeros(rtt.shape[0], extra, dtype=rtt.dtype)], dim=1)
    cap = kw["verify_capacity"]
    full_v, wp = VerifyPlan.allocate(cap, "cpu"), WritePlan.allocate(rp.shape[0], "cpu")
    wp.write_seed_slot_indices.fill_(5)
    launch_canary_plan_kernels_torch_reference(verify_plan_out=full_v, write_plan_out=wp, **dict(kw, req_to_token=wide))
    assert int(full_v.enable[0]) == 1, "model capacity too small"
    wp.write_seed_slot_indices[(rp != 0) & (prefix > width) & (extend > 0)] = -1
    n = int(full_v.verify_num_valid[0])
    keep = full_v.verify_expected_positions[:n] < width
    k = int(keep.sum())
    vp = VerifyPlan.allocate(cap, "cpu")
    for name in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices"):
        out = getattr(vp, name)
        out.fill_(5)
        out[:k] = getattr(full_v, name)[:n][keep]
    vp.verify_num_valid.fill_(k)
    vp.enable.fill_(1)
    return vp, wp


def _triton_capture_plan(kw, config=None):
    triton_ops, _cfg = _triton()
    bs = kw["req_pool_indices"].shape[0]
    vp, wp = VerifyPlan.allocate(kw["verify_capacity"], "cpu"), WritePlan.allocate(bs, "cpu")
    for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
              vp.verify_prev_slot_indices, wp.write_seed_slot_indices):
        t.fill_(5)
    extra = {} if config is None else {"config": config}
    triton_ops.launch_plan(verify_plan_out=vp, write_plan_out=wp, **kw, **extra)
    return vp, wp


def _assert_no_sentinel(vp, wp, lut=None):
    n = int(vp.verify_num_valid[0])
    bad = {SENTINEL} if lut is None else {SENTINEL, *(() if SENTINEL >= lut.shape[0] else (int(lut[SENTINEL]),))}
    seen = set(vp.verify_slot_indices[:n].tolist()) | set(vp.verify_prev_slot_indices[:n].tolist())
    seen |= set(vp.verify_expected_tokens[:n].tolist()) | set(wp.write_seed_slot_indices.tolist())
    assert not seen & bad


@pytest.mark.parametrize("bs_rows", [3, 300])
@pytest.mark.parametrize("window,with_lut", [(0, False), (4, False), (0, True), (6, True)])
def test_triton_plan_never_reads_past_the_request_row(bs_rows, window, with_lut):
    """Capture behaviour (launch_plan called directly, no host check): rows with prefixes past the
    width name request rows followed by sentinel rows (row 2, and the memory after the last row);
    no sentinel reaches the plan, and the plan equals the cut-at-the-width model."""
    _triton()
    from kvcanary.ops.triton.plan import PlanLaunchConfig

    g = torch.Generator().manual_seed(bs_rows + window)
    rows, width = 4, 10
    vals = (torch.arange(rows * width, dtype=torch.int32).reshape(rows, width) % 13) + 1
    vals[2] = SENTINEL
    rtt = _guarded(vals, rows)
    rp = torch.tensor([1, 3])[torch.randint(0, 2, (bs_rows,), generator=g)]
    rp[torch.randint(0, bs_rows, (bs_rows // 4,), generator=g)] = 0
    prefix = torch.randint(0, 3 * width, (bs_rows,), generator=g)
    prefix[:3] = torch.tensor([width + 1, width, 3 * width])
    rp[:3] = torch.tensor([3, 1, 1])
    extend = torch.randint(0, 3, (bs_rows,), generator=g)
    kw = _plan_args(rp.tolist(), prefix.tolist(), extend.tolist(), rows=rows, width=width)
    lut = torch.arange(64, dtype=torch.int64) * 3 if with_lut else None
    kw.update(req_to_token=rtt, swa_window_size=window, full_to_swa_index_mapping=lut, verify_capacity=8192)
    want_v, want_w = _capture_model(kw, width)
    # small batches: the one-launch tile kernel and the scan + gather path; 300 rows: scan + gather
    configs = [None, PlanLaunchConfig(tile_rows=0)] if bs_rows <= 256 else [None]
    for config in configs:
        got_v, got_w = _triton_capture_plan(kw, config)
        _assert_no_sentinel(got_v, got_w, lut)
        for x, y in zip(_plan_tensors(want_v, want_w), _plan_tensors(got_v, got_w)):
            assert torch.equal(x, y)
        assert int(got_v.enable[0]) == 1
        n_cut_rows = int(((rp != 0) & (prefix > width) & (extend > 0)).sum())
        assert n_cut_rows > 0 and int((got_w.write_seed_slot_indices == -1).sum()) >= n_cut_rows


@pytest.mark.parametrize("impl", ["twin", "triton"])
def test_expected_tokens_past_the_table_width_are_never_read(impl):
    """Valid lengths above the expected-token table's width: columns at or past the width give
    token -1 (the twin used to return the last column's value; Triton read the next row)."""
    rows, width, cols = 4, 10, 6
    table_vals = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols) + 100
    table_vals[2] = SENTINEL
    kw = _plan_args([1, 3, 0], [8, 9, 3], [1, 1, 1], rows=rows, width=width)
    kw.update(req_to_verify_expected_tokens=_guarded(table_vals, rows),
              req_to_verify_expected_tokens_valid_lens=torch.tensor([1000, 7, 1000]),
              kv_token_id_vs_position_offset=1)
    if impl == "twin":
        vp, wp = _fresh_plans()
        launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **kw)
    else:
        vp, wp = _triton_capture_plan(kw)
    _assert_no_sentinel(vp, wp)
    n = int(vp.verify_num_valid[0])
    assert n == 17
    tokens = vp.verify_expected_tokens[:n].tolist()
    # row 1 (request row 1): columns pos + 1 = 1..8; readable below min(valid 1000, width 6)
    assert tokens[:8] == [int(table_vals[1, c]) if c < cols else -1 for c in range(1, 9)]
    # row 3: valid length 7 > width 6 too; columns 1..9
    assert tokens[8:] == [int(table_vals[3, c]) if c < cols else -1 for c in range(1, 10)]


def test_random_long_lengths_raise_exactly_when_a_prefix_passes_the_width():
    """40 seeded cases with prefix and extend lengths up to twice the width and valid lengths past
    the expected-token table's width: the public launcher raises (a kv-canary error, nothing
    changed) iff an active row's prefix exceeds the width; otherwise every planned slot, predecessor
    and token comes from inside its row. On the interpreter the Triton plan (capture behaviour)
    never reads a sentinel row and equals the cut-at-the-width model."""
    rng = random.Random(4321)
    raised = planned = 0
    for case in range(40):
        rows, width, cols = rng.randint(3, 6), rng.randint(2, 12), rng.randint(1, 12)
        bs = rng.randint(1, 8)
        vals = torch.tensor([[rng.randint(1, 500) for _ in range(width)] for _ in range(rows)], dtype=torch.int32)
        sentinel_row = rng.randint(1, rows - 1)
        vals[sentinel_row] = SENTINEL
        table_vals = torch.tensor([[rng.randint(-1, 900) for _ in range(cols)] for _ in range(rows)],
                                  dtype=torch.int32)
        table_vals[sentinel_row] = SENTINEL
        live = [r for r in range(1, rows) if r != sentinel_row]
        rp = [0 if rng.random() < 0.2 else rng.choice(live) for _ in range(bs)]
        prefix = [rng.randint(0, 2 * width) if rng.random() < 0.3 else rng.randint(0, width) for _ in range(bs)]
        extend = [rng.randint(-1, 2 * width) for _ in range(bs)]
        window = rng.choice([0, 0, rng.randint(1, width + 2)])
        kw = dict(
            req_pool_indices=torch.tensor(rp), prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(extend),
            req_to_token=_guarded(vals, rows), swa_window_size=window,
            full_to_swa_index_mapping=torch.arange(600, dtype=torch.int64) + 1 if window else None,
            verify_capacity=256, req_to_verify_expected_tokens=_guarded(table_vals, rows),
            req_to_verify_expected_tokens_valid_lens=torch.tensor([rng.randint(0, 3 * cols) for _ in range(bs)]),
            kv_token_id_vs_position_offset=rng.randint(-1, 2),
        )
        too_long = [r for r in range(bs) if rp[r] != 0 and prefix[r] > width]
        vp, wp = VerifyPlan.allocate(256, "cpu"), WritePlan.allocate(bs, "cpu")
        before = _plan_tensors(vp, wp)
        try:
            launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **kw)
        except KvCanaryValueError as exc:
            assert too_long and str(exc).startswith(
                f"kv-canary: launch_canary_plan_kernels row {too_long[0]}: prefix {prefix[too_long[0]]} exceeds")
            assert all(torch.equal(x, y) for x, y in zip(before, _plan_tensors(vp, wp)))
            raised += 1
        else:
            assert not too_long
            _assert_no_sentinel(vp, wp, kw["full_to_swa_index_mapping"])
            planned += 1
        if INTERPRET:
            want_v, want_w = _capture_model(kw, width)
            got_v, got_w = _triton_capture_plan(kw)
            _assert_no_sentinel(got_v, got_w, kw["full_to_swa_index_mapping"])
            for x, y in zip(_plan_tensors(want_v, want_w), _plan_tensors(got_v, got_w)):
                assert torch.equal(x, y)
    assert raised > 0 and planned > 0
