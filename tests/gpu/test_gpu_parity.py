"""Triton kernels vs the torch twins on a real CUDA device, at realistic sizes.

Bit-identical canary buffers, counters, write index and violation sets (as multisets); a CUDA
graph of plan -> write -> verify replayed with new inputs; repeated runs identical.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kvcanary.ops import (  # noqa: E402
    RealKvHashMode,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
    launch_scatter_req_token_ids_kernel,
    launch_stamp_violation_rows,
    scatter_req_token_ids_torch_reference,
    stamp_violation_rows_torch_reference,
)
from kvcanary.ops.records import VerifyPlan, WritePlan  # noqa: E402
from kvcanary.ops.triton import launch_plan, launch_stamp, launch_verify, launch_write  # noqa: E402
from kvcanary.ops.triton.plan import PlanLaunchConfig  # noqa: E402
from kvcanary.ops.triton.verify import VerifyLaunchConfig  # noqa: E402
from kvcanary.ops.triton.write import WriteLaunchConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ops.test_stamp import SCENARIOS as STAMP_SCENARIOS  # noqa: E402
from ops.triton_cases import (  # noqa: E402
    assert_same_state,
    clone_context,
    context_state,
    make_case,
    make_context,
    make_source,
    plan_state,
    run_plan,
)

DEV = "cuda"


def _write_both(ctx, wp, **kw):
    before = context_state(ctx)
    a, b = clone_context(ctx), clone_context(ctx)
    launch_canary_write_kernel_torch_reference(context=a, plan=wp, **kw)
    launch_canary_write_kernel(context=b, plan=wp, **kw)
    torch.cuda.synchronize()
    assert_same_state(before, context_state(a), context_state(b))
    return a, b


def _verify_both(ctx, vp, check=True):
    before = context_state(ctx)
    a, b = clone_context(ctx), clone_context(ctx)
    launch_canary_verify_kernel_torch_reference(context=a, plan=vp, check_verify_expected_token=check)
    launch_canary_verify_kernel(context=b, plan=vp, check_verify_expected_token=check)
    torch.cuda.synchronize()
    assert_same_state(before, context_state(a), context_state(b))
    return a, b


@pytest.mark.parametrize("seed", range(32))
def test_fuzz_small_cases_on_gpu(seed):
    case = make_case(seed, DEV, mode=seed % 3, nsrc=(seed // 3) % 5)
    twin, err_t, (vp, wp) = run_plan(launch_canary_plan_kernels_torch_reference, case)
    fast, err_f, _ = run_plan(launch_canary_plan_kernels, case)
    assert (err_t is None) == (err_f is None)
    for x, y in zip(twin, fast):
        assert torch.equal(x, y)
    if err_t is not None:
        return
    if case.ctx.violation_ring.shape[0] < 64:
        case.ctx.__dict__["violation_ring"] = torch.full((512, 8), -77, dtype=torch.int64, device=DEV)
    a, _ = _write_both(case.ctx, wp, **case.write_kwargs)
    f = a.canary_buf.view(torch.int64)
    f[torch.randint(0, f.shape[0], (3,), device=DEV), 1] ^= 1
    _verify_both(a, vp, True)


def _paged_batch(bs, ctx_len, num_slots, page=16, seed=0):
    """Request table of bs rows x ctx_len positions in 16-slot pages placed in random order."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = bs * (ctx_len + 1 + page - 1) // page + 1
    pages = torch.randperm(num_slots // page - 1, generator=g)[:pages_needed] + 1
    per_row = (ctx_len + 1 + page - 1) // page
    rtt = torch.zeros(bs + 1, per_row * page, dtype=torch.int32)
    rp = pages[: bs * per_row].reshape(bs, per_row)
    slots = (rp[:, :, None] * page + torch.arange(page)).reshape(bs, -1)
    rtt[1:] = slots.to(torch.int32)
    return rtt


def _plan_for(bs, prefix, extend, rtt, v_cap, *, table=None):
    vp, wp = VerifyPlan.allocate(v_cap, DEV), WritePlan.allocate(bs, DEV)
    kw = dict(
        req_pool_indices=torch.arange(1, bs + 1, device=DEV), prefix_lens=torch.full((bs,), prefix, device=DEV),
        extend_seq_lens=torch.full((bs,), extend, device=DEV), req_to_token=rtt.to(DEV), swa_window_size=0,
        full_to_swa_index_mapping=None, verify_capacity=v_cap, req_to_verify_expected_tokens=table,
        req_to_verify_expected_tokens_valid_lens=None if table is None else torch.full((bs,), prefix + extend, device=DEV),
        kv_token_id_vs_position_offset=0,
    )
    return vp, wp, kw


def _write_inputs(bs, prefix, extend, rtt, tokens):
    rows = torch.arange(1, bs + 1)
    pos = (prefix + torch.arange(extend)).repeat(bs)
    loc = rtt[rows][:, prefix:prefix + extend].reshape(-1).to(torch.int64)
    ids = tokens[rows][:, prefix:prefix + extend].reshape(-1).to(torch.int64)
    return dict(input_ids=ids.to(DEV), positions=pos.to(DEV), out_cache_loc=loc.to(DEV),
                enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)


@pytest.mark.parametrize("mode,nsrc", [(RealKvHashMode.NONE, 0), (RealKvHashMode.PARTIAL, 2), (RealKvHashMode.ALL, 1)])
def test_decode_4096_requests_and_4m_verify(mode, nsrc):
    bs, prefix = 4096, 1024  # 4M verify entries, 4096 one-token writes
    num_slots = 1 << 23
    rtt = _paged_batch(bs, prefix, num_slots)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100000, rtt.shape, generator=g)
    srcs = [make_source(g, DEV, num_slots=num_slots, page_size=16, nbpt=64, read_bytes=64, dtype=torch.bfloat16)
            for _ in range(nsrc)]
    ctx = make_context(g, DEV, num_slots=num_slots, stride_bytes=32, ring_cap=4096, sources=srcs, mode=mode,
                       chain_assert=1, kind=3)
    # Build the prefix chains with one write per request (prefill), then check a decode step.
    vp, wp, kw = _plan_for(bs, 0, prefix, rtt, 1 << 23, table=tokens.to(torch.int32).to(DEV))
    launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **kw)
    a, b = _write_both(ctx, wp, **_write_inputs(bs, 0, prefix, rtt, tokens))
    vp, wp, kw = _plan_for(bs, prefix, 1, rtt, 1 << 23, table=tokens.to(torch.int32).to(DEV))
    twin_plan, _, _ = run_plan_direct(launch_canary_plan_kernels_torch_reference, vp, wp, kw)
    fast_plan, _, (vp2, wp2) = run_plan_direct(launch_canary_plan_kernels, vp, wp, kw)
    for x, y in zip(twin_plan, fast_plan):
        assert torch.equal(x, y)
    assert int(vp2.verify_num_valid[0]) == bs * prefix
    f = b.canary_buf.view(torch.int64)
    corrupt = torch.randint(1, num_slots, (100,), device=DEV)
    f[corrupt, 2] ^= 4
    _verify_both(b, vp2, True)
    _write_both(b, wp2, **_write_inputs(bs, prefix, 1, rtt, tokens))


