"""Timing jitter on the CPU (docs/design.md §3.11): the torch twins really stall the calling thread, for at least the
longest fired draw at `HOST_NS_PER_CYCLE`, before they read records or real KV, so another host thread's write
can land first. Lower bounds only: never a wall-clock upper bound."""
from __future__ import annotations

import threading
import time

import torch

from kvcanary.ops import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    CanaryLaunchTag,
    FailReason,
    KernelJitter,
    RealKvHashMode,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel_torch_reference,
)
from kvcanary.ops.reference.jitter import (
    HOST_NS_PER_CYCLE, HOST_SLEEP_MARGIN_NS, HOST_SLEEP_MIN_NS, apply_jitter_torch_reference, host_stall, jitter_draws,
)

from . import oracle
from .oracle import H0, s64

KIND = int(CanaryLaunchTag.TAIL_K_FULL)
KV = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)


def _jitter(prob: float, max_cycles: int, seed: int = 11, step: int = 3) -> KernelJitter:
    return KernelJitter.create(fire_prob=prob, max_cycles=max_cycles, seed=seed,
                               launch_key=torch.tensor([step], dtype=torch.int64),
                               counters=torch.zeros(2, dtype=torch.int64))


class FakeClock:
    """A ns clock that moves only when ``sleep`` is called (by the seconds asked, and 1 µs for ``sleep(0)``)."""

    def __init__(self) -> None:
        self.now, self.sleeps = 10_000, []

    def clock(self) -> int:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += int(seconds * 1e9) if seconds > 0 else 1_000


