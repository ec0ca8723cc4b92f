"""The per-forward hot path: no host reads, O(1) Python, violations drained late but attributed exactly.

* The device halves (`begin_step`, `stage`, `launch_head` with its sweep slice, `launch_tail`) run on the ``meta``
  device — tensors without data: any host read (``.item()``, ``.tolist()``, ``bool(t)``, a copy to the
  host) raises there — with the ops replaced by stand-ins that only record their calls (the ops' own
  CUDA path is the Triton kernels; on the CPU the twins read counts, legitimately).
* The drain's asynchronous protocol runs with a stand-in event whose completion the test controls.
* Deferred attribution (rows harvested many steps late, rings overflowing) names the same request, slot,
  position, reason and step as the immediate drain.
"""
from __future__ import annotations

import pytest
import torch

import kvcanary.runtime.launch as launch_mod
import kvcanary.runtime.sweep as sweep_mod
from kvcanary.engines.sim import SimWorkload
from kvcanary.runtime import BatchDescription, Canary, CanaryConfig, GroupBatch, GroupSpec
from kvcanary.runtime.drain import ViolationDrain
from kvcanary.faults.sim_hooks import cached_idle_slots, flip_kv_bit, redirect_slot

from tests.runtime.conftest import QUIET, CountTorchCalls, make_sim

META = torch.device("meta")
OPS = ("launch_canary_plan_kernels", "launch_canary_verify_kernel", "launch_canary_verify_kernels",
       "launch_canary_write_kernel", "launch_canary_write_kernels", "launch_stamp_violation_rows",
       "store_deep_fingerprints", "launch_padding_read_check_kernel")


@pytest.fixture
def op_calls(monkeypatch):
    calls: list[str] = []
    for mod in (launch_mod, sweep_mod):
        for name in OPS:
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, lambda *, _n=name, **kw: calls.append(_n))
    return calls


def _meta_canary() -> Canary:
    groups = [GroupSpec(name="full", num_slots=256, layer_ids=(0, 1)),
              GroupSpec(name="swa", num_slots=64, sliding_window=8, layer_ids=(1,))]
    c = Canary(CanaryConfig(**QUIET, sweep_interval=4, deep_fingerprints=True), groups=groups, max_requests=64, max_context=64,
               max_batch_tokens=512, device=META)
    kv = {layer: (torch.empty(256, 64, dtype=torch.uint8, device=META),) * 2 for layer in (0, 1)}
    c.set_kv_cache("full", kv)
    c.set_kv_cache("swa", {1: (torch.empty(64, 64, dtype=torch.uint8, device=META),) * 2})
    c.set_live_slots_provider(lambda: {"full": torch.arange(1, 9, device=META), "swa": torch.arange(1, 5, device=META)})
    return c


def _meta_batch(bs: int, tables) -> BatchDescription:
    table, tokens, lut = tables
    n = 2 * bs

    def col(length: int) -> torch.Tensor:
        return torch.empty(length, dtype=torch.int64, device=META)

    return BatchDescription(
        req_pool_indices=col(bs), prefix_lens=col(bs), extend_lens=col(bs), input_ids=col(n), positions=col(n),
        groups={"full": GroupBatch(req_to_token=table, out_cache_loc=col(n)),
                "swa": GroupBatch(req_to_token=table, out_cache_loc=col(n), full_to_group_lut=lut)},
        request_ids=tuple(f"r{i}" for i in range(bs)), token_table=tokens, token_table_lens=col(bs),
        forward_kind="decode",
    )


def _device_halves(c: Canary, batch: BatchDescription) -> None:
    c.begin_step(request_ids=batch.request_ids, forward_kind=batch.forward_kind)
    c.stage(batch)
    c.launch_head()  # with the pass's live set taken, the sweep slice too
    c.launch_tail()


