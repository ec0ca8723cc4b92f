"""`launch_canary_write_kernels`: several contexts on the same entries == one write per context, in order.

Triton's two-context single-CTA launch (``launch_write_many``) runs under the interpreter (CPU,
TRITON_INTERPRET=1); the public launcher's argument checks and CPU loop run everywhere.
"""
from __future__ import annotations

import os

import pytest
import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops import (
    RealKvHashMode,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_write_kernel_torch_reference,
    launch_canary_write_kernels,
)

from .triton_cases import (
    clone_context, compare_context_runs, context_state, make_case, make_context, make_source, many_requests_write,
    run_plan, sibling_context, write_inputs, write_plan,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _compare(contexts, wp, kw, many):
    """One twin write per context, in order, against ``many`` on all of them (the small kernel appends one-entry
    rows before longer requests' rows, so a ring that fills may keep other rows). Returns what ``many`` returned
    (``()`` if it raised)."""
    def twin(cs):
        for c in cs:
            launch_canary_write_kernel_torch_reference(context=c, plan=wp, **kw)

    launches = []  # what ``many`` returns: contexts per kernel launch (the Triton launcher's), when it returns
    compare_context_runs(contexts, twin, lambda cs: launches.append(many(contexts=cs, plan=wp, **kw)),
                         kept_rows_may_differ=True)
    return launches[0] if launches else ()


def _case(seed: int):
    case = make_case(seed, mode=seed % 3, nsrc=(seed // 3) % 5)
    _, err, (_vp, wp) = run_plan(launch_canary_plan_kernels_torch_reference, case)
    return (None, None, None) if err is not None else (case.ctx, wp, case.write_kwargs)


def _other_sources(ctx, seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(make_source(g, "cpu", num_slots=ctx.canary_buf.shape[0], page_size=4, nbpt=32, read_bytes=32,
                             dtype=torch.bfloat16) for _ in range(1 + seed % 4))


def test_cpu_loop_equals_one_call_per_context():
    for seed in range(5):
        ctx, wp, kw = _case(seed)
        if ctx is not None:
            _compare([ctx, sibling_context(ctx, seed)], wp, kw, launch_canary_write_kernels)


def test_argument_errors_touch_nothing():
    ctx, wp, kw = _case(1)
    before = context_state(ctx)
    with pytest.raises(KvCanaryTypeError, match="kv-canary: launch_canary_write_kernels contexts must be a sequence"):
        launch_canary_write_kernels(contexts=ctx, plan=wp, **kw)
    with pytest.raises(KvCanaryValueError, match="needs at least one context"):
        launch_canary_write_kernels(contexts=(), plan=wp, **kw)
    bad = dict(kw, positions=kw["positions"][:-1]) if kw["positions"].shape[0] else dict(kw, positions=kw["positions"][None])
    with pytest.raises(KvCanaryValueError, match="kv-canary: launch_canary_write_kernels"):
        launch_canary_write_kernels(contexts=[ctx, sibling_context(ctx, 1)], plan=wp, **bad)
    after = context_state(ctx)
    assert torch.equal(before["buf"], after["buf"]) and torch.equal(before["counters"], after["counters"])


if INTERPRET:
    from .test_triton_interpret import _numpy_scalar_index_fix  # noqa: F401  (applies the interpreter patch)
    from kvcanary.ops.triton import launch_write_many


def _small(wp, kw) -> bool:
    """The launch runs as the single-CTA kernel (a decode-sized batch), not the prepare + chain pair."""
    from kvcanary.ops.triton.write import DEFAULT_WRITE_CONFIG, _small

    return _small(wp, kw["out_cache_loc"], DEFAULT_WRITE_CONFIG)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set before Triton is imported")
@pytest.mark.parametrize("seed", range(18))
def test_two_contexts_in_one_launch_match_the_twin(seed):
    """Fuzz cases (0-4 sources, every mode, duplicate and skipped slots, input asserts): the case's context
    and a sibling (for odd seeds other sources, mode and row width) written by one single-CTA launch."""
    ctx, wp, kw = _case(seed)
    if ctx is None:
        pytest.skip("the case's plan raises")
    other = (sibling_context(ctx, seed, mode=RealKvHashMode((seed // 2) % 3), sources=_other_sources(ctx, seed),
                             stride_bytes=[32, 48, 64][seed % 3]) if seed % 2 else sibling_context(ctx, seed))
    launched = _compare([ctx, other], wp, kw, launch_write_many)
    if launched and _small(wp, kw):  # the small kernel took the launch (no lazy error, addressable sources): as one pair
        assert launched == (2,), launched


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set before Triton is imported")
def test_pairs_on_hand_cases_serial_long_and_three_contexts():
    """Aliasing (serial mode), a long request among one-token ones, chain-position rows; three contexts (a
    pair, then one); a pair that shares a ring or a buffer is never fused."""
    g = torch.Generator().manual_seed(5)
    a = make_context(g, "cpu", num_slots=512, stride_bytes=32, ring_cap=1024, sources=(), mode=RealKvHashMode.NONE,
                     chain_assert=1, kind=2)
    b, c = sibling_context(a, 2, kind=3), sibling_context(a, 4, kind=5)
    wp, kw = many_requests_write()
    assert _small(wp, kw)
    launched = _compare([a, b, c], wp, kw, launch_write_many)
    wp, kw = many_requests_write(aliased=True)  # request 120 seeds from a slot request 3 stores: serial mode
    launched += _compare([a, b], wp, kw, launch_write_many)
    assert launched.count(2) == 2 and launched.count(1) == 1, launched
    same_ring = type(b)(**{**b.__dict__, "violation_ring": a.violation_ring, "violation_write_index": a.violation_write_index})
    wp = write_plan([2, 1], [-1, 9])
    small = write_inputs([1, 2, 3], [0, 1, 7], [3, 4, 5])
    twin_a = clone_context(a)
    twin_b = type(same_ring)(**{**clone_context(same_ring).__dict__, "violation_ring": twin_a.violation_ring,
                                "violation_write_index": twin_a.violation_write_index})
    for x in (twin_a, twin_b):
        launch_canary_write_kernel_torch_reference(context=x, plan=wp, **small)
    fast_a = clone_context(a)
    fast_b = type(same_ring)(**{**clone_context(same_ring).__dict__, "violation_ring": fast_a.violation_ring,
                                "violation_write_index": fast_a.violation_write_index})
    assert launch_write_many(contexts=[fast_a, fast_b], plan=wp, **small) == (1, 1)
    assert torch.equal(fast_a.canary_buf, twin_a.canary_buf) and torch.equal(fast_b.canary_buf, twin_b.canary_buf)
    assert torch.equal(fast_a.violation_ring, twin_a.violation_ring)
