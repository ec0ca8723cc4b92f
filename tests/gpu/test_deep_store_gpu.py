"""Deep fingerprints on a real CUDA device, bit for bit against the torch twins on the same device:

* `store_deep_fingerprints` (one Triton launch per deep buffer) on the interpreter tests' cases and on a
  prefill-sized one (8192 tokens, four 1 KiB-per-token paged layers: a real model's deep chunk);
* the write and verify ops in ALL mode over four sources of one row shape (the fused fold of
  ``ops/triton/hashing.fingerprint``) and in LANES mode (the deep records' parallel fold), a flipped bit in the
  last source seen;
* the simulated runtime with deep fingerprints on the kernels vs on the twins (deep buffers included).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("triton")

from kvcanary.ops import VerifyPlan, launch_canary_verify_kernel, launch_canary_write_kernel  # noqa: E402
from kvcanary.ops.constants import CanaryLaunchTag, RealKvHashMode  # noqa: E402
from kvcanary.ops.reference.verify import launch_canary_verify_kernel_torch_reference  # noqa: E402
from kvcanary.ops.reference.write import launch_canary_write_kernel_torch_reference  # noqa: E402
from kvcanary.runtime import deep_store  # noqa: E402
from tests.ops.triton_cases import make_context, make_source, write_inputs, write_plan  # noqa: E402
from tests.runtime.test_deep_store import _case  # noqa: E402

DEV = torch.device("cuda")


def _to_cuda(ctx):
    return dataclasses.replace(
        ctx, canary_buf=ctx.canary_buf.to(DEV), violation_ring=ctx.violation_ring.to(DEV),
        violation_write_index=ctx.violation_write_index.to(DEV), slot_run_counter=ctx.slot_run_counter.to(DEV),
        kernel_run_counter=ctx.kernel_run_counter.to(DEV),
        real_kv_sources=tuple(dataclasses.replace(s, tensor=s.tensor.to(DEV)) for s in ctx.real_kv_sources),
        enable_chain_position_assert=ctx.enable_chain_position_assert.to(DEV))


def _plan_to_cuda(plan):
    return dataclasses.replace(plan, **{f.name: getattr(plan, f.name).to(DEV) for f in dataclasses.fields(plan)})


@pytest.mark.parametrize("seed", range(8))
def test_deep_store_cuda_matches_twin(seed):
    tail, deep, plan, kw = _case(200 + seed, nsrc=1 + seed % 4, same_shape=seed % 2 == 0)
    launch_canary_write_kernel_torch_reference(context=tail, plan=plan, **kw)
    tail, deep, plan = _to_cuda(tail), _to_cuda(deep), _plan_to_cuda(plan)
    loc = kw["out_cache_loc"].to(DEV)
    want = deep.canary_buf.clone()
    deep_store.store_deep_fingerprints_twin(targets=[(tail.canary_buf, want, deep.real_kv_sources)], out_loc=loc, plan=plan)
    deep_store.store_deep_fingerprints(targets=[(tail.canary_buf, deep.canary_buf, deep.real_kv_sources)], out_loc=loc, plan=plan)
    assert torch.equal(deep.canary_buf, want)


def _prefill_case(num_slots=32768, n=8192, mode=RealKvHashMode.ALL):
    g = torch.Generator().manual_seed(11)
    srcs = [make_source(g, DEV, num_slots=num_slots, page_size=32, nbpt=1024, read_bytes=1024, dtype=torch.bfloat16)
            for _ in range(4)]
    ctx = make_context(g, DEV, num_slots=num_slots, stride_bytes=32, ring_cap=256, sources=srcs,
                       mode=mode, chain_assert=0, kind=CanaryLaunchTag.TAIL_K_FULL)
    lengths = [2500, 3000, 2692]
    plan = _plan_to_cuda(write_plan(lengths, [-1, 17, 99]))
    kw = write_inputs(list(range(n)), list(range(n)), torch.randperm(num_slots - 1, generator=g)[:n].add(1).tolist())
    return ctx, plan, {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def test_deep_store_prefill_sized():
    deep, plan, kw = _prefill_case()
    tail = deep.canary_buf.clone()
    want = deep.canary_buf.clone()
    targets = [(tail, want, deep.real_kv_sources)]
    deep_store.store_deep_fingerprints_twin(targets=targets, out_loc=kw["out_cache_loc"], plan=plan)
    deep_store.store_deep_fingerprints(targets=[(tail, deep.canary_buf, deep.real_kv_sources)],
                                       out_loc=kw["out_cache_loc"], plan=plan)
    assert torch.equal(deep.canary_buf, want)
    assert not torch.equal(want, tail)


@pytest.mark.parametrize("mode", [RealKvHashMode.ALL, RealKvHashMode.LANES])
def test_all_mode_write_and_verify_over_four_long_sources(mode):
    ctx, plan, kw = _prefill_case(mode=mode)
    twin = dataclasses.replace(ctx, canary_buf=ctx.canary_buf.clone(), violation_ring=ctx.violation_ring.clone(),
                               violation_write_index=ctx.violation_write_index.clone())
    launch_canary_write_kernel_torch_reference(context=twin, plan=plan, **kw)
    launch_canary_write_kernel(context=ctx, plan=plan, **kw)
    assert torch.equal(ctx.canary_buf, twin.canary_buf)
    slots = kw["out_cache_loc"][:64]
    vp = VerifyPlan.allocate(64, DEV)
    vp.verify_slot_indices.copy_(slots)
    vp.verify_prev_slot_indices.copy_(torch.cat([slots.new_full((1,), -1), slots[:-1]]))
    vp.verify_expected_positions.copy_(torch.arange(64, device=DEV))
    vp.verify_num_valid[0] = 64
    src = ctx.real_kv_sources[3].tensor.view(torch.uint8)
    s = int(slots[5])
    src[s // 32, (s % 32) * 1024 + 1000] ^= 0x01  # one bit of the last source, 24 bytes before the strip's end
    launch_canary_verify_kernel_torch_reference(context=twin, plan=vp, check_verify_expected_token=False)
    launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)
    assert int(ctx.violation_write_index[0]) == int(twin.violation_write_index[0]) == 1
    assert torch.equal(ctx.violation_ring[:1], twin.violation_ring[:1])


def test_prepared_tables_serve_a_captured_store():
    """`prepare_deep_store` builds the kinds' tables eagerly; a store captured in a CUDA graph then takes one launch
    per kind (no fallback: `_table` finds them) and its replay stores what the twin stores."""
    cases = [_case(400 + k, nsrc=4, same_shape=True) for k in range(4)]
    plan, kw = _case(450, nsrc=1, same_shape=True)[2:]
    loc = kw["out_cache_loc"].clamp(max=23)
    targets, expected = [], []
    for tail, deep, _, _ in cases:
        launch_canary_write_kernel_torch_reference(context=tail, plan=plan, **dict(kw, out_cache_loc=loc))
        tail, deep = _to_cuda(tail), _to_cuda(deep)
        want = deep.canary_buf.clone()
        deep_store.store_deep_fingerprints_twin(targets=[(tail.canary_buf, want, deep.real_kv_sources)],
                                                out_loc=loc.to(DEV), plan=_plan_to_cuda(plan))
        targets.append((tail.canary_buf, deep.canary_buf, deep.real_kv_sources))
        expected.append(want)
    plan, loc = _plan_to_cuda(plan), loc.to(DEV)
    deep_store.prepare_deep_store(targets)
    launches = [(t, b, deep_store.source_args(s, deep_store.DEEP_HASH_MODE, t)) for t, b, s in targets]
    assert all(len(g) == 1 or deep_store._table(g) is not None for g in deep_store._by_kind(launches))
    before = [b.clone() for _, b, _ in targets]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        assert all(len(g) == 1 or deep_store._table(g) is not None for g in deep_store._by_kind(launches))
        deep_store.store_deep_fingerprints(targets=targets, out_loc=loc, plan=plan)
    torch.cuda.synchronize()
    assert all(torch.equal(b, o) for (_, b, _), o in zip(targets, before))  # capture ran nothing
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(b, w) for (_, b, _), w in zip(targets, expected))
