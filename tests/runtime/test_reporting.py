"""Reporting under incidents: a flood stays readable, sinks that fail never stop reporting in log mode,
the readable real-KV block shows both fingerprints, and the coverage account is zero when healthy."""
from __future__ import annotations

import json
import logging

import pytest

from kvcanary.engines.sim import SimWorkload
from kvcanary.errors import KvCanaryError
from kvcanary.faults.sim_hooks import flip_kv_bit

from tests.runtime.conftest import make_sim, warm_sim


def _scribble(engine) -> list[int]:
    """Flip a bit in every slot of a running request's prefix: every later read re-reports them."""
    victim = next(r for r in engine.running if r.num_computed > 12)
    slots = victim.full_slots[:12]
    for s in slots:
        flip_kv_bit(engine, "full", s, side="k", byte=0, bit=1)
    return slots


def test_a_flood_is_rate_limited_in_the_log_but_exact_in_counters_and_jsonl(tmp_path, caplog):
    path = tmp_path / "v.jsonl"
    engine, canary = make_sim(seed=4, canary_options=dict(jsonl_path=str(path), log_lines_per_slot=2,
                                                          readable_per_step=1))
    warm_sim(engine, steps=30, seed=4)
    slots = _scribble(engine)
    with caplog.at_level(logging.DEBUG, logger="kvcanary"):  # the first-seen markers are DEBUG records
        engine.run(25, SimWorkload(seed=4, arrival_prob=0.0, abort_prob=0.0))
        counters = canary.counters()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary violation:")]
    first_seen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary first-seen:")]
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary summary:")]
    total = counters["total"]
    rows = path.read_text().splitlines()
    assert total > 3 * len(lines) > 0, (total, len(lines))  # the log is a fraction of the incident
    reasons_slots = {(json.loads(r)["fail_reason"], json.loads(r)["group"], json.loads(r)["slot"]) for r in rows}
    assert len(lines) <= 2 * len(reasons_slots)  # K = 2 lines per (reason, group, slot)
    assert len(rows) == total == sum(counters["by_tag"].values())  # every row in the JSON lines, counted
    assert counters["suppressed_lines"] == total - len(lines)
    assert {int(m.split("slot_idx=")[1].split()[0]) for m in first_seen} >= set(slots)
    assert summaries and all("by_reason=" in m and "by_request=" in m for m in summaries)


def _vanishing_dir(tmp_path):
    """A directory that exists when the config is checked and is gone when the first row is written."""
    d = tmp_path / "sink"
    d.mkdir()
    return d


def test_a_failing_sink_is_reported_once_and_reporting_goes_on(tmp_path, caplog):
    d = _vanishing_dir(tmp_path)
    engine, canary = make_sim(seed=4, canary_options=dict(jsonl_path=str(d / "v.jsonl")))
    d.rmdir()
    calls = []
    canary.ledger.add_sink(lambda v: (_ for _ in ()).throw(RuntimeError("sink down")))
    canary.ledger.add_sink(calls.append)
    warm_sim(engine, steps=30, seed=4)
    _scribble(engine)
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        engine.run(5, SimWorkload(seed=4, arrival_prob=0.0, abort_prob=0.0))  # log mode: the engine keeps serving
        counters = canary.counters()
    assert counters["total"] > 0 and len(calls) == counters["kept"]
    assert counters["sink_errors"] == 2  # the jsonl file and the raising callable, each once
    assert sum("cannot write violations to jsonl_path" in r.getMessage() for r in caplog.records) == 1


def test_raise_mode_surfaces_a_failing_sink(tmp_path):
    d = _vanishing_dir(tmp_path)
    engine, canary = make_sim(seed=4, canary_options=dict(mode="raise", jsonl_path=str(d / "v.jsonl")))
    d.rmdir()
    warm_sim(engine, steps=30, seed=4)
    _scribble(engine)
    with pytest.raises(KvCanaryError) as err:  # the canary's own failure: one kv-canary error, the OSError its cause
        engine.run(5, SimWorkload(seed=4, arrival_prob=0.0, abort_prob=0.0))
    assert isinstance(err.value.__cause__, OSError)


def test_log_mode_writes_one_warning_line_per_violation_and_the_real_kv_line_shows_fingerprints(caplog):
    engine, canary = make_sim(seed=4, canary_options=dict(readable_per_step=4))
    warm_sim(engine, steps=30, seed=4)
    _scribble(engine)
    with caplog.at_level(logging.DEBUG, logger="kvcanary"):
        engine.run(2, SimWorkload(seed=4, arrival_prob=0.0, abort_prob=0.0))
        violations = canary.violations()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    lines = [m for m in warnings if m.startswith("kv_canary violation:")]
    assert violations and len(lines) == len(violations)  # under the per-slot limit: every row, once
    assert all(m.startswith(("kv_canary violation:", "kv_canary summary:")) for m in warnings), warnings
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("kv_canary first-seen:") for m in debug)
    assert any("meaning:  the K/V bytes changed" in m for m in debug)  # the readable block, at DEBUG
    v = next(v for v in violations if v.reason_label == "verify_real_kv_hash")
    line = v.log_line()
    assert line in lines
    assert line.endswith(f" stored_fingerprint=0x{v.stored_fingerprint:016x} "
                         f"recomputed_fingerprint=0x{v.recomputed_fingerprint:016x}")
    assert all("stored_fingerprint=" not in u.log_line() for u in violations if u.stored_fingerprint is None)


def test_real_kv_readable_block_shows_stored_and_recomputed_fingerprints():
    engine, canary = make_sim(seed=4)
    warm_sim(engine, steps=30, seed=4)
    _scribble(engine)
    engine.run(2, SimWorkload(seed=4, arrival_prob=0.0, abort_prob=0.0))
    v = next(v for v in canary.violations() if v.reason_label == "verify_real_kv_hash")
    assert v.stored_fingerprint is not None and v.recomputed_fingerprint is not None
    assert v.stored_fingerprint != v.recomputed_fingerprint
    block = v.readable()
    assert f"record 0x{v.stored_fingerprint:016x}, bytes now 0x{v.recomputed_fingerprint:016x}" in block
    assert json.loads(json.dumps(v.to_json()))["stored_fingerprint"] == f"0x{v.stored_fingerprint:016x}"


def test_coverage_is_zero_in_a_healthy_run():
    engine, canary = make_sim(seed=9, canary_options=dict(sweep_interval=20))
    engine.run(120, SimWorkload(seed=9, abort_prob=0.05))
    cov = canary.counters()["coverage"]
    assert cov == {"unchecked_forwards": 0, "canary_errors": 0, "plans_disabled": 0, "write_assert_skipped": 0,
                   "unhashed_groups": [], "sweep_stale": 0, "step_log_forgotten": 0, "sink_errors": 0}