def test_device_halves_read_nothing_back_and_cost_the_same_for_any_batch(op_calls):
    c = _meta_canary()
    tables = (torch.empty(64, 64, dtype=torch.int32, device=META), torch.empty(64, 64, dtype=torch.int32, device=META),
              torch.empty(256, dtype=torch.int64, device=META))
    c.sweeper.refresh_live(c._live_slots())
    counts = []
    for bs in (2, 2, 48, 48):  # meta tensors raise on any host read: reaching the end proves there is none
        mode = CountTorchCalls()
        calls_before = len(op_calls)
        with mode:
            _device_halves(c, _meta_batch(bs, tables))
        counts.append((mode.n, len(op_calls) - calls_before))
    # per group: the padding-read check, plan, HEAD verify + write, TAIL verify and TAIL writes (both sides: one
    # call), the deep buffers' fingerprints (one call), one stamp call for the HEAD / TAIL rings; sweep: one verify
    # call, one stamp call
    assert counts[1][1] == 2 * (1 + 3 + 1 + 1 + 1 + 1 + 1 + 1)
    assert c.sweeper.slices_run == 4  # one slice per forward, run by launch_head
    # steady state (same batch size as the step before: no stale padding to clear) costs the same torch calls
    # whatever the batch size: O(1) Python per forward
    assert counts[1] == counts[3], counts


class _Clock:
    """Stand-in for CUDA events: an event completes ``lag`` steps after it was recorded."""

    def __init__(self, lag: int) -> None:
        self.lag, self.now, self.waits = lag, 0, 0
        clock = self

        class Event:
            def record(self, stream) -> None:
                self.t = clock.now

            def query(self) -> bool:
                return clock.now - self.t >= clock.lag

            def synchronize(self) -> None:
                clock.waits += 1

        self.Event = Event


def _lazy_drain(canary: Canary, clock: _Clock, interval: int = 1) -> None:
    canary.drain = ViolationDrain(
        canary.rings, synchronous=False, polled=canary.polled, asynchronous=True, event=clock.Event,
        stream=lambda: None, interval=interval,
    )


def _faulted_run(*, lag: int | None, ring_capacity: int = 1024, interval: int = 1):
    engine, canary = make_sim(seed=3, canary_options=dict(ring_capacity=ring_capacity, sweep_interval=8))
    clock = _Clock(lag or 0)
    if lag is not None:
        _lazy_drain(canary, clock, interval)
    workload = SimWorkload(seed=3, new_tokens=(30, 60), abort_prob=0.0, arrival_prob=0.5)
    stream = workload.stream(engine.config.max_context)

    def run(steps: int) -> None:
        for _ in range(steps):
            for prompt, new in next(stream):
                engine.add_request(prompt, new)
            engine.step()
            clock.now += 1

    run(40)
    victim = next(r for r in engine.running if r.num_computed > 8)
    flip_kv_bit(engine, "full", victim.full_slots[3], side="k", byte=2, bit=5)
    other = next(r for r in engine.running if r is not victim and r.num_computed > 8)
    redirect_slot(engine, other.rid, 5, victim.full_slots[6])
    idle = cached_idle_slots(engine)
    if idle:
        flip_kv_bit(engine, "full", idle[0], side="v", byte=0, bit=0)  # only the sweep sees this one
    run(30)
    waits_before_query = clock.waits
    found = canary.violations()
    return canary, found, waits_before_query


def _key(v):
    return (v.step, v.launch_tag.name, v.slot, v.stored_position, v.expected_position, int(v.reasons),
            v.request_id, v.request_row, v.forward_kind)


def test_drain_never_waits_on_the_forward_path_and_harvests_late():
    canary, found, waits = _faulted_run(lag=3)
    assert found, "the faults must be caught"
    assert waits == 0  # end_step only polled; the first wait is the user's query
    assert canary.drain.asynchronous


@pytest.mark.parametrize("lag,interval", [(1, 1), (7, 1), (1, 4), (3, 4), (7, 2)])
def test_deferred_attribution_matches_the_immediate_drain(lag, interval):
    _, immediate, _ = _faulted_run(lag=None)
    _, deferred, _ = _faulted_run(lag=lag, interval=interval)
    assert {v.launch_tag.phase for v in immediate} >= {"head", "tail", "sweep"}
    assert sorted(map(_key, deferred)) == sorted(map(_key, immediate))


