"""Every error message of docs/design.md §3 with its exact text, the side effects of a raising op, and the
lazy-check order and work gates."""
from __future__ import annotations

import re

import pytest
import torch

from kvcanary.ops import (
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
    launch_scatter_req_token_ids_kernel,
    scatter_req_token_ids_torch_reference,
)

from . import oracle

WRITES = pytest.mark.parametrize(
    "write", [launch_canary_write_kernel_torch_reference, launch_canary_write_kernel], ids=["twin", "launcher"]
)
VERIFIES = pytest.mark.parametrize(
    "verify", [launch_canary_verify_kernel_torch_reference, launch_canary_verify_kernel], ids=["twin", "launcher"]
)
PLANS = pytest.mark.parametrize(
    "plan_op", [launch_canary_plan_kernels_torch_reference, launch_canary_plan_kernels], ids=["twin", "launcher"]
)
TWIN = "launch_canary_plan_kernels_torch_reference"
STRIDE_MSG = "kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got {}"
REQUIRED_MSG = "kv-canary: expected input tensors are required when enable_write_input_assert=True"
MUST_BE_NONE_MSG = "kv-canary: expected input tensors must be None when enable_write_input_assert=False"


def exactly(exc, msg):
    return pytest.raises(exc, match="^" + re.escape(msg) + "$")


def narrow_msg(row_bytes, p, n):
    return (f"kv-canary: RealKvSource row is too narrow for its slot layout: dim-1 is {row_bytes} bytes but "
            f"page_size={p} x num_bytes_per_token={n} needs {p * n}")


def state(ctx):
    """Everything a write/verify may touch, plus the per-tag arrays the counters are views of."""
    return [ctx.canary_buf.clone(), ctx.violation_ring.clone(), ctx.violation_write_index.clone(),
            ctx.slot_run_counter._base.clone(), ctx.kernel_run_counter._base.clone()]


def changes(ctx, before):
    """Names of the parts of ``state`` that changed."""
    names = ["buf", "ring", "index", "slot_counter", "kernel_counter"]
    return [n for n, a, b in zip(names, state(ctx), before) if not torch.equal(a, b)]


def do_write(write, ctx, plan, n=2, *, flag=False, tokens=None, positions=None, loc=None):
    write(context=ctx, plan=plan, input_ids=torch.arange(10, 10 + n), positions=torch.arange(n),
          out_cache_loc=torch.tensor(loc if loc is not None else list(range(3, 3 + n))),
          enable_write_input_assert=flag, expected_input_tokens=tokens, expected_input_positions=positions)


