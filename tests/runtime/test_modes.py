"""Modes, health watchdog, ring overflow, sinks, capacity growth, re-entrancy, API errors."""
import json
import contextlib
import logging

import pytest

from kvcanary.engines.sim import SimConfig, SimEngine
from kvcanary.ops import CanaryLaunchTag, FailReason
from kvcanary.runtime import CanaryConfig, CanaryHealthError, CanaryViolationError, create_canary

from tests.runtime.conftest import make_sim


def _prefill(m, n=12, row=1, rid="req"):
    tokens = list(range(100, 100 + n))
    slots = list(range(10, 10 + n))
    m.forward(m.batch(row, 0, tokens, slots, rid))
    return tokens, slots


def test_none_mode_attaches_nothing():
    sc = SimConfig()
    assert create_canary(CanaryConfig(mode="none"), groups=sc.group_specs(), max_requests=8, max_context=8) is None
    engine = SimEngine(sc, None)
    assert engine.run(20) > 0


def test_raise_mode_raises_once_at_end_of_step_listing_its_violations(manual):
    m = manual(mode="raise")
    _, slots = _prefill(m)
    m.kv[0][0][slots[2], 0] ^= 1
    m.kv[0][0][slots[5], 0] ^= 1
    with pytest.raises(CanaryViolationError) as err:
        m.forward(m.batch(1, 12, [7], [40]))
    found = err.value.violations
    assert [v.slot for v in found] == [slots[2], slots[5]]
    assert {v.launch_tag for v in found} == {CanaryLaunchTag.TAIL_K_FULL}
    assert all(v.request_id == "req" and v.request_row == 1 for v in found)
    assert [v.expected_position for v in found] == [2, 5]
    assert "kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash" in str(err.value)
    # the step completed: the next clean forward (KV repaired) raises nothing new for other slots
    m.kv[0][0][slots[2], 0] ^= 1
    m.kv[0][0][slots[5], 0] ^= 1
    m.forward(m.batch(1, 13, [8], [41]))


def test_log_mode_keeps_serving_and_writes_log_line_block_and_jsonl(manual, tmp_path, caplog):
    path = tmp_path / "v.jsonl"
    m = manual(mode="log", jsonl_path=str(path), readable_per_step=1)
    _, slots = _prefill(m)
    m.kv[1][1][slots[3], 8] ^= 0x80  # layer 1 (last), V side
    with caplog.at_level(logging.DEBUG, logger="kvcanary"):  # the readable block is a DEBUG record
        m.forward(m.batch(1, 12, [7], [40]))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary violation:"))
    assert line.startswith(
        f"kv_canary violation: launch_tag=TAIL_V_FULL fail_reason=verify_real_kv_hash slot_idx={slots[3]} position=3 "
    )
    assert "request_id=req request_row=1" in line
    assert any("the K/V bytes changed after they were written" in r.getMessage() for r in caplog.records)
    m.canary.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[0]["launch_tag"] == "TAIL_V_FULL" and rows[0]["slot"] == slots[3]
    assert rows[0]["fail_reason"] == "verify_real_kv_hash" and rows[0]["request_id"] == "req"


def test_ring_overflow_keeps_exact_counts(manual):
    m = manual(ring_capacity=3)
    _, slots = _prefill(m, n=12)
    for s in slots[:10]:
        m.kv[0][0][s, 1] ^= 4
    m.forward(m.batch(1, 12, [7], [40]))
    c = m.canary.counters()
    assert c["by_tag"] == {"TAIL_K_FULL": 10}
    assert c["total"] == 10 and c["ring_overflow"] == 7 and c["kept"] == 3
    assert c["by_reason"] == {"verify_real_kv_hash": 3}
    assert [v.slot for v in m.canary.violations()] == slots[:3]
    m.forward(m.batch(1, 13, [8], [41]))  # the rings start empty again each step
    c = m.canary.counters()
    assert c["by_tag"] == {"TAIL_K_FULL": 20} and c["ring_overflow"] == 14 and c["kept"] == 6


def test_reentrant_forward_passes_through(manual):
    m = manual()
    batch = m.batch(1, 0, [1, 2, 3], [5, 6, 7])
    with m.canary.forward(batch):
        with m.canary.forward(batch):
            m.store(batch)
    # HEAD verify+write, TAIL K/V verify+write (the deep fingerprints are stored without a write op of their own)
    assert m.canary.stats().kernel_launches == 1 + 1 + 2 + 2
    assert m.canary.step == 1