def run_plan_direct(impl, vp, wp, kw):
    vp = VerifyPlan(**{k: getattr(vp, k).clone() for k in vp.__dataclass_fields__})
    wp = WritePlan(**{k: getattr(wp, k).clone() for k in wp.__dataclass_fields__})
    impl(verify_plan_out=vp, write_plan_out=wp, **kw)
    return plan_state(vp, wp), None, (vp, wp)


def test_prefill_128k_tokens_one_request():
    n = 128 * 1024
    num_slots = 1 << 18
    g = torch.Generator().manual_seed(2)
    srcs = [make_source(g, DEV, num_slots=num_slots, page_size=16, nbpt=128, read_bytes=128, dtype=torch.bfloat16)
            for _ in range(2)]
    ctx = make_context(g, DEV, num_slots=num_slots, stride_bytes=32, ring_cap=1024, sources=srcs,
                       mode=RealKvHashMode.PARTIAL, chain_assert=1, kind=2)
    wp = WritePlan.allocate(1, DEV)
    wp.write_offsets.copy_(torch.tensor([0, n]))
    wp.write_seed_slot_indices.fill_(7)
    wp.write_num_valid_reqs.fill_(1)
    loc = torch.randperm(num_slots - 8, generator=g)[:n] + 8
    loc[::1000] = -1
    pos = torch.arange(n)
    pos[5000] = 77  # chain-position assert rows
    kw = dict(input_ids=torch.randint(0, 1 << 40, (n,), generator=g).to(DEV), positions=pos.to(DEV),
              out_cache_loc=loc.to(DEV), enable_write_input_assert=True,
              expected_input_tokens=torch.randint(0, 1 << 40, (n,), generator=g).to(DEV), expected_input_positions=pos.to(DEV))
    kw["expected_input_tokens"][10:] = kw["input_ids"][10:]
    _write_both(ctx, wp, **kw)