def test_host_stall_sleeps_then_polls_to_the_deadline():
    long_ns = 3_000_000
    fake = FakeClock()
    waited = host_stall(long_ns, clock=fake.clock, sleep=fake.sleep)
    assert fake.sleeps[0] == (long_ns - HOST_SLEEP_MARGIN_NS) / 1e9
    assert fake.sleeps[1:] == [0] * (HOST_SLEEP_MARGIN_NS // 1_000)  # polled the margin away, one µs a poll
    assert waited == long_ns
    short = FakeClock()
    assert host_stall(HOST_SLEEP_MIN_NS - 1, clock=short.clock, sleep=short.sleep) >= HOST_SLEEP_MIN_NS - 1
    assert set(short.sleeps) == {0}  # short stalls never sleep a time slice
    late = FakeClock()
    late.sleep = lambda s, _f=late: (_f.sleeps.append(s), setattr(_f, "now", _f.now + 5_000_000))  # oversleeps
    assert host_stall(HOST_SLEEP_MIN_NS, clock=late.clock, sleep=late.sleep) == 5_000_000
    assert late.sleeps == [(HOST_SLEEP_MIN_NS - HOST_SLEEP_MARGIN_NS) / 1e9]  # already past the deadline


def test_host_stall_waits_at_least_the_time_asked():
    for ns in (1, 30_000, HOST_SLEEP_MIN_NS, 3_000_000):
        t0 = time.perf_counter_ns()
        waited = host_stall(ns)
        assert waited >= ns and time.perf_counter_ns() - t0 >= ns


def test_twin_stalls_once_for_the_longest_fired_draw():
    slots = torch.arange(1, 300)
    j = _jitter(0.3, max_cycles=7_000)
    fire, cycles = jitter_draws(j, KIND, slots)
    assert 0 < int(fire.sum()) < slots.numel()
    asked = []
    apply_jitter_torch_reference(j, KIND, slots, stall=asked.append)
    assert asked == [int(cycles[fire].max()) * HOST_NS_PER_CYCLE]
    assert j.counters.tolist() == [int(fire.sum()), int(cycles[fire].sum())]
    never = _jitter(0.0, max_cycles=7_000)
    apply_jitter_torch_reference(never, KIND, slots, stall=asked.append)
    apply_jitter_torch_reference(j, KIND, slots[:0], stall=asked.append)
    assert len(asked) == 1 and never.counters.tolist() == [0, 0]


def test_verify_twin_takes_at_least_the_drawn_stall(make_context, make_verify_plan):
    slots = [3, 7, 12]
    j = _jitter(1.0, max_cycles=20_000_000)
    _, cycles = jitter_draws(j, KIND, torch.tensor(slots))
    drawn_ns = int(cycles.max()) * HOST_NS_PER_CYCLE
    ctx = make_context(num_slots=16)
    t0 = time.perf_counter_ns()
    launch_canary_verify_kernel_torch_reference(context=ctx, plan=make_verify_plan(slots, [0] * 3, [-1] * 3),
                                                check_verify_expected_token=False, jitter=j)
    assert time.perf_counter_ns() - t0 >= drawn_ns > 1_000_000
    assert j.counters.tolist() == [3, int(cycles.sum())]


# --------------------------------------------------------- a host thread's write lands during the stall

STALL_CYCLES = 400_000_000  # up to 0.4 s: the flipping thread polls every 0.5 ms


def _flip_once_the_launch_stalls(jitter: KernelJitter, flip, done: threading.Event) -> threading.Thread:
    """A thread that flips once ``jitter`` counted a stall (the twin counts, then stalls, then reads), or once
    ``done`` is set (the launch returned without stalling)."""

    def run() -> None:
        while int(jitter.counters[0]) == 0 and not done.is_set():
            time.sleep(0.0005)
        flip()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _hashed(make_context, make_source, gen, num_slots=16):
    src = make_source(num_slots=num_slots, num_bytes_per_token=32, generator=gen)
    return make_context(num_slots=num_slots, sources=[src], mode=RealKvHashMode.PARTIAL), src


def _flip_byte(src, slot: int, byte: int = 5) -> None:
    src.tensor[slot].view(torch.uint8)[byte] ^= 0x5A


def test_verify_twin_reads_real_kv_after_the_stall(make_context, make_source, make_verify_plan, gen):
    """With a stall, a byte flipped by another thread once the stall began is in what the verify reads; without one
    (fire probability 0) the same thread flips only after the launch, and the verify is clean."""
    slot = 9
    assert int(jitter_draws(_jitter(1.0, STALL_CYCLES), KIND, torch.tensor([slot]))[1][0]) >= STALL_CYCLES // 4
    for prob, want in ((1.0, [[KIND, slot, 0, slot, -1, s64(H0), s64(H0), KV]]), (0.0, [])):
        ctx, src = _hashed(make_context, make_source, gen)
        fp = oracle.fingerprint(oracle.OracleCanary.of(ctx).sources, ctx.real_kv_hash_mode, slot)
        f = ctx.canary_buf.view(torch.int64)
        for field, value in ((CANARY_FIELD_TOKEN, slot), (CANARY_FIELD_POSITION, 0), (CANARY_FIELD_PREV_HASH, s64(H0)),
                             (CANARY_FIELD_REAL_KV_HASH, s64(fp))):
            f[slot, field] = value
        j, done = _jitter(prob, STALL_CYCLES), threading.Event()
        t = _flip_once_the_launch_stalls(j, lambda: _flip_byte(src, slot), done)
        launch_canary_verify_kernel_torch_reference(context=ctx, plan=make_verify_plan([slot], [0], [-1]),
                                                    check_verify_expected_token=False, jitter=j)
        done.set()
        t.join()
        n = int(ctx.violation_write_index[0])
        assert [list(map(int, r)) for r in ctx.violation_ring[:n].tolist()] == want, prob


def test_write_twin_fingerprints_real_kv_after_the_stall(make_context, make_source, make_write_plan, gen):
    """The write's stored fingerprint covers a byte another thread flipped during the stall."""
    slot = 9
    ctx, src = _hashed(make_context, make_source, gen)
    j, done = _jitter(1.0, STALL_CYCLES), threading.Event()
    assert int(jitter_draws(j, KIND, torch.tensor([slot]))[1][0]) >= STALL_CYCLES // 4
    t = _flip_once_the_launch_stalls(j, lambda: _flip_byte(src, slot), done)
    launch_canary_write_kernel_torch_reference(
        context=ctx, plan=make_write_plan([1], [-1]), input_ids=torch.tensor([42]), positions=torch.tensor([0]),
        out_cache_loc=torch.tensor([slot]), enable_write_input_assert=False, expected_input_tokens=None,
        expected_input_positions=None, jitter=j)
    done.set()
    t.join()
    assert j.counters[0] == 1
    sources = oracle.OracleCanary.of(ctx).sources
    stored = int(ctx.canary_buf.view(torch.int64)[slot, CANARY_FIELD_REAL_KV_HASH])
    assert stored == s64(oracle.fingerprint(sources, ctx.real_kv_hash_mode, slot))  # the flipped bytes
    _flip_byte(src, slot)
    assert stored != s64(oracle.fingerprint(oracle.OracleCanary.of(ctx).sources, ctx.real_kv_hash_mode, slot))
