"""Several contexts per launch (`launch_canary_verify_kernels`, `launch_canary_write_kernels`) on a real CUDA
device: the same buffers, counters, write indices and violation sets as one twin call per context, on fuzz
cases and on a 64 x 4k decode step (TAIL K and V, PARTIAL, two sources each), eager and replayed from a graph."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kvcanary.ops import (  # noqa: E402
    RealKvHashMode,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_verify_kernels,
    launch_canary_write_kernel_torch_reference,
    launch_canary_write_kernels,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ops.triton_cases import (  # noqa: E402
    assert_same_states, clone_context, context_state, make_case, make_context, make_source, run_plan, sibling_context,
)

DEV = "cuda"


def _states(ctxs):
    torch.cuda.synchronize()
    return [context_state(c) for c in ctxs]


def _check(before, twin, fast):  # concurrent blocks: a ring that fills may keep other rows (docs/design.md §3.9)
    assert_same_states(before, twin, fast, kept_rows_may_differ=True)


def _verify_many_vs_twin(ctxs, vp, check):
    before = _states(ctxs)
    twin, fast = [clone_context(c) for c in ctxs], [clone_context(c) for c in ctxs]
    for c in twin:
        launch_canary_verify_kernel_torch_reference(context=c, plan=vp, check_verify_expected_token=check)
    launch_canary_verify_kernels(contexts=fast, plan=vp, check_verify_expected_token=check)
    _check(before, _states(twin), _states(fast))


def _write_many_vs_twin(ctxs, wp, kw):
    before = _states(ctxs)
    twin, fast = [clone_context(c) for c in ctxs], [clone_context(c) for c in ctxs]
    for c in twin:
        launch_canary_write_kernel_torch_reference(context=c, plan=wp, **kw)
    launch_canary_write_kernels(contexts=fast, plan=wp, **kw)
    _check(before, _states(twin), _states(fast))
    return twin


@pytest.mark.parametrize("seed", range(16))
def test_fuzz_two_contexts_on_gpu(seed):
    case = make_case(seed, DEV, mode=seed % 3, nsrc=(seed // 3) % 5)
    _, err, (vp, wp) = run_plan(launch_canary_plan_kernels_torch_reference, case)
    if err is not None:
        pytest.skip("the case's plan raises")
    g = torch.Generator().manual_seed(seed)
    srcs = tuple(make_source(g, DEV, num_slots=case.ctx.canary_buf.shape[0], page_size=4, nbpt=32, read_bytes=32,
                             dtype=torch.bfloat16) for _ in range(1 + seed % 4))
    other = sibling_context(case.ctx, seed, mode=RealKvHashMode((seed // 2) % 3), sources=srcs) if seed % 2 else \
        sibling_context(case.ctx, seed)
    written = _write_many_vs_twin([case.ctx, other], wp, case.write_kwargs)
    for c in written:
        f = c.canary_buf.view(torch.int64)
        f[torch.randint(0, f.shape[0], (3,), generator=g).to(DEV), 1] ^= 1
    for check in (False, True):
        _verify_many_vs_twin(written, vp, check)


def _decode_case(bs=64, ctx_len=4096, page=16):
    """Two PARTIAL contexts (K, V; two sources each) over one paged request table, prefilled clean."""
    num_slots = bs * (ctx_len + page) + page
    g = torch.Generator().manual_seed(3)
    pages = torch.randperm(num_slots // page - 1, generator=g)[: bs * ((ctx_len + page) // page)] + 1
    rtt = (pages.reshape(bs, -1)[:, :, None] * page + torch.arange(page)).reshape(bs, -1).to(torch.int32)
    rtt = torch.cat([torch.zeros(1, rtt.shape[1], dtype=torch.int32), rtt]).to(DEV)
    ctxs = []
    for kind in (2, 3):
        srcs = [make_source(g, DEV, num_slots=num_slots, page_size=page, nbpt=256, read_bytes=256, dtype=torch.bfloat16)
                for _ in range(2)]
        ctxs.append(make_context(g, DEV, num_slots=num_slots, stride_bytes=32, ring_cap=4096, sources=srcs,
                                 mode=RealKvHashMode.PARTIAL, chain_assert=0, kind=kind))

    def plans(prefix, extend):
        cap = bs * max(prefix, 1)
        vp, wp = VerifyPlan.allocate(cap, DEV), WritePlan.allocate(bs, DEV)
        launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.arange(1, bs + 1, device=DEV),
            prefix_lens=torch.full((bs,), prefix, device=DEV), extend_seq_lens=torch.full((bs,), extend, device=DEV),
            req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=cap,
            req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0)
        loc = rtt[1:, prefix:prefix + extend].reshape(-1).to(torch.int64)
        kw = dict(input_ids=torch.randint(0, 1000, (loc.shape[0],), generator=g).to(DEV),
                  positions=(prefix + torch.arange(extend)).repeat(bs).to(DEV), out_cache_loc=loc,
                  enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
        return vp, wp, kw

    _, wp0, kw0 = plans(0, ctx_len)
    launch_canary_write_kernels(contexts=ctxs, plan=wp0, **kw0)  # prefill (two-kernel path, one context each)
    return ctxs, plans(ctx_len, 1)


def test_decode_step_64x4k_two_contexts_eager_and_graph():
    ctxs, (vp, wp, kw) = _decode_case()
    for c in ctxs:  # a few corrupted records in each buffer: rows to compare
        f = c.canary_buf.view(torch.int64)
        f[torch.randint(1, f.shape[0], (50,), device=DEV), 2] ^= 8
    _verify_many_vs_twin(ctxs, vp, False)
    _write_many_vs_twin(ctxs, wp, kw)
    # the same pair of launches captured in a CUDA graph and replayed (after an eager warm-up: compiled)
    work = [clone_context(c) for c in ctxs]
    launch_canary_verify_kernels(contexts=work, plan=vp, check_verify_expected_token=False)
    launch_canary_write_kernels(contexts=work, plan=wp, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launch_canary_verify_kernels(contexts=work, plan=vp, check_verify_expected_token=False)
        launch_canary_write_kernels(contexts=work, plan=wp, **kw)
    torch.cuda.synchronize()
    before = _states(work)
    twin = [clone_context(c) for c in work]
    for c in twin:
        launch_canary_verify_kernel_torch_reference(context=c, plan=vp, check_verify_expected_token=False)
        launch_canary_write_kernel_torch_reference(context=c, plan=wp, **kw)
    graph.replay()
    _check(before, _states(twin), _states(work))
    assert all(s["index"] > b["index"] for s, b in zip(_states(work), before))  # the corruptions were reported