def test_graph_capture_replay_with_new_inputs_and_repeat():
    bs, prefix, num_slots = 64, 512, 1 << 16
    rtt = _paged_batch(bs, prefix + 2, num_slots).to(DEV)
    g = torch.Generator().manual_seed(5)
    srcs = [make_source(g, DEV, num_slots=num_slots, page_size=16, nbpt=64, read_bytes=64, dtype=torch.bfloat16)
            for _ in range(2)]
    ctx = make_context(g, DEV, num_slots=num_slots, stride_bytes=32, ring_cap=256, sources=srcs,
                       mode=RealKvHashMode.PARTIAL, chain_assert=1, kind=0)
    static = dict(rp=torch.arange(1, bs + 1, device=DEV), p=torch.zeros(bs, dtype=torch.int64, device=DEV),
                  e=torch.zeros(bs, dtype=torch.int64, device=DEV),
                  ids=torch.zeros(bs * (prefix + 1), dtype=torch.int64, device=DEV),
                  pos=torch.zeros(bs * (prefix + 1), dtype=torch.int64, device=DEV),
                  loc=torch.full((bs * (prefix + 1),), -1, dtype=torch.int64, device=DEV))
    vp, wp = VerifyPlan.allocate(bs * (prefix + 1), DEV), WritePlan.allocate(bs, DEV)

    def step(plan_fn, write_fn, verify_fn, c):
        plan_fn(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=static["rp"], prefix_lens=static["p"],
                extend_seq_lens=static["e"], req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None,
                verify_capacity=vp.verify_slot_indices.shape[0], req_to_verify_expected_tokens=None,
                req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0)
        verify_fn(context=c, plan=vp, check_verify_expected_token=False)
        write_fn(context=c, plan=wp, input_ids=static["ids"], positions=static["pos"], out_cache_loc=static["loc"],
                 enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)

    def load_inputs(p, e, seed):
        gg = torch.Generator().manual_seed(seed)
        static["p"].fill_(p)
        static["e"].fill_(e)
        n = bs * e
        rows = torch.arange(1, bs + 1)
        static["loc"].fill_(-1)
        static["loc"][:n] = rtt.cpu()[rows][:, p:p + e].reshape(-1).to(DEV)
        static["ids"][:n] = torch.randint(0, 1000, (n,), generator=gg).to(DEV)
        static["pos"][:n] = (p + torch.arange(e)).repeat(bs).to(DEV)

    fast = clone_context(ctx)
    twin = clone_context(ctx)
    # Warm-up (compiles, allocates scratch) on a throwaway context.
    warm = clone_context(ctx)
    load_inputs(0, prefix, 0)
    step(launch_canary_plan_kernels, launch_canary_write_kernel, launch_canary_verify_kernel, warm)
    torch.cuda.synchronize()
    # Prefill eagerly on both, then capture one decode step and replay it with new inputs.
    step(launch_canary_plan_kernels, launch_canary_write_kernel, launch_canary_verify_kernel, fast)
    step(launch_canary_plan_kernels_torch_reference, launch_canary_write_kernel_torch_reference,
         launch_canary_verify_kernel_torch_reference, twin)
    graph = torch.cuda.CUDAGraph()
    load_inputs(prefix, 1, 1)
    with torch.cuda.graph(graph):
        step(launch_canary_plan_kernels, launch_canary_write_kernel, launch_canary_verify_kernel, fast)
    before = context_state(fast)
    for i, seed in enumerate((11, 12)):
        load_inputs(prefix + i, 1, seed)
        graph.replay()
        step(launch_canary_plan_kernels_torch_reference, launch_canary_write_kernel_torch_reference,
             launch_canary_verify_kernel_torch_reference, twin)
        torch.cuda.synchronize()
        assert_same_state(before, context_state(twin), context_state(fast))
        if i == 0:
            f = fast.canary_buf.view(torch.int64)
            t = twin.canary_buf.view(torch.int64)
            victim = int(rtt[5, 100])
            f[victim, 0] += 1
            t[victim, 0] += 1
        before = context_state(fast)
    assert int(fast.violation_write_index[0]) >= 1


