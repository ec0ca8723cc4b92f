"""Triton kernels vs the torch twins under the Triton interpreter (CPU, TRITON_INTERPRET=1).

The Triton launchers are called directly with CPU tensors; the interpreter runs the same kernel
code the GPU compiles. Hand cases pin the tricky paths (intra-launch aliasing, ring overflow,
plan overflow, LUT errors, lazy errors); a seeded fuzz compares every op to its twin.
"""
from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    import pytest

    # tests/conftest.py sets it on machines without a GPU; on a GPU host run tests/gpu instead.
    pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")


def _numpy_scalar_index_fix() -> None:
    """Triton 3.6's interpreter turns scalars into Python ints with ``int(array)``; numpy >= 2.4
    refuses that for the 1-element arrays the interpreter keeps, so loop bounds read from memory
    fail. Re-patch ``__index__`` to take the single element."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if getattr(interpreter._patch_lang_tensor, "__name__", "") != "patched":
        interpreter._patch_lang_tensor = patched


_numpy_scalar_index_fix()

import functools  # noqa: E402

from kvcanary.ops import (  # noqa: E402
    RealKvHashMode,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel_torch_reference,
    scatter_req_token_ids_torch_reference,
    stamp_violation_rows_torch_reference,
)
from kvcanary.ops.records import VerifyPlan, WritePlan  # noqa: E402
from kvcanary.ops.triton import launch_plan, launch_scatter, launch_stamp, launch_verify, launch_write  # noqa: E402
from kvcanary.ops.triton.plan import PlanLaunchConfig  # noqa: E402
from kvcanary.ops.triton.write import WriteLaunchConfig  # noqa: E402

from .test_stamp import SCENARIOS as STAMP_SCENARIOS, fuzz_stamp_args  # noqa: E402
from .triton_cases import (  # noqa: E402
    assert_same_state,
    clone_context,
    context_state,
    make_case,
    make_context,
    make_source,
    many_requests_write,
    run_plan,
    write_inputs,
    write_plan,
)


_WRITE_PATHS = (WriteLaunchConfig(), WriteLaunchConfig(small_lanes=0))
"""The single-CTA kernel (small launches, the default for these sizes) and the two-kernel path."""


def _compare_write(ctx, wp, config=None, **kw):
    for cfg in (config,) if config is not None else _WRITE_PATHS:
        before = context_state(ctx)
        a, b = clone_context(ctx), clone_context(ctx)
        errs = []
        for impl, c in ((launch_canary_write_kernel_torch_reference, a), (functools.partial(launch_write, config=cfg), b)):
            try:
                impl(context=c, plan=wp, **kw)
                errs.append(None)
            except ValueError as e:
                errs.append(str(e))
        assert errs[0] == errs[1]
        assert_same_state(before, context_state(a), context_state(b))
        _check_overflow_subset(ctx, wp, kw, launch_canary_write_kernel_torch_reference, context_state(b), before)
    return a, b


def _compare_verify(ctx, vp, check):
    before = context_state(ctx)
    a, b = clone_context(ctx), clone_context(ctx)
    errs = []
    for impl, c in ((launch_canary_verify_kernel_torch_reference, a), (launch_verify, b)):
        try:
            impl(context=c, plan=vp, check_verify_expected_token=check)
            errs.append(None)
        except ValueError as e:
            errs.append(str(e))
    assert errs[0] == errs[1]
    assert_same_state(before, context_state(a), context_state(b))
    return a, b


def _check_overflow_subset(ctx, wp, kw, twin, fast_state, before):
    """When the ring filled within the launch, the fast path's kept rows are violations the twin
    records in a ring large enough for all of them."""
    cap = ctx.violation_ring.shape[0]
    if fast_state["index"] <= cap:
        return
    big = clone_context(ctx)
    big = type(big)(**{**big.__dict__, "violation_ring": torch.full((fast_state["index"] + 8, 8), -77, dtype=torch.int64)})
    twin(context=big, plan=wp, **kw)
    all_rows = set(map(tuple, big.violation_ring[: int(big.violation_write_index[0])].tolist()))
    lo = min(max(before["index"], 0), cap)
    kept = set(map(tuple, fast_state["ring"][lo:cap].tolist()))
    assert kept <= all_rows


# --------------------------------------------------------------------------- hand cases


def _ctx(num_slots=16, **kw):
    g = torch.Generator().manual_seed(7)
    args = dict(num_slots=num_slots, stride_bytes=32, ring_cap=16, sources=(), mode=RealKvHashMode.NONE,
                chain_assert=1, kind=2)
    args.update(kw)
    return make_context(g, "cpu", **args)


def test_write_pinned_chain_and_parallel_requests():
    ctx = _ctx()
    _a, b = _compare_write(ctx, write_plan([3, 1, 1], [-1, -1, 9]), **write_inputs([10, 20, 30, 7, 8], [0, 1, 2, 0, 5], [3, 4, 5, 6, 7]))
    f = b.canary_buf.view(torch.int64)
    assert [hex(v & (2**64 - 1)) for v in f[3:6, 2].tolist()] == ["0xde7fae23a9a1b716", "0xcd6d3fc64ab68b75", "0x2c17d4bb20b967a5"]


def test_write_seed_stored_earlier_in_launch_and_duplicate_slots():
    ctx = _ctx()
    # Request 1 seeds from slot 5, stored by request 0; slot 4 is stored twice (last wins).
    _compare_write(ctx, write_plan([3, 2, 2], [-1, 5, 4]), **write_inputs([1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 9, 9], [4, 5, 4, 8, 9, 10, -1]))


def test_write_long_request_many_chunks_with_skips():
    ctx = _ctx(num_slots=200)
    n = 150
    loc = list(range(1, n + 1))
    loc[40] = -1
    loc[77] = -3
    _compare_write(ctx, write_plan([n], [199]), **write_inputs(list(range(1000, 1000 + n)), list(range(n)), loc))


@pytest.mark.parametrize("config", [
    WriteLaunchConfig(chain_programs_per_sm=1, small_lanes=0),  # 4 chain programs: many requests each
    WriteLaunchConfig(chain_programs_per_sm=1, chunk=16, unroll=2, prep_block=64, small_lanes=0),
    WriteLaunchConfig(),                                          # one CTA, 256 lanes
])
def test_write_many_requests_per_program(config):
    """Over 32 one-token requests per chain program (the lane loop runs twice) mixed with long
    requests and chain-position rows; then the same with an aliasing seed (serial mode)."""
    ctx = _ctx(num_slots=512, ring_cap=1024)
    for aliased in (False, True):  # then request 120 seeds from a slot request 3 stores: serial mode
        wp, kw = many_requests_write(aliased)
        _compare_write(ctx, wp, config=config, **kw)


def test_write_input_assert_and_ring_overflow():
    ctx = _ctx(ring_cap=3)
    kw = write_inputs([1, 2, 3, 4], [5, 6, 8, 9], [1, 2, 3, 4])
    kw.update(enable_write_input_assert=True, expected_input_tokens=torch.tensor([1, 0, 3, 0]),
              expected_input_positions=torch.tensor([5, 6, 7, 0]))
    _compare_write(ctx, write_plan([4], [9]), **kw)


def test_write_no_work_and_lazy_errors():
    ctx = _ctx(stride_bytes=24)
    wp = write_plan([2], [-1])
    wp.write_num_valid_reqs[0] = 0
    _compare_write(ctx, wp, **write_inputs([1, 2], [0, 1], [1, 2]))  # no work: only the kernel counter
    wp.write_num_valid_reqs[0] = 1
    _a, b = _compare_write(ctx, wp, **write_inputs([1, 2], [0, 1], [1, 2]))  # raises, counter bumped
    kw = write_inputs([1, 2], [0, 1], [1, 2])
    kw["enable_write_input_assert"] = True
    _compare_write(_ctx(), wp, **kw)


def test_verify_chain_position_token_and_real_kv():
    g = torch.Generator().manual_seed(3)
    src = make_source(g, "cpu", num_slots=16, page_size=4, nbpt=32, read_bytes=32, dtype=torch.bfloat16)
    for mode in RealKvHashMode:
        ctx = _ctx(sources=(src,), mode=mode)
        wctx = clone_context(ctx)
        launch_canary_write_kernel_torch_reference(context=wctx, plan=write_plan([4], [-1]), **write_inputs([5, 6, 7, 8], [0, 1, 2, 3], [1, 2, 3, 4]))
        wctx.canary_buf.view(torch.int64)[3, 0] += 1  # token flip at slot 3
        vp = VerifyPlan.allocate(8, "cpu")
        vp.verify_slot_indices[:6] = torch.tensor([1, 2, 3, 4, 0, 9])
        vp.verify_prev_slot_indices[:6] = torch.tensor([-1, 1, 2, 3, 0, 0])
        vp.verify_expected_positions[:6] = torch.tensor([0, 1, 2, 4, 0, 0])
        vp.verify_expected_tokens[:6] = torch.tensor([5, 6, 7, 8, -1, 3])
        vp.verify_num_valid[0] = 6
        for check in (False, True):
            _compare_verify(wctx, vp, check)


@pytest.mark.parametrize("nbpt", [128, 144, 208, 1024])
def test_all_mode_long_rows_fold_in_a_loop_bit_identically(nbpt):
    """ALL mode over rows longer than the unrolled limit (16, 18, 26 and 128 words per token: a real model's layer;
    18 and 26 leave pairs after the loop's groups of eight words) takes the looped fold; write and verify match the twins, and a flipped byte deep in a row is seen."""
    g = torch.Generator().manual_seed(nbpt)
    srcs = tuple(make_source(g, "cpu", num_slots=16, page_size=4, nbpt=nbpt, read_bytes=nbpt, dtype=torch.bfloat16)
                 for _ in range(2))
    ctx = _ctx(sources=srcs, mode=RealKvHashMode.ALL)
    wp, kw = write_plan([4], [-1]), write_inputs([5, 6, 7, 8], [0, 1, 2, 3], [1, 2, 3, 4])
    _compare_write(ctx, wp, **kw)
    launch_canary_write_kernel_torch_reference(context=ctx, plan=wp, **kw)
    srcs[1].tensor.view(torch.uint8)[0, 3 * nbpt - 5] ^= 0x10  # slot 2 (page 0, offset 2): 5 bytes before its end
    vp = VerifyPlan.allocate(8, "cpu")
    vp.verify_slot_indices[:4] = torch.tensor([1, 2, 3, 4])
    vp.verify_prev_slot_indices[:4] = torch.tensor([-1, 1, 2, 3])
    vp.verify_expected_positions[:4] = torch.tensor([0, 1, 2, 3])
    vp.verify_num_valid[0] = 4
    _compare_verify(ctx, vp, False)
    b = clone_context(ctx)
    launch_verify(context=b, plan=vp, check_verify_expected_token=False)
    assert int(b.violation_write_index[0]) - int(ctx.violation_write_index[0]) == 1


@pytest.mark.parametrize("words", [2, 6, 8, 30, 64, 256])
def test_lanes_mode_strip_widths_bit_identical(words):
    """LANES mode (the deep fingerprints' parallel fold) over strips of 2-256 words — one tile narrower than, as wide
    as, or several times LANES_CH, columns past the strip masked for 6 and 30 words — on pages of 1, 4 or 16 slots,
    with padding, out-of-range and disabled entries: write (both paths) and verify match the twins, the two
    contexts of one verify launch too, and one flipped bit is seen wherever it lies in a strip."""
    from kvcanary.ops.triton.verify import launch_verify_many

    for page_size in (1, 4, 16):
        g = torch.Generator().manual_seed(1000 * words + page_size)
        srcs = tuple(make_source(g, "cpu", num_slots=48, page_size=page_size, nbpt=8 * words, read_bytes=8 * words,
                                 dtype=torch.bfloat16, pad_bytes=16 * (page_size == 4)) for _ in range(1 + page_size % 4))
        ctx = _ctx(num_slots=48, sources=srcs, mode=RealKvHashMode.LANES, ring_cap=64)
        slots = [3, 17, 40, 9, 0, 41, 60]  # slot 0: padding; 60: past the buffer (not stored)
        wp, kw = write_plan([4, 3], [-1, 5]), write_inputs([5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6], slots)
        _compare_write(ctx, wp, **kw)
        launch_canary_write_kernel_torch_reference(context=ctx, plan=wp, **kw)
        vp = VerifyPlan.allocate(16, "cpu")
        n = 8
        vp.verify_slot_indices[:n] = torch.tensor([3, 17, 40, 9, 0, 41, 60, 12])
        vp.verify_prev_slot_indices[:n] = torch.tensor([-1, 3, 17, 5, 0, 9, 0, 0])
        vp.verify_expected_positions[:n] = torch.tensor([0, 1, 2, 4, 0, 5, 6, 0])
        vp.verify_expected_tokens[:n] = -1
        vp.verify_num_valid[0] = n
        _compare_verify(ctx, vp, False)
        vp.enable[0] = 0
        _compare_verify(ctx, vp, False)
        vp.enable[0] = 1
        twin = clone_context(ctx)
        launch_canary_verify_kernel_torch_reference(context=twin, plan=vp, check_verify_expected_token=False)
        for bit in (0, 8 * 8 * words - 1, int(torch.randint(0, 64 * words, (1,), generator=g))):  # first, last, any
            src = srcs[int(torch.randint(0, len(srcs), (1,), generator=g))]
            s = slots[int(torch.randint(0, 3, (1,), generator=g))]  # a slot that verifies clean
            byte = (s % page_size) * 8 * words + bit // 8
            row = src.tensor[s // page_size].view(torch.uint8)
            row[byte] ^= 1 << (bit % 8)
            a, b = clone_context(ctx), clone_context(ctx)
            launch_verify_many(contexts=[a, b], plan=vp, check_verify_expected_token=False)
            c = clone_context(ctx)
            launch_canary_verify_kernel_torch_reference(context=c, plan=vp, check_verify_expected_token=False)
            i0, i1 = int(ctx.violation_write_index[0]), int(c.violation_write_index[0])
            kv_rows = lambda x: [r[1] for r in x.violation_ring[i0:i1].tolist() if r[7] & 4]  # noqa: E731
            assert i1 - int(twin.violation_write_index[0]) == 1 and sorted(kv_rows(c)) == sorted(kv_rows(twin) + [s])
            for x in (a, b):
                assert torch.equal(x.violation_write_index, c.violation_write_index)
                assert sorted(map(tuple, x.violation_ring.tolist())) == sorted(map(tuple, c.violation_ring.tolist()))
            row[byte] ^= 1 << (bit % 8)


def test_verify_disabled_and_narrow_source_error():
    g = torch.Generator().manual_seed(4)
    src = make_source(g, "cpu", num_slots=16, page_size=4, nbpt=32, read_bytes=32, dtype=torch.uint8)
    narrow = type(src)(tensor=src.tensor[:, :64], page_size=4, num_bytes_per_token=32, read_bytes=32)
    vp = VerifyPlan.allocate(4, "cpu")
    vp.verify_slot_indices.copy_(torch.tensor([1, 2, 0, 0]))
    vp.verify_prev_slot_indices.copy_(torch.tensor([-1, 1, 0, 0]))
    vp.verify_expected_positions.zero_()
    vp.verify_expected_tokens.fill_(-1)
    vp.verify_num_valid[0] = 2
    _compare_verify(_ctx(sources=(narrow,), mode=RealKvHashMode.PARTIAL), vp, False)
    _compare_verify(_ctx(sources=(narrow,), mode=RealKvHashMode.NONE), vp, False)
    vp.enable[0] = 0
    _compare_verify(_ctx(sources=(narrow,), mode=RealKvHashMode.PARTIAL), vp, False)


def test_plan_lut_error_leaves_outputs_and_overflow():
    for seed in range(40):
        case = make_case(seed, window=4)
        if case.plan_kwargs["full_to_swa_index_mapping"] is None:
            continue
        lut = case.plan_kwargs["full_to_swa_index_mapping"]
        case.plan_kwargs["full_to_swa_index_mapping"] = lut[: max(1, lut.shape[0] // 2)]
        twin, err_t, _ = run_plan(launch_canary_plan_kernels_torch_reference, case)
        fast, err_f, _ = run_plan(launch_plan, case)
        assert err_t == err_f
        for x, y in zip(twin, fast):
            assert torch.equal(x, y)


@pytest.mark.parametrize("config", [
    PlanLaunchConfig(tile_rows=0), PlanLaunchConfig(check_lut=False), PlanLaunchConfig(check_lut=False, tile_block=16),
])
@pytest.mark.parametrize("seed", range(12))
def test_plan_paths(seed, config):
    """The multi-launch path for small batches too, and the one-launch path with a LUT (what runs
    under graph capture: no host-read range check; the fuzz LUT values are in range)."""
    case = make_case(seed, window=[0, 3][seed % 2])
    if config.check_lut is False and case.plan_kwargs["full_to_swa_index_mapping"] is None:
        case.plan_kwargs["full_to_swa_index_mapping"] = torch.randperm(256)[: 200] + 1
    twin, err_t, _ = run_plan(launch_canary_plan_kernels_torch_reference, case)
    fast, err_f, _ = run_plan(functools.partial(launch_plan, config=config), case)
    assert err_t == err_f
    for x, y in zip(twin, fast):
        assert torch.equal(x, y), (x, y)


def _compare_stamp(kw):
    cap = kw["violation_ring"].shape[0]
    a = torch.full((cap, 3), -55, dtype=torch.int64)
    b = a.clone()
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    stamp_violation_rows_torch_reference(stamps=a, **kw)
    launch_stamp(stamps=b, **kw)
    assert torch.equal(a, b), (a, b)
    for k, v in before.items():
        assert torch.equal(kw[k], v), k
    return a


@pytest.mark.parametrize("name", sorted(STAMP_SCENARIOS))
def test_stamp_scenarios(name):
    kw, _want = STAMP_SCENARIOS[name]()
    _compare_stamp(kw)


@pytest.mark.parametrize("seed", range(16))
def test_fuzz_stamp(seed):
    """Plan -> verify -> write on a fuzz case (random buffer: many rows, ring overflow at times),
    then stamps; rows_from sometimes past the start; plans sometimes missing."""
    kw = fuzz_stamp_args(seed, (seed // 3) % 3, 1000 + seed, rows_from_shift=2 if seed % 4 == 1 else 0)
    if seed % 5 == 2:
        kw.update(write_plan=None, out_cache_loc=None, positions=None)
    if seed % 5 == 3:
        kw.update(verify_plan=None, req_pool_indices=None, prefix_lens=None)
    _compare_stamp(kw)


def test_scatter_later_row_wins():
    pool_a = torch.full((4, 5), -1, dtype=torch.int32)
    pool_b = pool_a.clone()
    kw = dict(flat_in=torch.arange(100, 112), offsets=torch.tensor([0, 4, 6, 12, 12]), req_pool_indices=torch.tensor([1, 1, 2, 3]))
    scatter_req_token_ids_torch_reference(pool_out=pool_a, **kw)
    launch_scatter(pool_out=pool_b, **kw)
    assert torch.equal(pool_a, pool_b)


# --------------------------------------------------------------------------- seeded fuzz


@pytest.mark.parametrize("seed", range(24))
def test_fuzz_plan_write_verify(seed):
    case = make_case(seed, mode=seed % 3, nsrc=(seed // 3) % 5)
    twin, err_t, (vp, wp) = run_plan(launch_canary_plan_kernels_torch_reference, case)
    fast, err_f, _ = run_plan(launch_plan, case)
    assert err_t == err_f
    for x, y in zip(twin, fast):
        assert torch.equal(x, y), (x, y)
    if err_t is not None:
        return
    kw = case.write_kwargs
    a, _b = _compare_write(case.ctx, wp, **kw)
    # Verify the written buffer (twin's), with a few corrupted fields.
    written = clone_context(a)
    f = written.canary_buf.view(torch.int64)
    g = torch.Generator().manual_seed(seed)
    bad = torch.randint(0, f.shape[0], (3,), generator=g)
    f[bad, torch.randint(0, 4, (3,), generator=g)] ^= 1
    for check in (False, True):
        _compare_verify(written, vp, check)


@pytest.mark.parametrize("seed", range(6))
def test_fuzz_scatter(seed):
    g = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(0, 6, (1,), generator=g))
    lens = torch.randint(0, 9, (bs,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    flat = torch.randint(-(2**40), 2**40, (int(offsets[-1]) + 2,), generator=g)
    rp = torch.randint(0, 4, (bs,), generator=g)
    pool_a = torch.randint(-9, 9, (4, 6), generator=g).to(torch.int32)
    pool_b = pool_a.clone()
    scatter_req_token_ids_torch_reference(flat_in=flat, offsets=offsets, req_pool_indices=rp, pool_out=pool_a)
    launch_scatter(flat_in=flat, offsets=offsets, req_pool_indices=rp, pool_out=pool_b)
    assert torch.equal(pool_a, pool_b)


@pytest.mark.parametrize("config", [PlanLaunchConfig(), PlanLaunchConfig(tile_rows=0), PlanLaunchConfig(check_lut=False)])
@pytest.mark.parametrize("window", [0, 4])
def test_plan_ignores_padding_rows_whatever_their_lengths(config, window):
    """CUDA-graph padding leaves arbitrary prefix / extend lengths in request row 0's batch rows: the plan
    ignores them (no lookup, no entries, no writes) — twin and kernel alike, and the same bytes."""
    table = torch.zeros(4, 16, dtype=torch.int32)
    table[1, :6] = torch.arange(1, 7, dtype=torch.int32)
    table[2, :4] = torch.arange(7, 11, dtype=torch.int32)
    lut = torch.arange(64, dtype=torch.int64) if window else None
    outs = []
    for fn in (launch_canary_plan_kernels_torch_reference, functools.partial(launch_plan, config=config)):
        vp, wp = VerifyPlan.allocate(32, "cpu"), WritePlan.allocate(6, "cpu")
        for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
                  vp.verify_prev_slot_indices, wp.write_offsets, wp.write_seed_slot_indices):
            t.fill_(-7)
        fn(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor([1, 0, 2, 0, 0]),
           prefix_lens=torch.tensor([4, 10_000, 3, -9, 2**40]), extend_seq_lens=torch.tensor([2, 500, 1, 3, -4]),
           req_to_token=table, swa_window_size=window, full_to_swa_index_mapping=lut, verify_capacity=32,
           req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
           kv_token_id_vs_position_offset=0)
        outs.append([vp.verify_slot_indices, vp.verify_expected_positions, vp.verify_prev_slot_indices,
                     vp.verify_num_valid, vp.enable, wp.write_offsets, wp.write_seed_slot_indices, wp.write_num_valid_reqs])
    for x, y in zip(*outs):
        assert torch.equal(x, y), (x, y)
    n = int(outs[0][3][0])
    assert n == (min(4, window) + min(3, window) if window else 7)
    assert outs[0][5][:6].tolist() == [0, 2, 2, 3, 3, 3]  # padding rows add no writes
    assert outs[0][6][:5].tolist()[1::2] == [-1, -1]  # and get no seed
