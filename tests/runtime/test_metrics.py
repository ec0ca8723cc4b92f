"""Prometheus metrics (issue 10 item 7): a collector on the caller's registry, fed from counters() / stats()."""
from __future__ import annotations

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from kvcanary.errors import KvCanaryTypeError  # noqa: E402
from kvcanary.runtime.metrics import register_metrics, tag_group  # noqa: E402


def _prefill(m, n=8):
    tokens = list(range(1, n + 1))
    slots = list(range(10, 10 + n))
    m.forward(m.batch(1, 0, tokens, slots))
    return tokens, slots


def _value(registry, name, labels):
    v = registry.get_sample_value(name, labels)
    return v


def test_violations_and_coverage_reach_the_users_registry(manual):
    m = manual(mode="log", readable_per_step=0)
    registry = CollectorRegistry()
    collector = register_metrics(m.canary, registry=registry, name="engine0")
    _, slots = _prefill(m)
    assert _value(registry, "kvcanary_forwards_total", {"canary": "engine0", "state": "checked"}) == 1
    assert _value(registry, "kvcanary_ring_overflow_total", {"canary": "engine0"}) == 0
    m.kv[0][0][slots[2], 0] ^= 1  # layer 0 K bytes of one cached slot
    m.forward(m.batch(1, 8, [9], [40]))
    c = m.canary.counters()
    assert c["total"] > 0
    got = {(s.labels["group"], s.labels["reason"]): s.value
           for metric in registry.collect() if metric.name == "kvcanary_violations"
           for s in metric.samples if s.name == "kvcanary_violations_total"}
    expected: dict = {}
    for v in m.canary.violations():
        expected[(v.group, v.reason_label)] = expected.get((v.group, v.reason_label), 0) + 1
    assert got == expected and ("full", "verify_real_kv_hash") in got
    by_tag = {s.labels["tag"]: s.value for metric in registry.collect() if metric.name == "kvcanary_violations_by_tag"
              for s in metric.samples if s.name.endswith("_total")}
    assert by_tag == {k: v for k, v in c["by_tag"].items()}
    assert _value(registry, "kvcanary_forwards_total", {"canary": "engine0", "state": "checked"}) == 2
    stats = m.canary.stats()
    assert _value(registry, "kvcanary_slots_verified_total", {"canary": "engine0", "phase": "head"}) == \
        stats.slots_verified["head"]
    assert _value(registry, "kvcanary_memory_bytes", {"canary": "engine0"}) == m.canary.memory_bytes()
    assert _value(registry, "kvcanary_scrape_errors_total", {}) == 0
    text = generate_latest(registry).decode()
    assert 'kvcanary_violations_total{canary="engine0",group="full",reason="verify_real_kv_hash"}' in text
    registry.unregister(collector)
    assert _value(registry, "kvcanary_forwards_total", {"canary": "engine0", "state": "checked"}) is None


def test_adapter_counters_unchecked_and_coverage_are_exported():
    class Handle:  # the shape of an adapter handle's counters (TransformersCbHandle)
        def counters(self):
            return {"total": 0, "by_tag": {}, "ring_overflow": 0, "checked_forwards": 5, "engine_forwards": 7,
                    "unchecked_forwards": 2, "unchecked_by_cause": {"capacity": 2}, "canary_errors": 1,
                    "coverage": {"padding_slots": 3, "by_group": {"full": {"outside_window": 4}}, "flag": True}}

        def stats(self):
            return []

    registry = CollectorRegistry()
    register_metrics(Handle(), registry=registry)
    assert _value(registry, "kvcanary_forwards_total", {"canary": "default", "state": "engine"}) == 7
    assert _value(registry, "kvcanary_forwards_total", {"canary": "default", "state": "unchecked"}) == 2
    assert _value(registry, "kvcanary_unchecked_forwards_total", {"canary": "default", "cause": "capacity"}) == 2
    assert _value(registry, "kvcanary_canary_errors_total", {"canary": "default"}) == 1
    assert _value(registry, "kvcanary_unchecked_slots_total", {"canary": "default", "kind": "padding_slots"}) == 3
    assert _value(registry, "kvcanary_unchecked_slots_total",
                  {"canary": "default", "kind": "by_group.full.outside_window"}) == 4


def test_a_failing_source_never_breaks_the_scrape():
    class Broken:
        def counters(self):
            raise RuntimeError("device lost")

        def stats(self):
            return []

    registry = CollectorRegistry()
    register_metrics(Broken(), registry=registry)
    assert _value(registry, "kvcanary_scrape_errors_total", {}) == 1
    assert generate_latest(registry)  # still renders


def test_bad_arguments_are_kvcanary_type_errors():
    with pytest.raises(KvCanaryTypeError, match=r"^kv-canary: register_metrics needs registry="):
        register_metrics(object(), registry=None)
    with pytest.raises(KvCanaryTypeError, match=r"^kv-canary: metrics source 'default' needs counters\(\) and stats\(\)"):
        register_metrics(object(), registry=CollectorRegistry())


def test_tag_group():
    assert tag_group("HEAD_K_FULL") == "full" and tag_group("SWEEP_V_SWA") == "swa"