def test_repeated_runs_identical():
    case_states = []
    for _ in range(3):
        case = make_case(99, DEV, small=False, mode=1, nsrc=2, window=0)
        _, err, (vp, wp) = run_plan(launch_canary_plan_kernels, case)
        assert err is None
        ctx = clone_context(case.ctx)
        ctx.__dict__["violation_ring"] = torch.full((1 << 20, 8), -77, dtype=torch.int64, device=DEV)
        launch_canary_write_kernel(context=ctx, plan=wp, **case.write_kwargs)
        launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=True)
        torch.cuda.synchronize()
        s = context_state(ctx)
        s["ring"] = torch.tensor(sorted(map(tuple, s["ring"].tolist())))
        case_states.append(s)
    for s in case_states[1:]:
        for k in s:
            assert torch.equal(torch.as_tensor(s[k]), torch.as_tensor(case_states[0][k]))


def test_scatter_large():
    g = torch.Generator().manual_seed(3)
    bs = 4096
    lens = torch.randint(0, 300, (bs,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(DEV)
    flat = torch.randint(-(2**40), 2**40, (int(lens.sum()),), generator=g).to(DEV)
    rp = torch.randint(0, 3000, (bs,), generator=g).to(DEV)
    a = torch.randint(-9, 9, (3000, 256), generator=g).to(torch.int32).to(DEV)
    b = a.clone()
    scatter_req_token_ids_torch_reference(flat_in=flat, offsets=offsets, req_pool_indices=rp, pool_out=a)
    launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offsets, req_pool_indices=rp, pool_out=b)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- launch configs, stamps

_VARIANTS = [
    dict(plan=PlanLaunchConfig(pdl=False, tile_rows=0), write=WriteLaunchConfig(pdl=False, chain_programs_per_sm=32, small_lanes=0),
         verify=VerifyLaunchConfig(pdl=False)),
    dict(plan=PlanLaunchConfig(check_lut=False), write=WriteLaunchConfig(chain_programs_per_sm=2, prep_block=256),
         verify=VerifyLaunchConfig(block=64, num_warps=2)),
]


@pytest.mark.parametrize("variant", range(len(_VARIANTS)))
@pytest.mark.parametrize("seed", range(8))
def test_fuzz_launch_configs(seed, variant):
    """The fuzz cases again with other launch shapes, PDL off, the multi-launch plan for small
    batches, the one-launch plan with a LUT (what graph capture runs)."""
    cfg = _VARIANTS[variant]
    case = make_case(100 + seed, DEV, mode=seed % 3, nsrc=seed % 5)
    twin, err_t, (vp, wp) = run_plan(launch_canary_plan_kernels_torch_reference, case)
    fast, err_f, _ = run_plan(functools.partial(launch_plan, config=cfg["plan"]), case)
    assert (err_t is None) == (err_f is None)
    for x, y in zip(twin, fast):
        assert torch.equal(x, y)
    if err_t is not None:
        return
    case.ctx.__dict__["violation_ring"] = torch.full((4096, 8), -77, dtype=torch.int64, device=DEV)
    before = context_state(case.ctx)
    a, b = clone_context(case.ctx), clone_context(case.ctx)
    launch_canary_write_kernel_torch_reference(context=a, plan=wp, **case.write_kwargs)
    launch_write(context=b, plan=wp, config=cfg["write"], **case.write_kwargs)
    torch.cuda.synchronize()
    assert_same_state(before, context_state(a), context_state(b))
    before = context_state(a)
    c, d = clone_context(a), clone_context(a)
    launch_canary_verify_kernel_torch_reference(context=c, plan=vp, check_verify_expected_token=True)
    launch_verify(context=d, plan=vp, check_verify_expected_token=True, config=cfg["verify"])
    torch.cuda.synchronize()
    assert_same_state(before, context_state(c), context_state(d))


def _to_device(value):
    if isinstance(value, torch.Tensor):
        return value.to(DEV)
    if isinstance(value, (VerifyPlan, WritePlan)):
        return type(value)(**{f.name: getattr(value, f.name).to(DEV) for f in dataclasses.fields(value)})
    return value


def _stamp_both(kw):
    cap = kw["violation_ring"].shape[0]
    a = torch.full((cap, 3), -55, dtype=torch.int64, device=DEV)
    b = a.clone()
    stamp_violation_rows_torch_reference(stamps=a, **kw)
    launch_stamp_violation_rows(stamps=b, **kw)
    torch.cuda.synchronize()
    assert torch.equal(a, b), (a, b)
    return a


@pytest.mark.parametrize("name", sorted(STAMP_SCENARIOS))
def test_stamp_scenarios_on_gpu(name):
    kw, _ = STAMP_SCENARIOS[name]()
    _stamp_both({k: _to_device(v) for k, v in kw.items()})


@pytest.mark.parametrize("seed", range(8))
def test_stamp_fuzz_on_gpu(seed):
    case = make_case(200 + seed, DEV, mode=seed % 3, nsrc=seed % 3)
    _, err, (vp, wp) = run_plan(launch_canary_plan_kernels_torch_reference, case)
    if err is not None:
        return
    ctx = clone_context(case.ctx)
    rows_from = ctx.violation_write_index.clone()
    launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=True)
    launch_canary_write_kernel(context=ctx, plan=wp, **case.write_kwargs)
    _stamp_both(dict(
        violation_ring=ctx.violation_ring, violation_write_index=ctx.violation_write_index, rows_from=rows_from,
        step=torch.tensor([7 + seed], device=DEV), verify_plan=vp, write_plan=wp,
        out_cache_loc=case.write_kwargs["out_cache_loc"], positions=case.write_kwargs["positions"],
        req_pool_indices=case.plan_kwargs["req_pool_indices"], prefix_lens=case.plan_kwargs["prefix_lens"],
        swa_window_size=case.plan_kwargs["swa_window_size"]))


