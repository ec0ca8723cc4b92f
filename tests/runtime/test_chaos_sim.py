"""Chaos on the simulated engine: the canary's internals fail at seeded points; the engine never notices.

Each case runs the same seeded workload (with a fork and a host offload / restore) canary-off and with a
canary whose internals raise once (`tests.chaos_support`). Log mode: every forward's batch (ids, positions,
slots), the engine's own RNG and torch's RNG end as in the canary-off run, no request is lost, nothing is
reported as a violation, the canary says it is suspended and ``checked_forwards < engine_forwards`` once
forwards ran after the failure. Raise mode: one `KvCanaryError` chaining the injected cause; the engine then
serves on without the canary.
"""
from __future__ import annotations

import logging

import pytest
import torch

from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload
from kvcanary.engines.sim.moves import SimMoves
from kvcanary.errors import KvCanaryError
from tests.chaos_support import MOVE_POINTS, RUNTIME_POINTS, ChaosError, ChaosRow, emit_table, inject, pick_cases
from tests.runtime.conftest import make_canary

STEPS = 36
SIM = dict(seed=11, num_slots=768, max_running=6)
CANARY = dict(sweep_interval=4, chain_position_warmup=2)
ROWS: list[ChaosRow] = []


def _scenario(canary_options=None, holder=None):
    """(trace, engine, canary): the seeded workload with a fork at step 12 and an offload / restore at 16 / 20.
    ``holder`` (a list) receives the engine as soon as it exists."""
    sc = SimConfig(**SIM)
    canary = None
    if canary_options is not None:
        canary = make_canary(sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                             **{**CANARY, **canary_options})
    engine = SimEngine(sc, canary)
    if holder is not None:
        holder.append(engine)
    moves = SimMoves(engine)
    stream = SimWorkload(seed=3, new_tokens=(20, 40), abort_prob=0.0, arrival_prob=0.5).stream(sc.max_context)
    trace = []
    offloaded = None
    for step in range(STEPS):
        for prompt, new in next(stream):
            engine.add_request(prompt, new)
        busy = [r for r in engine.running if r.num_computed >= 8 and r.max_new - r.generated >= 4]
        if step == 12 and busy:
            moves.fork(busy[0].rid, busy[0].rid + "-fork")
            trace.append(("fork", busy[0].rid))
        if step == 16 and len(busy) > 1:
            offloaded = busy[-1].rid
            moves.offload(offloaded)
            trace.append(("offload", offloaded))
        if step == 20 and offloaded is not None:
            moves.restore(offloaded)
            trace.append(("restore", offloaded))
        batch = engine.step()
        if batch is not None:
            trace.append((batch.input_ids.tolist(), batch.positions.tolist(),
                          {g: gb.out_cache_loc.tolist() for g, gb in batch.groups.items()}))
    trace.append(("end", engine.finished, engine.aborted, len(engine.running), len(engine.waiting),
                  engine.rng.getstate()))
    return trace, engine, canary


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(1234)
    trace, engine, _ = _scenario(None)
    return trace, engine.forwards, torch.get_rng_state()


def _cases():
    return pick_cases(20261204, RUNTIME_POINTS + MOVE_POINTS, 14, max_call=STEPS // 2,
                      max_calls={"moves": 1, "sweep_live": 6, "flush": 2})


def _raise_cases():
    forward = [p for p in RUNTIME_POINTS if p.stage == "forward"]
    return pick_cases(7, forward, 4, max_call=8)


