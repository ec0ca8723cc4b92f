"""`launch_canary_verify_kernels`: several contexts on one plan == one verify per context, in order.

Triton's two-context launch (``launch_verify_many``) runs under the interpreter (CPU, TRITON_INTERPRET=1);
the public launcher's argument checks and CPU loop run everywhere.
"""
from __future__ import annotations

import os

import pytest
import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops import (
    RealKvHashMode,
    VerifyPlan,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_verify_kernels,
    launch_canary_write_kernel_torch_reference,
)

from .triton_cases import clone_context, compare_context_runs, context_state, make_case, make_source, sibling_context

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _sibling(ctx, seed: int, *, mode=None, sources=None, kind=3):
    return sibling_context(ctx, seed, mode=mode, sources=sources, kind=kind)


def _compare(contexts, plan, check, many):
    """One twin verify per context, in order, against ``many`` on all of them. Returns what ``many`` returned
    (``()`` if it raised)."""
    def twin(cs):
        for c in cs:
            launch_canary_verify_kernel_torch_reference(context=c, plan=plan, check_verify_expected_token=check)

    launches = []  # the Triton launcher returns the contexts of each kernel launch
    compare_context_runs(contexts, twin,
                         lambda cs: launches.append(many(contexts=cs, plan=plan, check_verify_expected_token=check)))
    return launches[0] if launches else ()


def _written_case(seed: int):
    """A fuzz case's plans with its write applied (the twin's) and a few fields corrupted."""
    from .triton_cases import run_plan
    from kvcanary.ops import launch_canary_plan_kernels_torch_reference

    case = make_case(seed, mode=seed % 3, nsrc=(seed // 3) % 5)
    _, err, (vp, wp) = run_plan(launch_canary_plan_kernels_torch_reference, case)
    if err is not None:
        return None, None
    ctx = clone_context(case.ctx)
    try:
        launch_canary_write_kernel_torch_reference(context=ctx, plan=wp, **case.write_kwargs)
    except ValueError:
        pass
    g = torch.Generator().manual_seed(seed)
    f = ctx.canary_buf.view(torch.int64)
    f[torch.randint(0, f.shape[0], (3,), generator=g), torch.randint(0, 4, (3,), generator=g)] ^= 1
    return ctx, vp


def test_cpu_loop_equals_one_call_per_context():
    for seed in range(6):
        ctx, vp = _written_case(seed)
        if ctx is None:
            continue
        _compare([ctx, _sibling(ctx, seed)], vp, bool(seed % 2), launch_canary_verify_kernels)


def test_argument_errors_touch_nothing():
    ctx, vp = _written_case(1)
    before = context_state(ctx)
    with pytest.raises(KvCanaryTypeError, match="kv-canary: launch_canary_verify_kernels contexts must be a sequence"):
        launch_canary_verify_kernels(contexts=ctx, plan=vp, check_verify_expected_token=False)
    with pytest.raises(KvCanaryValueError, match="needs at least one context"):
        launch_canary_verify_kernels(contexts=[], plan=vp, check_verify_expected_token=False)
    with pytest.raises(KvCanaryTypeError, match="context must be a VerifyOrWriteContext"):
        launch_canary_verify_kernels(contexts=[ctx, "x"], plan=vp, check_verify_expected_token=False)
    after = context_state(ctx)
    assert torch.equal(before["ring"], after["ring"]) and torch.equal(before["counters"], after["counters"])
    assert before["index"] == after["index"]


if INTERPRET:
    from .test_triton_interpret import _numpy_scalar_index_fix  # noqa: F401  (applies the interpreter patch)
    from kvcanary.ops.triton import launch_verify_many


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set before Triton is imported")
@pytest.mark.parametrize("seed", range(18))
def test_two_contexts_in_one_launch_match_the_twin(seed):
    """Fuzz cases (0-4 sources, every mode): the case's context and a sibling with other corruptions (and,
    for odd seeds, another mode over other sources) verified in one Triton launch."""
    import kvcanary.ops.triton.verify as tverify

    ctx, vp = _written_case(seed)
    if ctx is None:
        pytest.skip("the case's plan raises")
    g = torch.Generator().manual_seed(seed)
    n = ctx.canary_buf.shape[0]
    srcs = None
    mode = None
    if seed % 2:
        srcs = tuple(make_source(g, "cpu", num_slots=n, page_size=4, nbpt=32, read_bytes=32, dtype=torch.bfloat16)
                     for _ in range(1 + seed % 4))
        mode = RealKvHashMode((seed // 2) % 3)
    launched = _compare([ctx, _sibling(ctx, seed, mode=mode, sources=srcs)], vp, bool(seed % 3 == 0),
                        launch_verify_many)
    if all(tverify._kernel_sources(c) is not None for c in (ctx,)):
        assert 2 in launched, launched  # the pair went through one launch


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set before Triton is imported")
def test_three_contexts_a_shared_ring_and_a_lazy_error_in_order():
    """Three contexts (a pair, then one alone); two sharing a ring (never fused: one ring's rows stay in
    launch order); a narrow-row context in the middle raises at its turn, after the ones before it ran."""
    ctx, vp = _written_case(4)
    a, b, c = ctx, _sibling(ctx, 1), _sibling(ctx, 2, kind=5)
    _compare([a, b, c], vp, False, launch_verify_many)
    shared = type(b)(**{**b.__dict__, "violation_ring": a.violation_ring, "violation_write_index": a.violation_write_index})
    # shared ring: compare the ring's final state after (a, shared) against the twin
    ca = clone_context(a)
    cs = type(shared)(**{**clone_context(shared).__dict__, "violation_ring": ca.violation_ring,
                         "violation_write_index": ca.violation_write_index})
    launch_verify_many(contexts=[ca, cs], plan=vp, check_verify_expected_token=False)
    ta = clone_context(a)
    ts = type(shared)(**{**clone_context(shared).__dict__, "violation_ring": ta.violation_ring,
                         "violation_write_index": ta.violation_write_index})
    for x in (ta, ts):
        launch_canary_verify_kernel_torch_reference(context=x, plan=vp, check_verify_expected_token=False)
    assert int(ca.violation_write_index[0]) == int(ta.violation_write_index[0])
    assert torch.equal(ca.violation_ring, ta.violation_ring)  # ordered: each context a launch of its own
    g = torch.Generator().manual_seed(9)
    wide = make_source(g, "cpu", num_slots=a.canary_buf.shape[0], page_size=4, nbpt=32, read_bytes=32,
                       dtype=torch.uint8)
    narrow = type(wide)(tensor=wide.tensor[:, :64], page_size=4, num_bytes_per_token=32, read_bytes=32)
    bad = _sibling(ctx, 3, mode=RealKvHashMode.PARTIAL, sources=(narrow,))
    _compare([a, bad, c], vp, False, launch_verify_many)
