"""Timing jitter (docs/design.md §3.11): the Triton verify / write kernels under the interpreter draw and count
exactly the stalls the torch twins count, for random cases and several fire probabilities; without a jitter, or
with fire probability 0, every byte and counter is what the launch without jitter gives."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it on machines without a GPU
    pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError  # noqa: E402
from kvcanary.ops import (  # noqa: E402
    KernelJitter,
    VerifyPlan,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_verify_kernels,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
    launch_canary_write_kernels,
)
from kvcanary.ops.dispatch import selected_backend  # noqa: E402
from kvcanary.ops.hashing import splitmix64, splitmix64_mix3, to_signed64  # noqa: E402
from kvcanary.ops.jitter import JITTER_MAX_CYCLES_LIMIT, fire_threshold_of  # noqa: E402
from kvcanary.ops.reference.jitter import jitter_draws  # noqa: E402
from kvcanary.ops.triton import launch_verify, launch_verify_many, launch_write, launch_write_many  # noqa: E402
from kvcanary.ops.triton.jitter import spin_on  # noqa: E402
from kvcanary.ops.triton.write import WriteLaunchConfig  # noqa: E402

from .test_triton_interpret import _numpy_scalar_index_fix  # noqa: E402,F401  (patches the interpreter)
from .triton_cases import (  # noqa: E402
    clone_context,
    compare_context_runs,
    context_state,
    make_case,
    make_context,
    make_source,
    many_requests_write,
    run_plan,
    sibling_context,
    write_inputs,
    write_plan,
)

PROBS = (0.0, 0.01, 0.3, 1.0)
WRITE_PATHS = (WriteLaunchConfig(), WriteLaunchConfig(small_lanes=0))


def _jitter(prob: float, seed: int, step: int, max_cycles: int = 2000) -> KernelJitter:
    return KernelJitter.create(fire_prob=prob, max_cycles=max_cycles, seed=seed,
                               launch_key=torch.tensor([step], dtype=torch.int64),
                               counters=torch.zeros(2, dtype=torch.int64))


def _clone_jitter(j: KernelJitter) -> KernelJitter:
    return KernelJitter(params=j.params.clone(), launch_key=j.launch_key.clone(), counters=j.counters.clone())


def _planned(seed: int):
    case = make_case(seed, mode=seed % 3, nsrc=(seed // 3) % 5)
    _, err, (vp, wp) = run_plan(launch_canary_plan_kernels_torch_reference, case)
    return case, vp, wp, err


def _run_pair(twin, fast, contexts, jitter):
    """Twin and Triton on clones of ``contexts``, each with a clone of ``jitter``: same states (compare_context_runs)
    and the same jitter counters, which are returned."""
    jt, jf = _clone_jitter(jitter), _clone_jitter(jitter)
    compare_context_runs(contexts, lambda cs: twin(cs, jt), lambda cs: fast(cs, jf), kept_rows_may_differ=True)
    assert torch.equal(jt.counters, jf.counters), (jt.counters, jf.counters)
    return jt.counters


# ---------------------------------------------------------------------------------------------- the draw


def test_draw_matches_the_scalar_definition():
    """The twin's tensor draw equals the docstring's formula in Python ints (mix3, splitmix64, low 16 bits,
    multiply-shift of the high 32)."""
    j = _jitter(0.3, seed=-12345678901, step=77, max_cycles=1999)
    slots = torch.tensor([0, 1, 2, 511, 1 << 40, -3], dtype=torch.int64)
    fire, cycles = jitter_draws(j, 9, slots)
    threshold = fire_threshold_of(0.3)
    for s, f, c in zip(slots.tolist(), fire.tolist(), cycles.tolist()):
        key = splitmix64_mix3(-12345678901, 77, 9)
        h = splitmix64(key ^ (s & (2**64 - 1)))
        assert f == ((h & 0xFFFF) < threshold)
        assert c == 1 + (((h >> 32) * 1999) >> 32)
        assert 1 <= c <= 1999


def test_draw_rate_and_range():
    j = _jitter(0.25, seed=3, step=5, max_cycles=1000)
    fire, cycles = jitter_draws(j, 0, torch.arange(1, 200_001))
    assert abs(fire.double().mean().item() - 0.25) < 0.005
    assert int(cycles.min()) == 1 and int(cycles.max()) == 1000
    always, _ = jitter_draws(_jitter(1.0, 3, 5), 0, torch.arange(1, 1000))
    never, _ = jitter_draws(_jitter(0.0, 3, 5), 0, torch.arange(1, 1000))
    assert bool(always.all()) and not bool(never.any())


def test_draw_depends_on_seed_step_and_tag():
    slots = torch.arange(1, 4097)
    base = jitter_draws(_jitter(0.5, 1, 1), 0, slots)[0]
    for other in (jitter_draws(_jitter(0.5, 2, 1), 0, slots)[0], jitter_draws(_jitter(0.5, 1, 2), 0, slots)[0],
                  jitter_draws(_jitter(0.5, 1, 1), 1, slots)[0]):
        assert not torch.equal(base, other)
    assert torch.equal(base, jitter_draws(_jitter(0.5, 1, 1), 0, slots)[0])


def test_create_validates_and_quantises():
    j = _jitter(0.001, seed=2**64 - 1, step=0)
    assert j.params.tolist() == [to_signed64(2**64 - 1), 66, 2000]  # round(0.001 * 65536) = 66
    for bad in (-0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(KvCanaryValueError, match="^kv-canary: jitter fire_prob must be a number in"):
            _jitter(bad, 0, 0)
    for bad in (0, JITTER_MAX_CYCLES_LIMIT + 1, 2.5):
        with pytest.raises(KvCanaryValueError, match="^kv-canary: jitter max_cycles must be an integer"):
            _jitter(0.1, 0, 0, max_cycles=bad)
    with pytest.raises(KvCanaryValueError, match="^kv-canary: KernelJitter.counters must be contiguous int64"):
        KernelJitter(params=j.params, launch_key=j.launch_key, counters=torch.zeros(3, dtype=torch.int64))


def test_launchers_check_the_jitter_argument():
    case, vp, wp, err = _planned(1)
    assert err is None
    with pytest.raises(KvCanaryTypeError, match="^kv-canary: launch_canary_verify_kernel jitter must be a KernelJitter"):
        launch_canary_verify_kernel(context=case.ctx, plan=vp, check_verify_expected_token=False, jitter=object())
    meta = KernelJitter(params=torch.zeros(3, dtype=torch.int64, device="meta"),
                        launch_key=torch.zeros(1, dtype=torch.int64, device="meta"),
                        counters=torch.zeros(2, dtype=torch.int64, device="meta"))
    with pytest.raises(KvCanaryValueError, match="^kv-canary: launch_canary_write_kernels jitter is on meta"):
        launch_canary_write_kernels(contexts=[case.ctx], plan=wp, jitter=meta, **case.write_kwargs)


def test_the_interpreter_never_spins():
    assert not spin_on(torch.device("cpu"))


# ------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("prob", PROBS)
@pytest.mark.parametrize("seed", range(16))
def test_verify_parity(seed, prob):
    case, vp, _wp, err = _planned(seed)
    if err is not None:
        return
    jitter = _jitter(prob, seed=seed, step=seed + 1)
    check = bool(seed % 2)
    counters = _run_pair(
        lambda cs, j: launch_canary_verify_kernel_torch_reference(context=cs[0], plan=vp, check_verify_expected_token=check, jitter=j),
        lambda cs, j: launch_verify(context=cs[0], plan=vp, check_verify_expected_token=check, jitter=j),
        [case.ctx], jitter)
    if prob == 0.0:
        assert counters.tolist() == [0, 0]
    if prob == 1.0 and int(vp.enable[0]):
        active = vp.verify_slot_indices[: max(0, min(int(vp.verify_num_valid[0]), vp.capacity))]
        assert int(counters[0]) == int((active != 0).sum())


@pytest.mark.parametrize("prob", PROBS)
@pytest.mark.parametrize("seed", range(10))
def test_write_parity(seed, prob):
    case, _vp, wp, err = _planned(seed)
    if err is not None:
        return
    jitter = _jitter(prob, seed=100 + seed, step=3)
    for config in WRITE_PATHS:
        _run_pair(
            lambda cs, j: launch_canary_write_kernel_torch_reference(context=cs[0], plan=wp, jitter=j, **case.write_kwargs),
            lambda cs, j: launch_write(context=cs[0], plan=wp, config=config, jitter=j, **case.write_kwargs),
            [case.ctx], jitter)


@pytest.mark.parametrize("prob", (0.01, 0.3))
def test_verify_many_blocks_parity(prob):
    """A 700-entry plan (several blocks per program, slot 0 and out-of-range entries among them) over a
    fingerprinted buffer: the same counts, and some stalls."""
    g = torch.Generator().manual_seed(5)
    src = make_source(g, "cpu", num_slots=800, page_size=4, nbpt=32, read_bytes=32, dtype=torch.bfloat16)
    ctx = make_context(g, "cpu", num_slots=800, stride_bytes=32, ring_cap=64, sources=[src], mode=1, chain_assert=0,
                       kind=7)
    n = 700
    vp = VerifyPlan.allocate(n + 20, "cpu")
    vp.verify_slot_indices.copy_(torch.randint(-2, 820, (n + 20,), generator=g))
    vp.verify_slot_indices[::13] = 0
    vp.verify_prev_slot_indices.copy_(torch.randint(-1, 800, (n + 20,), generator=g))
    vp.verify_expected_positions.copy_(torch.randint(0, 50, (n + 20,), generator=g))
    vp.verify_expected_tokens.copy_(torch.randint(-1, 50, (n + 20,), generator=g))
    vp.verify_num_valid[0] = n
    counters = _run_pair(
        lambda cs, j: launch_canary_verify_kernel_torch_reference(context=cs[0], plan=vp, check_verify_expected_token=True, jitter=j),
        lambda cs, j: launch_verify(context=cs[0], plan=vp, check_verify_expected_token=True, jitter=j),
        [ctx], _jitter(prob, seed=1, step=2))
    assert int(counters[0]) > 0 and int(counters[1]) >= int(counters[0])


@pytest.mark.parametrize("prob", (0.05, 0.5))
def test_write_many_requests_parity(prob):
    """150 requests (one-token lanes, long requests), then an aliased seed (serial mode), on both write paths."""
    ctx = make_context(torch.Generator().manual_seed(7), "cpu", num_slots=512, stride_bytes=32, ring_cap=1024,
                       sources=(), mode=0, chain_assert=1, kind=2)
    for aliased in (False, True):
        wp, kw = many_requests_write(aliased)
        for config in WRITE_PATHS:
            counters = _run_pair(
                lambda cs, j: launch_canary_write_kernel_torch_reference(context=cs[0], plan=wp, jitter=j, **kw),
                lambda cs, j: launch_write(context=cs[0], plan=wp, config=config, jitter=j, **kw),
                [ctx], _jitter(prob, seed=11, step=42))
            assert int(counters[0]) > 0


@pytest.mark.parametrize("seed", range(6))
def test_two_context_launches_draw_per_context(seed):
    """The paired launches (TAIL K + V) draw per context under each context's tag: the counts of one launch per
    context, in order."""
    case, vp, wp, err = _planned(seed)
    if err is not None:
        return
    other = sibling_context(case.ctx, seed, kind=int(case.ctx.kernel_kind) ^ 1)
    jitter = _jitter(0.4, seed=seed, step=9)
    check = bool(seed % 2)
    _run_pair(
        lambda cs, j: [launch_canary_verify_kernel_torch_reference(context=c, plan=vp, check_verify_expected_token=check,
                                                                   jitter=j) for c in cs],
        lambda cs, j: launch_verify_many(contexts=cs, plan=vp, check_verify_expected_token=check, jitter=j),
        [case.ctx, other], jitter)
    for config in WRITE_PATHS:
        _run_pair(
            lambda cs, j: [launch_canary_write_kernel_torch_reference(context=c, plan=wp, jitter=j, **case.write_kwargs)
                           for c in cs],
            lambda cs, j: launch_write_many(contexts=cs, plan=wp, config=config, jitter=j, **case.write_kwargs),
            [case.ctx, other], jitter)


# ----------------------------------------------------------------------------- off = the launch of today


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed", range(6))
def test_off_or_zero_probability_changes_nothing(seed, backend):
    """jitter=None and fire_prob=0 give the bytes, rings, indices and counters of the launch without the argument,
    and leave the jitter counters at 0; a jitter that fires changes only its own counters."""
    case, vp, wp, err = _planned(seed)
    if err is not None:
        return

    def run(jitter_kw):
        ctx = clone_context(case.ctx)
        with selected_backend(backend):
            launch_canary_write_kernel(context=ctx, plan=wp, **case.write_kwargs, **jitter_kw)
            launch_canary_verify_kernels(contexts=[ctx], plan=vp, check_verify_expected_token=True, **jitter_kw)
        return context_state(ctx)

    plain = run({})
    zero = _jitter(0.0, seed=seed, step=1)
    firing = _jitter(1.0, seed=seed, step=1)
    for state in (run(dict(jitter=None)), run(dict(jitter=zero)), run(dict(jitter=firing))):
        for key in ("buf", "ring", "counters"):
            assert torch.equal(plain[key], state[key]), key
        assert plain["index"] == state["index"]
    assert zero.counters.tolist() == [0, 0]


def test_lazy_error_counts_no_stall():
    """A launch that raises its lazy check (a canary stride under 4 fields) stalls nothing, on both paths."""
    for impl in (launch_canary_write_kernel_torch_reference, launch_write):
        ctx = make_context(torch.Generator().manual_seed(1), "cpu", num_slots=16, stride_bytes=24, ring_cap=4,
                           sources=(), mode=0, chain_assert=0, kind=0)
        j = _jitter(1.0, 0, 0)
        with pytest.raises(ValueError, match="slot stride must hold at least 4"):
            impl(context=ctx, plan=write_plan([2], [-1]), jitter=j, **write_inputs([1, 2], [0, 1], [1, 2]))
        assert j.counters.tolist() == [0, 0]