@pytest.mark.parametrize("point,at_call,when", _cases(), ids=lambda v: getattr(v, "name", str(v)))
def test_log_mode_canary_failure_never_changes_the_engine(point, at_call, when, reference, monkeypatch, caplog):
    ref_trace, ref_forwards, ref_rng = reference
    inj = inject(monkeypatch, point, at_call=at_call, when=when)
    torch.manual_seed(1234)
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        trace, engine, canary = _scenario({})
    assert trace == ref_trace  # every forward, move and the engine's RNG as without the canary
    assert torch.equal(torch.get_rng_state(), ref_rng)  # the canary drew no random numbers
    c = canary.counters()
    assert c["total"] == 0  # a failure is never reported as corruption
    assert c["engine_forwards"] == engine.forwards == ref_forwards
    suspended = c["suspended"] is not None
    if inj.fired:
        assert suspended and "ChaosError" in c["suspended"]
        assert c["coverage"]["canary_errors"] >= 1
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "suspended" in r.getMessage()]
        assert len(errors) == 1  # said once
        after = engine.forwards - _forward_of_failure(canary)
        if after > 0:
            assert c["checked_forwards"] < c["engine_forwards"]  # the health signal shows the stop
            assert c["coverage"]["unchecked_forwards"] >= after
        assert "state=suspended" in canary.stats().line()
    else:
        assert not suspended and c["checked_forwards"] == c["engine_forwards"]
    # the process still serves: more steps on the same engine, the canary closed
    canary.close()
    engine.canary = None  # the simulated engine's detach
    engine.add_request([5, 6, 7, 8], 4)
    assert engine.run(4) == 4
    ROWS.append(ChaosRow(engine="sim", mode="log", case=inj.label, fired=inj.fired, same_outputs=trace == ref_trace,
                         engine_forwards=c["engine_forwards"], checked_forwards=c["checked_forwards"],
                         unchecked_forwards=c["coverage"]["unchecked_forwards"], suspended=suspended,
                         serves_after=True, notes=point.stage))


def _forward_of_failure(canary) -> int:
    """Engine forwards that ran before the canary stopped (checked ones plus the failing one)."""
    return canary.engine_forwards - canary.unchecked_forwards


@pytest.mark.parametrize("point,at_call,when", _raise_cases(), ids=lambda v: getattr(v, "name", str(v)))
def test_raise_mode_canary_failure_is_one_kvcanary_error(point, at_call, when, monkeypatch):
    inj = inject(monkeypatch, point, at_call=at_call, when=when)
    holder: list = []
    with pytest.raises(KvCanaryError) as err:
        _scenario(dict(mode="raise"), holder)
    assert inj.fired
    assert isinstance(err.value.__cause__, ChaosError) and str(err.value).startswith("kv-canary:")
    # detached, the same engine serves on
    engine = holder[0]
    engine.canary = None
    engine.add_request([5, 6, 7, 8], 4)
    assert engine.run(6) == 6
    ROWS.append(ChaosRow(engine="sim", mode="raise", case=inj.label, fired=True, same_outputs=None, engine_forwards=0,
                         checked_forwards=0, unchecked_forwards=0, suspended=True, serves_after=True,
                         notes="KvCanaryError"))


def test_zz_print_the_chaos_table():
    if ROWS:
        emit_table("chaos: simulated engine (CPU)", ROWS)


def test_a_suspended_canary_shows_in_metrics_and_the_periodic_line(monkeypatch, caplog):
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvcanary.runtime.metrics import register_metrics
    from tests.runtime.conftest import make_sim

    inject(monkeypatch, RUNTIME_POINTS[2], at_call=3)  # ForwardLaunches.head, third forward
    engine, canary = make_sim(seed=4, canary_options=dict(stats_interval=4))
    registry = prometheus_client.CollectorRegistry()
    register_metrics(canary, registry=registry, name="e0")
    with caplog.at_level(logging.INFO, logger="kvcanary"):
        engine.run(12)

    def value(name, labels):
        return registry.get_sample_value(name, {"canary": "e0", **labels})

    reason = canary.suspended
    assert reason.startswith("before_forward: ChaosError")
    assert value("kvcanary_suspended", {"reason": reason}) == 1
    assert value("kvcanary_forwards_total", {"state": "engine"}) == 12
    assert value("kvcanary_forwards_total", {"state": "checked"}) == 2
    assert value("kvcanary_forwards_total", {"state": "unchecked"}) == 10
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary stats:")]
    assert lines and "state=suspended" in lines[-1] and "engine_forwards=12" in lines[-1]