def narrow_source(page_size=4, nbpt=16, row_bytes=48, stride_pad=16, dtype=torch.uint8):
    es = torch.empty(0, dtype=dtype).element_size()
    full = torch.zeros(16, (row_bytes + stride_pad) // es, dtype=dtype)
    return RealKvSource(tensor=full[:, : row_bytes // es], page_size=page_size, num_bytes_per_token=nbpt, read_bytes=16)


# --------------------------------------------------------------------------- RealKvSource
@pytest.mark.parametrize("kwargs, msg", [
    (dict(page_size=0, num_bytes_per_token=8, read_bytes=0), "kv-canary: RealKvSource.page_size must be >= 1, got 0"),
    (dict(page_size=-3, num_bytes_per_token=16, read_bytes=16), "kv-canary: RealKvSource.page_size must be >= 1, got -3"),
    (dict(page_size=1, num_bytes_per_token=24, read_bytes=0),
     "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 24"),
    (dict(page_size=1, num_bytes_per_token=0, read_bytes=16),
     "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 0"),
    (dict(page_size=1, num_bytes_per_token=-16, read_bytes=16),
     "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got -16"),
    (dict(page_size=1, num_bytes_per_token=32, read_bytes=48),
     "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 48"),
    (dict(page_size=1, num_bytes_per_token=32, read_bytes=8),
     "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 8"),
    (dict(page_size=1, num_bytes_per_token=32, read_bytes=0),
     "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 0"),
])
def test_real_kv_source_value_checks_in_order(kwargs, msg):
    with exactly(ValueError, msg):
        RealKvSource(tensor=torch.zeros(3), **kwargs)  # the 1-D tensor would fail later checks


def test_real_kv_source_rank_check():
    with exactly(ValueError, "kv-canary: RealKvSource.tensor must be at least 2-D, got shape (64,)"):
        RealKvSource(tensor=torch.zeros(64, dtype=torch.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16)


@pytest.mark.parametrize("t, b, shape, strides, dtype", [
    (torch.zeros(4, 24, dtype=torch.uint8), 24, (4, 24), (24, 1), "torch.uint8"),
    (torch.zeros(4, 20, dtype=torch.bfloat16)[:, :12], 40, (4, 12), (20, 1), "torch.bfloat16"),
    (torch.zeros(4, 3, 2, dtype=torch.float32), 24, (4, 3, 2), (6, 2, 1), "torch.float32"),
])
def test_real_kv_source_row_stride_check(t, b, shape, strides, dtype):
    msg = (f"kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, got {b} bytes "
           f"(shape={shape}, strides={strides}, dtype={dtype})")
    with exactly(ValueError, msg):
        RealKvSource(tensor=t, page_size=1, num_bytes_per_token=16, read_bytes=16)


def test_real_kv_source_accepts_row_strided_views_of_any_dtype():
    for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.float64):
        es = torch.empty(0, dtype=dtype).element_size()
        full = torch.zeros(4, 64 // es, dtype=dtype)
        src = RealKvSource(tensor=full[:, : 16 // es], page_size=1, num_bytes_per_token=16, read_bytes=16)
        assert src.tensor.stride(0) * es == 64


def test_plan_allocate_errors():
    for cap in (0, -2):
        with exactly(ValueError, f"kv-canary: VerifyPlan verify_capacity must be positive, got {cap}"):
            VerifyPlan.allocate(cap, "cpu")
        with exactly(ValueError, f"kv-canary: VerifyPlan verify_capacity must be positive, got {cap}"):
            VerifyPlan.allocate(verify_capacity=cap, device="cpu")
        with exactly(ValueError, f"kv-canary: WritePlan write_req_capacity must be positive, got {cap}"):
            WritePlan.allocate(cap, "cpu")
        with exactly(ValueError, f"kv-canary: WritePlan write_req_capacity must be positive, got {cap}"):
            WritePlan.allocate(write_req_capacity=cap, device="cpu")


def test_plan_allocate_defaults():
    vp = VerifyPlan.allocate(verify_capacity=3, device="cpu")
    assert vp.verify_slot_indices.shape == (3,) and vp.verify_slot_indices.dtype == torch.int64
    assert vp.verify_num_valid.tolist() == [0] and vp.enable.tolist() == [1] and vp.enable.dtype == torch.int32
    wp = WritePlan.allocate(2, "cpu")
    assert wp.write_offsets.shape == (3,) and wp.write_seed_slot_indices.shape == (2,)
    assert wp.write_num_valid_reqs.dtype == torch.int32


# --------------------------------------------------------------------------- canary stride
@WRITES
@pytest.mark.parametrize("stride_bytes, got", [(24, 3), (8, 1)])
def test_write_stride_error_only_kernel_counter(write, stride_bytes, got, make_context, make_write_plan):
    ctx = make_context(stride_bytes=stride_bytes)
    before = state(ctx)
    with exactly(ValueError, STRIDE_MSG.format(got)):
        do_write(write, ctx, make_write_plan([2], [-1]), flag=True)  # stride comes before the input-assert rule
    assert changes(ctx, before) == ["kernel_counter"] and int(ctx.kernel_run_counter[0]) == 1


@VERIFIES
def test_verify_stride_error_only_counters(verify, make_context, make_verify_plan):
    ctx = make_context(stride_bytes=16, sources=[narrow_source()], mode=RealKvHashMode.ALL)
    before = state(ctx)
    with exactly(ValueError, STRIDE_MSG.format(2)):
        verify(context=ctx, plan=make_verify_plan([0, 1, 2], [0, 0, 0], [-1, -1, -1]), check_verify_expected_token=True)
    assert changes(ctx, before) == ["slot_counter", "kernel_counter"]
    assert int(ctx.slot_run_counter[0]) == 3 and int(ctx.kernel_run_counter[0]) == 1


@WRITES
def test_write_row_width_not_multiple_of_8_is_an_error(write, make_context, make_write_plan):
    ctx = make_context(stride_bytes=36)
    with pytest.raises((ValueError, RuntimeError)):
        do_write(write, ctx, make_write_plan([2], [-1]))


@VERIFIES
def test_verify_row_width_not_multiple_of_8_is_an_error(verify, make_context, make_verify_plan):
    ctx = make_context(stride_bytes=36)
    with pytest.raises((ValueError, RuntimeError)):
        verify(context=ctx, plan=make_verify_plan([1], [0], [-1]), check_verify_expected_token=False)


# --------------------------------------------------------------------------- work gates: nothing validated
@WRITES
@pytest.mark.parametrize("num_valid, lengths", [(0, [2]), (1, [0]), (3, [0, 0, 0])])
def test_write_without_work_validates_nothing(write, num_valid, lengths, make_context, make_write_plan):
    src = narrow_source()
    ctx = make_context(stride_bytes=16, sources=[src], mode=RealKvHashMode.PARTIAL)
    before = state(ctx)
    plan = make_write_plan(lengths, [-1] * len(lengths), num_valid=num_valid)
    # bad stride, wrong input-assert tensors, narrow source: none of it is looked at
    do_write(write, ctx, plan, flag=True, tokens=None, positions=None)
    do_write(write, ctx, plan, flag=False, tokens=torch.arange(2), positions=torch.arange(2))
    assert changes(ctx, before) == ["kernel_counter"] and int(ctx.kernel_run_counter[0]) == 2


@VERIFIES
def test_verify_without_work_validates_nothing(verify, make_context, make_verify_plan):
    ctx = make_context(stride_bytes=16, sources=[narrow_source()], mode=RealKvHashMode.ALL)
    before = state(ctx)
    verify(context=ctx, plan=make_verify_plan([0, 0], [0, 0], [-1, -1]), check_verify_expected_token=True)
    verify(context=ctx, plan=make_verify_plan([5], [0], [-1], enable=0), check_verify_expected_token=True)
    verify(context=ctx, plan=make_verify_plan([5], [0], [-1], num_valid=0), check_verify_expected_token=True)
    assert changes(ctx, before) == ["slot_counter", "kernel_counter"]
    assert int(ctx.slot_run_counter[0]) == 2 and int(ctx.kernel_run_counter[0]) == 3


# --------------------------------------------------------------------------- input-assert rule
@WRITES
@pytest.mark.parametrize("which", ["both", "tokens", "positions"])
def test_input_assert_requires_both_tensors(write, which, make_context, make_write_plan):
    ctx = make_context(sources=[narrow_source()], mode=RealKvHashMode.PARTIAL)  # narrow checked after
    before = state(ctx)
    t = torch.arange(10, 12) if which == "positions" else None
    p = torch.arange(2) if which == "tokens" else None
    with exactly(ValueError, REQUIRED_MSG):
        do_write(write, ctx, make_write_plan([2], [-1]), flag=True, tokens=t, positions=p)
    assert changes(ctx, before) == ["kernel_counter"]


@WRITES
@pytest.mark.parametrize("which", ["both", "tokens", "positions"])
def test_input_assert_off_requires_none(write, which, make_context, make_write_plan):
    ctx = make_context(sources=[narrow_source()], mode=RealKvHashMode.ALL)
    before = state(ctx)
    t = torch.arange(10, 12) if which in ("both", "tokens") else None
    p = torch.arange(2) if which in ("both", "positions") else None
    with exactly(ValueError, MUST_BE_NONE_MSG):
        do_write(write, ctx, make_write_plan([2], [-1]), flag=False, tokens=t, positions=p)
    assert changes(ctx, before) == ["kernel_counter"]


# --------------------------------------------------------------------------- narrow rows
@WRITES
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
def test_write_narrow_rows_first_narrow_source(write, mode, make_context, make_source, make_write_plan):
    ok = make_source(num_slots=64, page_size=4, num_bytes_per_token=16)
    bad1 = narrow_source(page_size=4, nbpt=16, row_bytes=48, stride_pad=32)  # stride 80 bytes, width 48
    bad2 = narrow_source(page_size=2, nbpt=32, row_bytes=32, stride_pad=0)
    ctx = make_context(sources=[ok, bad1, bad2], mode=mode)
    before = state(ctx)
    with exactly(ValueError, narrow_msg(48, 4, 16)):
        do_write(write, ctx, make_write_plan([2], [-1]))
    assert changes(ctx, before) == ["kernel_counter"]


@WRITES
def test_write_narrow_rows_checked_even_if_every_entry_skipped(write, make_context, make_write_plan):
    ctx = make_context(sources=[narrow_source(dtype=torch.bfloat16)], mode=RealKvHashMode.PARTIAL)
    before = state(ctx)
    with exactly(ValueError, narrow_msg(48, 4, 16)):
        do_write(write, ctx, make_write_plan([2], [-1]), loc=[-1, -1])
    assert changes(ctx, before) == ["kernel_counter"]


def test_narrow_row_width_is_logical_columns_times_element_size(make_context, make_write_plan):
    t = torch.zeros(8, 2, 20, dtype=torch.float16)[:, :, :4]  # 3-D, row = 2 x 4 x 2 bytes = 16; stride 80
    src = RealKvSource(tensor=t, page_size=1, num_bytes_per_token=32, read_bytes=16)
    ctx = make_context(sources=[src], mode=RealKvHashMode.ALL)
    with exactly(ValueError, narrow_msg(16, 1, 32)):
        do_write(launch_canary_write_kernel_torch_reference, ctx, make_write_plan([2], [-1]))


@VERIFIES
def test_verify_narrow_rows_only_counters(verify, make_context, make_source, make_verify_plan):
    ok = make_source(num_slots=64, page_size=1, num_bytes_per_token=16)
    ctx = make_context(sources=[ok, narrow_source(page_size=16, nbpt=16, row_bytes=240, stride_pad=16)],
                       mode=RealKvHashMode.PARTIAL)
    before = state(ctx)
    with exactly(ValueError, narrow_msg(240, 16, 16)):
        verify(context=ctx, plan=make_verify_plan([0, 4], [0, 0], [-1, -1]), check_verify_expected_token=False)
    assert changes(ctx, before) == ["slot_counter", "kernel_counter"]


@WRITES
def test_none_mode_never_inspects_sources(write, make_context, make_write_plan):
    ctx = make_context(sources=[narrow_source()], mode=RealKvHashMode.NONE)
    do_write(write, ctx, make_write_plan([2], [-1]))
    assert int(ctx.slot_run_counter[0]) == 2
    assert ctx.canary_buf.view(torch.int64)[3:5, 3].tolist() == [0, 0]


# --------------------------------------------------------------------------- > 4 sources
def _five_sources(make_source, gen):
    return [make_source(num_slots=32, page_size=1 + (i % 2), num_bytes_per_token=16, generator=gen) for i in range(5)]


def test_launchers_reject_more_than_four_sources(make_context, make_source, gen, make_write_plan, make_verify_plan):
    msg = "kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, got 5"
    ctx = make_context(sources=_five_sources(make_source, gen), mode=RealKvHashMode.PARTIAL)
    before = state(ctx)
    with exactly(ValueError, msg):
        do_write(launch_canary_write_kernel, ctx, make_write_plan([2], [-1]))
    with exactly(ValueError, msg):
        launch_canary_verify_kernel(context=ctx, plan=make_verify_plan([3], [0], [-1]), check_verify_expected_token=False)
    # nothing modified, not even a counter — also without work and in NONE mode
    ctx_none = make_context(sources=_five_sources(make_source, gen), mode=RealKvHashMode.NONE)
    before_none = state(ctx_none)
    with exactly(ValueError, msg):
        do_write(launch_canary_write_kernel, ctx_none, make_write_plan([0], [-1]))
    with exactly(ValueError, msg):
        launch_canary_verify_kernel(context=ctx_none, plan=make_verify_plan([3], [0], [-1], enable=0),
                                    check_verify_expected_token=False)
    assert changes(ctx, before) == [] and changes(ctx_none, before_none) == []


def test_twins_do_not_count_sources(make_context, make_source, gen, make_write_plan, make_verify_plan):
    for mode in (RealKvHashMode.PARTIAL, RealKvHashMode.ALL):
        ctx = make_context(sources=_five_sources(make_source, gen), mode=mode)
        st = oracle.OracleCanary.of(ctx)
        do_write(launch_canary_write_kernel_torch_reference, ctx, make_write_plan([2], [-1]))
        f = ctx.canary_buf.view(torch.int64)
        assert f[3:5, 3].tolist() == [oracle.fingerprint(st.sources, mode, s) for s in (3, 4)]
        launch_canary_verify_kernel_torch_reference(
            context=ctx, plan=make_verify_plan([3, 4], [0, 1], [-1, 3]), check_verify_expected_token=False)
        assert int(ctx.violation_write_index[0]) == 0


# --------------------------------------------------------------------------- launcher argument checks
def _bad_kv_error(excinfo):
    assert str(excinfo.value).startswith("kv-canary: "), str(excinfo.value)


@pytest.mark.parametrize("field, value, exc", [
    ("input_ids", torch.tensor([1.0, 2.0]), TypeError),
    ("positions", torch.tensor([0, 1], dtype=torch.int16), TypeError),
    ("out_cache_loc", torch.tensor([3, 4, 5]), ValueError),
    ("out_cache_loc", torch.tensor([[3, 4]]), ValueError),
    ("input_ids", [1, 2], TypeError),
    ("input_ids", torch.empty(2, dtype=torch.int64, device="meta"), ValueError),
])
def test_write_launcher_checks_inputs(field, value, exc, make_context, make_write_plan):
    ctx = make_context()
    before = state(ctx)
    kwargs = dict(context=ctx, plan=make_write_plan([2], [-1]), input_ids=torch.tensor([1, 2]),
                  positions=torch.tensor([0, 1]), out_cache_loc=torch.tensor([3, 4]), enable_write_input_assert=False,
                  expected_input_tokens=None, expected_input_positions=None)
    kwargs[field] = value
    with pytest.raises(exc) as ei:
        launch_canary_write_kernel(**kwargs)
    _bad_kv_error(ei)
    assert changes(ctx, before) == []


@pytest.mark.parametrize("part", ["ring_dtype", "ring_shape", "index_dtype", "counter_dtype", "buf_dtype",
                                  "plan_dtype", "chain_flag_dtype", "plan_type"])
def test_verify_and_write_launchers_check_context_and_plan(part, make_context, make_verify_plan, make_write_plan):
    ctx = make_context()
    vp = make_verify_plan([3], [0], [-1])
    wp = make_write_plan([1], [-1])
    repl = {}
    if part == "ring_dtype":
        repl["violation_ring"] = torch.zeros(4, 8, dtype=torch.int32)
    elif part == "ring_shape":
        repl["violation_ring"] = torch.zeros(4, 7, dtype=torch.int64)
    elif part == "index_dtype":
        repl["violation_write_index"] = torch.zeros(1, dtype=torch.int64)
    elif part == "counter_dtype":
        repl["slot_run_counter"] = torch.zeros(1, dtype=torch.int32)
    elif part == "buf_dtype":
        repl["canary_buf"] = torch.zeros(8, 4, dtype=torch.int64)
    elif part == "chain_flag_dtype":
        repl["enable_chain_position_assert"] = torch.zeros(1, dtype=torch.int64)
    elif part == "plan_dtype":
        vp = VerifyPlan(**{**vars(vp), "verify_slot_indices": vp.verify_slot_indices.to(torch.int32)})
        wp = WritePlan(**{**vars(wp), "write_offsets": wp.write_offsets.to(torch.int32)})
    fields = {k: getattr(ctx, k) for k in ctx.__dataclass_fields__}
    fields.update(repl)
    bad = VerifyOrWriteContext(**fields)
    before = [t.clone() for t in (bad.canary_buf, bad.violation_ring, bad.violation_write_index,
                                  bad.slot_run_counter, bad.kernel_run_counter)]
    if part == "plan_type":
        vp, wp = wp, vp
    with pytest.raises((TypeError, ValueError)) as ei:
        launch_canary_verify_kernel(context=bad, plan=vp, check_verify_expected_token=False)
    _bad_kv_error(ei)
    with pytest.raises((TypeError, ValueError)) as ei:
        launch_canary_write_kernel(context=bad, plan=wp, input_ids=torch.tensor([1]), positions=torch.tensor([0]),
                                   out_cache_loc=torch.tensor([3]), enable_write_input_assert=False,
                                   expected_input_tokens=None, expected_input_positions=None)
    _bad_kv_error(ei)
    after = [bad.canary_buf, bad.violation_ring, bad.violation_write_index, bad.slot_run_counter, bad.kernel_run_counter]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


# --------------------------------------------------------------------------- plan
R2T = torch.tensor([[0, 0, 0, 0], [3, 12, 15, 4], [20, 30, 1, 2], [99, 98, 1, 2]], dtype=torch.int32)


def plan_outputs(vcap=8, wcap=4):
    vp, wp = VerifyPlan.allocate(vcap, "cpu"), WritePlan.allocate(wcap, "cpu")
    for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
              vp.verify_prev_slot_indices, wp.write_offsets, wp.write_seed_slot_indices):
        t.copy_(torch.arange(t.numel()) * 7 - 3)
    vp.verify_num_valid.fill_(5)
    vp.enable.fill_(3)
    wp.write_num_valid_reqs.fill_(-2)
    return vp, wp


def nine(vp, wp):
    return [t.clone() for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
                                vp.verify_prev_slot_indices, vp.verify_num_valid, vp.enable, wp.write_offsets,
                                wp.write_seed_slot_indices, wp.write_num_valid_reqs)]


def run_plan(plan_op, vp, wp, rp, prefix, extend, *, W=0, lut=None, cap=None, tokens=None, valid=None, r2t=R2T):
    plan_op(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor(rp),
            prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(extend), req_to_token=r2t,
            swa_window_size=W, full_to_swa_index_mapping=lut,
            verify_capacity=vp.verify_slot_indices.shape[0] if cap is None else cap,
            req_to_verify_expected_tokens=tokens, req_to_verify_expected_tokens_valid_lens=valid,
            kv_token_id_vs_position_offset=0)


def plan_msg(plan_op, tail):
    if plan_op is launch_canary_plan_kernels_torch_reference:
        return "^" + re.escape(f"kv-canary: {TWIN} {tail}") + "$"
    return "^" + re.escape("kv-canary: ") + f"({TWIN}|launch_canary_plan_kernels) " + re.escape(tail) + "$"


@PLANS
def test_plan_capacity_mismatch(plan_op):
    vp, wp = plan_outputs(vcap=8)
    before = nine(vp, wp)
    with pytest.raises(ValueError, match=plan_msg(
            plan_op, "verify_capacity=7 does not match verify_plan_out.verify_slot_indices.shape[0]=8")):
        # capacity comes first, before the missing valid lengths
        run_plan(plan_op, vp, wp, [1], [2], [1], cap=7, tokens=torch.zeros(4, 4, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(nine(vp, wp), before))


@PLANS
def test_plan_table_without_valid_lens_even_without_reads(plan_op):
    vp, wp = plan_outputs()
    before = nine(vp, wp)
    with pytest.raises(ValueError, match=plan_msg(
            plan_op, "requires req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set")):
        run_plan(plan_op, vp, wp, [0], [0], [0], tokens=torch.zeros(4, 4, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(nine(vp, wp), before))


def lut_msg(slot, n):
    return f"kv-canary: SWA slot {slot} is outside full_to_swa_index_mapping length {n}"


LUT10 = torch.arange(100, 110, dtype=torch.int64)


@PLANS
@pytest.mark.parametrize("rp, prefix, W, bad", [
    ([1], [4], 0, 12),            # position 1's slot
    ([2], [2], 1, 30),            # window [1, 2): the slot (30) before its predecessor (20)
    ([1, 2], [1, 2], 1, 30),      # second row
    ([3], [4], 3, 98),            # window head's predecessor is looked up (position 0 is not)
    ([1], [2], 1, 12),            # window [1, 2): slot 12 is past the LUT
])
def test_plan_lut_errors_first_lookup_in_gather_order(plan_op, rp, prefix, W, bad):
    vp, wp = plan_outputs()
    before = nine(vp, wp)
    with exactly(ValueError, lut_msg(bad, 10)):
        run_plan(plan_op, vp, wp, rp, prefix, [1] * len(rp), W=W, lut=LUT10)
    assert all(torch.equal(a, b) for a, b in zip(nine(vp, wp), before))


@PLANS
def test_plan_lut_predecessor_error_when_slot_fine(plan_op):
    r2t = torch.tensor([[0, 0, 0], [15, 4, 5]], dtype=torch.int32)
    vp, wp = plan_outputs()
    with exactly(ValueError, lut_msg(15, 10)):
        run_plan(plan_op, vp, wp, [1], [2], [0], W=1, lut=LUT10, r2t=r2t)


@PLANS
def test_plan_lut_length_itself_is_out_of_range(plan_op):
    r2t = torch.tensor([[0, 0], [9, 10]], dtype=torch.int32)
    vp, wp = plan_outputs()
    with exactly(ValueError, lut_msg(10, 10)):
        run_plan(plan_op, vp, wp, [1], [2], [0], lut=LUT10, r2t=r2t)


@PLANS
def test_plan_lut_error_even_when_overflowing(plan_op):
    vp, wp = plan_outputs(vcap=1)
    before = nine(vp, wp)
    with exactly(ValueError, lut_msg(12, 10)):
        run_plan(plan_op, vp, wp, [1], [4], [1], lut=LUT10)
    assert all(torch.equal(a, b) for a, b in zip(nine(vp, wp), before))


@PLANS
def test_plan_lut_values_never_looked_up_are_not_checked(plan_op):
    r2t = torch.tensor([[50, 60, 70, 80], [99, 5, 1, 2], [-1, 3, 0, 0]], dtype=torch.int32)
    vp, wp = plan_outputs()
    # padding row 0 (huge values), row 1 position 0 outside the window and not a predecessor
    run_plan(plan_op, vp, wp, [0, 1, 2], [4, 4, 2], [1, 1, 1], W=2, lut=LUT10, r2t=r2t)
    n = int(vp.verify_num_valid[0])
    assert vp.verify_slot_indices[:n].tolist() == [101, 102, -1, 103]
    assert vp.verify_prev_slot_indices[:n].tolist() == [105, 101, -1, -1]
    assert wp.write_seed_slot_indices.tolist()[:3] == [-1, 102, 103]


def test_plan_launcher_requires_lut_with_window():
    vp, wp = plan_outputs()
    before = nine(vp, wp)
    with exactly(ValueError, "kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when swa_window_size > 0"):
        run_plan(launch_canary_plan_kernels, vp, wp, [1], [2], [1], W=2)
    assert all(torch.equal(a, b) for a, b in zip(nine(vp, wp), before))
    run_plan(launch_canary_plan_kernels_torch_reference, vp, wp, [1], [2], [1], W=2)  # the twin never raises it
    assert int(vp.verify_num_valid[0]) == 2


@pytest.mark.parametrize("change, exc", [
    (dict(req_to_token=R2T.to(torch.int64)), TypeError),
    (dict(req_pool_indices=torch.tensor([1.0])), TypeError),
    (dict(prefix_lens=torch.tensor([2, 2])), ValueError),
    (dict(full_to_swa_index_mapping=LUT10.to(torch.int32)), TypeError),
    (dict(req_to_verify_expected_tokens=torch.zeros(4, 4, dtype=torch.int64),
          req_to_verify_expected_tokens_valid_lens=torch.tensor([4])), TypeError),
    (dict(extend_seq_lens=torch.empty(1, dtype=torch.int64, device="meta")), ValueError),
])
def test_plan_launcher_checks_arguments(change, exc):
    vp, wp = plan_outputs()
    before = nine(vp, wp)
    kwargs = dict(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor([1]),
                  prefix_lens=torch.tensor([2]), extend_seq_lens=torch.tensor([1]), req_to_token=R2T,
                  swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=8,
                  req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
                  kv_token_id_vs_position_offset=0)
    kwargs.update(change)
    with pytest.raises(exc) as ei:
        launch_canary_plan_kernels(**kwargs)
    _bad_kv_error(ei)
    assert all(torch.equal(a, b) for a, b in zip(nine(vp, wp), before))


# --------------------------------------------------------------------------- scatter
def scatter_args(**change):
    args = dict(flat_in=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 3]), req_pool_indices=torch.tensor([1]),
                pool_out=torch.zeros(2, 4, dtype=torch.int32))
    args.update(change)
    return args


@pytest.mark.parametrize("change, exc, msg", [
    (dict(flat_in=torch.zeros(3, 1, dtype=torch.int64)), ValueError,
     "kv-canary: scatter_req_token_ids flat_in must be 1-D, got shape (3, 1)"),
    (dict(offsets=torch.zeros(1, 2, dtype=torch.int64)), ValueError,
     "kv-canary: scatter_req_token_ids offsets must be 1-D, got shape (1, 2)"),
    (dict(req_pool_indices=torch.tensor(1)), ValueError,
     "kv-canary: scatter_req_token_ids req_pool_indices must be 1-D, got shape ()"),
    (dict(pool_out=torch.zeros(8, dtype=torch.int32)), ValueError,
     "kv-canary: scatter_req_token_ids pool_out must be 2-D, got shape (8,)"),
    # rank before dtype
    (dict(flat_in=torch.zeros(3, 1, dtype=torch.int32)), ValueError,
     "kv-canary: scatter_req_token_ids flat_in must be 1-D, got shape (3, 1)"),
    (dict(flat_in=torch.tensor([1, 2, 3], dtype=torch.int32)), TypeError,
     "kv-canary: scatter_req_token_ids flat_in must be int64, got torch.int32"),
    (dict(offsets=torch.tensor([0, 3], dtype=torch.int32)), TypeError,
     "kv-canary: scatter_req_token_ids offsets must be int64, got torch.int32"),
    (dict(req_pool_indices=torch.tensor([1.0])), TypeError,
     "kv-canary: scatter_req_token_ids req_pool_indices must be int64, got torch.float32"),
    (dict(pool_out=torch.zeros(2, 4, dtype=torch.int64)), TypeError,
     "kv-canary: scatter_req_token_ids pool_out must be int32, got torch.int64"),
    # dtype before the offsets length
    (dict(offsets=torch.tensor([0, 3, 3], dtype=torch.int32)), TypeError,
     "kv-canary: scatter_req_token_ids offsets must be int64, got torch.int32"),
    (dict(offsets=torch.tensor([0, 3, 3])), ValueError,
     "kv-canary: scatter_req_token_ids offsets length 3 != bs+1 (2)"),
    (dict(offsets=torch.tensor([0]), req_pool_indices=torch.tensor([1, 1])), ValueError,
     "kv-canary: scatter_req_token_ids offsets length 1 != bs+1 (3)"),
])
def test_scatter_launcher_errors(change, exc, msg):
    args = scatter_args(**change)
    pool_before = args["pool_out"].clone()
    with exactly(exc, msg):
        launch_scatter_req_token_ids_kernel(**args)
    assert torch.equal(args["pool_out"], pool_before)


def test_scatter_twin_does_not_validate():
    pool = torch.zeros(2, 4, dtype=torch.int32)
    scatter_req_token_ids_torch_reference(flat_in=torch.tensor([5, 6], dtype=torch.int32),
                                          offsets=torch.tensor([0, 2], dtype=torch.int32),
                                          req_pool_indices=torch.tensor([1], dtype=torch.int32), pool_out=pool)
    assert pool.tolist() == [[0, 0, 0, 0], [5, 6, 0, 0]]


# --------------------------------------------------------------------------- data structures: frozen, keyword-only
def test_records_are_frozen_keyword_only_without_defaults(make_context):
    import dataclasses

    ctx = make_context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.kernel_kind = 3
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
    assert list(fields) == ["canary_buf", "kernel_kind", "violation_ring", "violation_write_index", "slot_run_counter",
                            "kernel_run_counter", "real_kv_sources", "real_kv_hash_mode", "enable_chain_position_assert"]
    with pytest.raises(TypeError):
        VerifyOrWriteContext(*fields.values())
    for name in fields:
        with pytest.raises(TypeError):
            VerifyOrWriteContext(**{k: v for k, v in fields.items() if k != name})
    src = RealKvSource(tensor=torch.zeros(2, 16, dtype=torch.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        src.page_size = 2
    with pytest.raises(TypeError):
        RealKvSource(torch.zeros(2, 16, dtype=torch.uint8), 1, 16, 16)
    vp, wp = VerifyPlan.allocate(2, "cpu"), WritePlan.allocate(2, "cpu")
    assert [f.name for f in dataclasses.fields(vp)] == [
        "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
        "verify_num_valid", "enable"]
    assert [f.name for f in dataclasses.fields(wp)] == ["write_offsets", "write_seed_slot_indices", "write_num_valid_reqs"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        vp.enable = None