def test_decode_step_graph_with_stamps():
    """64 requests x 1k context: plan (one launch) -> HEAD verify + write -> TAIL_K / TAIL_V
    verify + write (PARTIAL, 2 sources each) -> stamps of the three tags, captured in one CUDA
    graph (PDL where the device has it) and replayed; canary bytes, counters, rings and stamps
    equal the twins' step by step, and a corrupted record is stamped with its request."""
    bs, prefix, num_slots = 64, 1024, 1 << 17
    rtt = _paged_batch(bs, prefix + 4, num_slots).to(DEV)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 50000, rtt.shape, generator=g)

    def sources():
        return [make_source(g, DEV, num_slots=num_slots, page_size=16, nbpt=64, read_bytes=64, dtype=torch.bfloat16)
                for _ in range(2)]

    ctxs = [make_context(g, DEV, num_slots=num_slots, stride_bytes=32, ring_cap=512, sources=srcs, mode=mode,
                         chain_assert=1, kind=kind)
            for srcs, mode, kind in (((), RealKvHashMode.NONE, 0), (sources(), RealKvHashMode.PARTIAL, 2),
                                     (sources(), RealKvHashMode.PARTIAL, 3))]
    vp, wp, kw = _plan_for(bs, 0, prefix, rtt.cpu(), bs * (prefix + 4))
    launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **kw)
    for c in ctxs:  # prefill eagerly
        launch_canary_write_kernel_torch_reference(context=c, plan=wp, **_write_inputs(bs, 0, prefix, rtt.cpu(), tokens))
    static = dict(p=torch.full((bs,), prefix, device=DEV), ids=torch.zeros(bs, dtype=torch.int64, device=DEV),
                  pos=torch.zeros(bs, dtype=torch.int64, device=DEV), loc=torch.zeros(bs, dtype=torch.int64, device=DEV),
                  step=torch.zeros(1, dtype=torch.int64, device=DEV))
    rows = torch.arange(1, bs + 1, device=DEV)
    ones = torch.ones(bs, dtype=torch.int64, device=DEV)

    def make_side(fast):
        side = dict(vp=VerifyPlan.allocate(bs * (prefix + 4), DEV), wp=WritePlan.allocate(bs, DEV),
                    ctxs=[clone_context(c) for c in ctxs])
        side["stamps"] = [torch.full((512, 3), -5, dtype=torch.int64, device=DEV) for _ in ctxs]
        side["from"] = [torch.zeros(1, dtype=torch.int32, device=DEV) for _ in ctxs]
        side["ops"] = ((launch_canary_plan_kernels, launch_canary_verify_kernel, launch_canary_write_kernel,
                        launch_stamp_violation_rows) if fast else
                       (launch_canary_plan_kernels_torch_reference, launch_canary_verify_kernel_torch_reference,
                        launch_canary_write_kernel_torch_reference, stamp_violation_rows_torch_reference))
        return side

    def step(side):
        plan_fn, verify_fn, write_fn, stamp_fn = side["ops"]
        for f, c in zip(side["from"], side["ctxs"]):
            f.copy_(c.violation_write_index)
        plan_fn(verify_plan_out=side["vp"], write_plan_out=side["wp"], req_pool_indices=rows, prefix_lens=static["p"],
                extend_seq_lens=ones, req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None,
                verify_capacity=bs * (prefix + 4), req_to_verify_expected_tokens=None,
                req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0)
        winputs = dict(input_ids=static["ids"], positions=static["pos"], out_cache_loc=static["loc"],
                       enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
        for c in side["ctxs"]:
            verify_fn(context=c, plan=side["vp"], check_verify_expected_token=False)
            write_fn(context=c, plan=side["wp"], **winputs)
        for c, f, st in zip(side["ctxs"], side["from"], side["stamps"]):
            stamp_fn(violation_ring=c.violation_ring, violation_write_index=c.violation_write_index, rows_from=f,
                     stamps=st, step=static["step"], verify_plan=side["vp"], write_plan=side["wp"],
                     out_cache_loc=static["loc"], positions=static["pos"], req_pool_indices=rows,
                     prefix_lens=static["p"], swa_window_size=0)

    def load(p):
        static["p"].fill_(p)
        static["pos"].fill_(p)
        static["loc"].copy_(rtt[1:, p].to(torch.int64))
        static["ids"].copy_(tokens[1:, p].to(DEV))
        static["step"].fill_(p)

    fast, twin = make_side(True), make_side(False)
    warm = make_side(True)
    load(prefix)
    step(warm)  # compiles, allocates the write scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(fast)
    for i in range(3):
        load(prefix + i)
        if i == 1:  # a flipped token in request row 9 (batch row 8) at position 100, in every buffer
            for side in (fast, twin):
                for c in side["ctxs"]:
                    c.canary_buf.view(torch.int64)[int(rtt[9, 100]), 0] ^= 1
        graph.replay()
        step(twin)
        torch.cuda.synchronize()
        for cf, ct in zip(fast["ctxs"], twin["ctxs"]):
            assert torch.equal(cf.canary_buf, ct.canary_buf)
            assert int(cf.violation_write_index[0]) == int(ct.violation_write_index[0])
            assert torch.equal(cf.slot_run_counter, ct.slot_run_counter)
            assert torch.equal(cf.kernel_run_counter, ct.kernel_run_counter)
            n = int(cf.violation_write_index[0])
            assert sorted(map(tuple, cf.violation_ring[:n].tolist())) == sorted(map(tuple, ct.violation_ring[:n].tolist()))
        for sf, st in zip(fast["stamps"], twin["stamps"]):
            assert torch.equal(sf, st)
    for stamps in fast["stamps"]:  # the flip breaks the chain link read at position 101
        assert (prefix + 1, 8, 101) in {tuple(x) for x in stamps.tolist()}


def test_out_of_range_slots_and_request_rows_on_gpu():
    """Issue 10 item 5 on a real device: slots past the canary buffer in a verify plan and in a
    write are VERIFY_/WRITE_SLOT_OUT_OF_RANGE rows, bit-identical between the twin and the Triton
    launchers (no out-of-bounds access: compute-sanitizer clean runs are the stronger check); a
    request row outside the table raises before the plan changes outside capture, and inside a
    captured graph is planned as a padding row."""
    from kvcanary.errors import KvCanaryValueError
    from kvcanary.ops import FailReason

    voor, woor = int(FailReason.VERIFY_SLOT_OUT_OF_RANGE), int(FailReason.WRITE_SLOT_OUT_OF_RANGE)
    g = torch.Generator().manual_seed(21)
    num_slots = 4096
    srcs = [make_source(g, DEV, num_slots=num_slots, page_size=16, nbpt=64, read_bytes=64, dtype=torch.bfloat16)]
    ctx = make_context(g, DEV, num_slots=num_slots, stride_bytes=32, ring_cap=4096, sources=srcs,
                       mode=RealKvHashMode.PARTIAL, chain_assert=1, kind=2)
    # verify: 3000 entries, every 7th slot out of range (past the end, negative, huge), every 11th
    # predecessor past the end
    n = 3000
    slots = torch.randint(1, num_slots, (n,), generator=g)
    slots[::7] = torch.tensor([num_slots, -5, 2**40, num_slots + 123])[torch.arange(0, n, 7) % 4]
    prevs = torch.randint(-1, num_slots, (n,), generator=g)
    prevs[::11] = num_slots + 7
    vp = VerifyPlan.allocate(n, DEV)
    vp.verify_slot_indices.copy_(slots)
    vp.verify_prev_slot_indices.copy_(prevs)
    vp.verify_expected_positions.copy_(torch.randint(0, 100, (n,), generator=g))
    vp.verify_expected_tokens.fill_(-1)
    vp.verify_num_valid.fill_(n)
    vp.enable.fill_(1)
    before = context_state(ctx)
    a, b = clone_context(ctx), clone_context(ctx)
    launch_canary_verify_kernel_torch_reference(context=a, plan=vp, check_verify_expected_token=False)
    launch_canary_verify_kernel(context=b, plan=vp, check_verify_expected_token=False)
    torch.cuda.synchronize()
    assert_same_state(before, context_state(a), context_state(b))
    k = int(a.violation_write_index[0])
    assert sum(r[7] == voor for r in a.violation_ring[:k].tolist()) == int(
        (((slots < 0) | (slots >= num_slots) | (prevs >= num_slots)) & (slots != 0)).sum())
    # write: small (single CTA) and large (two kernels) launches with slots past the end and a seed
    # past the end
    for lengths in ([1] * 48, [300, 1, 700, 2, 1000]):
        bs = len(lengths)
        wp = WritePlan.allocate(bs, DEV)
        wp.write_offsets.copy_(torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()))
        seeds = torch.randint(-1, num_slots, (bs,), generator=g)
        seeds[bs // 2] = num_slots + 1
        wp.write_seed_slot_indices.copy_(seeds)
        wp.write_num_valid_reqs.fill_(bs)
        m = sum(lengths)
        loc = torch.randperm(num_slots - 1, generator=g)[:m] + 1
        loc[::9] = num_slots + torch.arange(0, m, 9) % 50
        loc[5::13] = -1
        kw = dict(input_ids=torch.randint(0, 50000, (m,), generator=g).to(DEV),
                  positions=torch.arange(m).to(DEV), out_cache_loc=loc.to(DEV), enable_write_input_assert=False,
                  expected_input_tokens=None, expected_input_positions=None)
        a, _b = _write_both(ctx, wp, **kw)
        k = int(a.violation_write_index[0])
        assert sum(r[7] == woor for r in a.violation_ring[:k].tolist()) == int((loc >= num_slots).sum())
    # request rows: outside capture a KvCanaryValueError before any output changes
    rtt = torch.randint(1, num_slots, (8, 64), generator=g, dtype=torch.int32).to(DEV)
    pkw = dict(prefix_lens=torch.tensor([5, 9, 3], device=DEV), extend_seq_lens=torch.tensor([1, 1, 1], device=DEV),
               req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=64,
               req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
               kv_token_id_vs_position_offset=0)
    vpo, wpo = VerifyPlan.allocate(64, DEV), WritePlan.allocate(3, DEV)
    snap = plan_state(vpo, wpo)
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: launch_canary_plan_kernels req_pool_indices\[1\]=8 "):
        launch_canary_plan_kernels(verify_plan_out=vpo, write_plan_out=wpo,
                                   req_pool_indices=torch.tensor([2, 8, 3], device=DEV), **pkw)
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(snap, plan_state(vpo, wpo)))
    # under capture: the bad row is planned as padding (compare with the twin given row 0 there)
    rows = torch.tensor([2, 3, 4], device=DEV)
    launch_canary_plan_kernels(verify_plan_out=vpo, write_plan_out=wpo, req_pool_indices=rows, **pkw)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_canary_plan_kernels(verify_plan_out=vpo, write_plan_out=wpo, req_pool_indices=rows, **pkw)
    rows.copy_(torch.tensor([2, -3, 99], device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    vpt, wpt = VerifyPlan.allocate(64, DEV), WritePlan.allocate(3, DEV)
    vpt.verify_slot_indices.copy_(vpo.verify_slot_indices)  # entries past the count keep old values
    vpt.verify_expected_tokens.copy_(vpo.verify_expected_tokens)
    vpt.verify_expected_positions.copy_(vpo.verify_expected_positions)
    vpt.verify_prev_slot_indices.copy_(vpo.verify_prev_slot_indices)
    launch_canary_plan_kernels_torch_reference(verify_plan_out=vpt, write_plan_out=wpt,
                                               req_pool_indices=torch.tensor([2, 0, 0], device=DEV), **pkw)
    assert all(torch.equal(x, y) for x, y in zip(plan_state(vpt, wpt), plan_state(vpo, wpo)))