def test_capacity_grows_and_is_counted(full_spec, caplog):
    from tests.runtime.conftest import ManualEngine, make_canary

    m = ManualEngine(make_canary(full_spec, max_requests=2, max_context=4, max_batch_tokens=8))  # verify capacity 8
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        m.forward(m.batch(1, 0, list(range(1, 31)), list(range(1, 31))))  # 30 tokens > 8 static token slots
        m.forward(m.batch(1, 30, [9], [40]))  # 30 verify entries: this plan overflows (verify skipped) ...
        m.forward(m.batch(1, 31, [10], [41]))  # ... and the next one runs on the grown plan
    s = m.canary.stats()
    assert s.plans_disabled == 1 and s.capacity_growths >= 2
    assert s.slots_verified["head"] == 31 and s.violations == 0
    assert any("growing" in r.getMessage() for r in caplog.records)


def test_chain_position_assert_waits_for_warmup(manual):
    m = manual(chain_position_warmup=2, write_input_assert=False)
    m.forward(m.batch(1, 0, [1, 2], [5, 6]))
    m.forward(m.batch(1, 2, [3], [7]))  # step 2: still warming up
    b = m.batch(1, 3, [4], [8])
    import dataclasses

    m.forward(dataclasses.replace(b, positions=b.positions + 1))  # step 3: assert is on
    vs = m.canary.violations()
    assert len(vs) == 1 and vs[0].op == "write" and vs[0].reasons == FailReason.WRITE_POSITION_MISMATCH
    assert vs[0].stored_position == 4 and vs[0].expected_position == 3 and vs[0].step == 3


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_health_watchdog_reports_a_canary_that_stopped(mode, caplog, monkeypatch):
    engine, canary = make_sim(seed=2, canary_options=dict(mode=mode, health_interval=4))
    engine.run(8)
    assert canary.health.stalls == 0
    # forwards keep happening (and are counted), the canary's bracket and kernels do not
    monkeypatch.setattr(canary, "forward", lambda batch: contextlib.nullcontext())
    if mode == "raise":
        with pytest.raises(CanaryHealthError, match="kv-canary: health: the canary stopped running"):
            engine.run(12)
    else:
        with caplog.at_level(logging.WARNING, logger="kvcanary"):
            engine.run(12)
        assert canary.health.stalls == 1
        assert any("the canary stopped running" in r.getMessage() for r in caplog.records)


def test_memory_is_reported_when_attaching(full_spec, caplog):
    from tests.runtime.conftest import make_canary

    with caplog.at_level(logging.INFO, logger="kvcanary"):
        c = make_canary(full_spec)
    msg = next(r.getMessage() for r in caplog.records if "attached" in r.getMessage())
    assert "MiB on cpu for 64 slots" in msg and "136 B/slot" in msg  # 3 x 32 B records + 5 x 8 B slot records
    assert c.memory_bytes() > 64 * 128


def test_api_misuse_errors(manual):
    m = manual()
    with pytest.raises(RuntimeError, match="kv-canary: after_forward\\(\\) without a matching before_forward"):
        m.canary.after_forward()
    b = m.batch(1, 0, [1], [5])
    import dataclasses

    bad = dataclasses.replace(b, groups={"swa": b.groups["full"]})
    m.canary.before_forward(bad)  # log mode: the canary's problem never fails the forward — counted, unchecked
    m.canary.after_forward()
    assert m.canary.coverage()["unchecked_forwards"] == 1 and m.canary.coverage()["canary_errors"] == 1
    strict = manual(mode="raise")
    with pytest.raises(ValueError, match="kv-canary: BatchDescription.groups has \\['swa'\\]"):
        strict.canary.before_forward(bad)
    with pytest.raises(ValueError, match="kv-canary: no group 'swa'"):
        m.canary.set_kv_cache("swa", {})
    with pytest.raises(ValueError, match="kv-canary: Canary needs mode 'log' or 'raise'"):
        from kvcanary.runtime import Canary

        Canary(CanaryConfig(mode="none"), groups=[], max_requests=1, max_context=1)