def test_deferred_attribution_with_overflowing_rings_keeps_exact_counts():
    c_now, immediate, _ = _faulted_run(lag=None, ring_capacity=2)
    c_late, deferred, _ = _faulted_run(lag=7, ring_capacity=2)
    a, b = c_now.counters(), c_late.counters()
    assert a["total"] == b["total"] > 0 and a["by_tag"] == b["by_tag"]
    assert b["ring_overflow"] >= a["ring_overflow"] > 0  # rows harvested late share one ring's capacity
    # every row the late drain kept is one the immediate drain saw, with the same attribution
    assert set(map(_key, deferred)) <= set(map(_key, _faulted_run(lag=None)[1]))


@pytest.mark.parametrize("lag,interval", [(1, 4), (3, 4), (6, 4), (2, 1)])
def test_a_violation_reaches_the_ledger_within_two_looks_and_the_lag(lag, interval):
    """Without a user query, a row found at step s is in the ledger by the step after the look that saw it
    completed plus the harvest's lag: s + (interval - 1) + interval * ceil(lag / interval) + lag."""
    engine, canary = make_sim(seed=3, canary_options=dict(sweep_interval=0))
    clock = _Clock(lag)
    _lazy_drain(canary, clock, interval)
    workload = SimWorkload(seed=3, new_tokens=(30, 60), abort_prob=0.0, arrival_prob=0.5)
    stream = workload.stream(engine.config.max_context)

    def step() -> None:
        for prompt, new in next(stream):
            engine.add_request(prompt, new)
        engine.step()
        clock.now += 1

    for _ in range(40):
        step()
    victim = next(r for r in engine.running if r.num_computed > 8)
    flip_kv_bit(engine, "full", victim.full_slots[3], side="k", byte=2, bit=5)
    seen_at = None
    for _ in range(4 * interval + 2 * lag + 8):
        step()
        if seen_at is None and canary.ledger.violations():
            seen_at = canary.step
    assert seen_at is not None, "the flipped bit never reached the ledger without a query"
    found = min(v.step for v in canary.ledger.violations())
    bound = (interval - 1) + interval * -(-lag // interval) + lag
    assert 0 < seen_at - found <= bound, (found, seen_at, bound)
    assert clock.waits == 0


@pytest.mark.parametrize("lag,interval", [(1, 1), (3, 2), (5, 4)])
def test_stats_without_wait_never_waits_and_counts_as_of_a_look(lag, interval):
    """`Canary.stats(wait=False)` (the vLLM adapter's periodic read on CUDA): no wait; its device counts are those of
    the end of step ``forwards``, a look that completed — what the waiting read says once the run has reached it."""
    engine, canary = make_sim(seed=5, canary_options=dict(sweep_interval=0))
    clock = _Clock(lag)
    _lazy_drain(canary, clock, interval)
    workload = SimWorkload(seed=5, new_tokens=(20, 40), abort_prob=0.0, arrival_prob=0.5)
    stream = workload.stream(engine.config.max_context)
    seen = []
    for _ in range(30):
        for prompt, new in next(stream):
            engine.add_request(prompt, new)
        engine.step()
        clock.now += 1
        s = canary.stats(wait=False)
        assert 0 <= canary.step - s.forwards <= interval * -(-lag // interval) + interval - 1
        assert s.forwards == 0 or s.forwards % interval == 0  # looks are taken every interval-th step
        seen.append((s.forwards, s.checked_forwards, sum(s.slots_verified.values())))
    assert clock.waits == 0
    assert seen == sorted(seen) and seen[-1][0] > 0
    exact = canary.stats()  # waits: everything up to now
    assert exact.forwards == canary.step and exact.checked_forwards == canary.step > seen[-1][1]
    assert all(checked == forwards for forwards, checked, _ in seen)  # one HEAD check per forward, no lag between them
