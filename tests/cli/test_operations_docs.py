"""docs/operations.md's alert rules and docs/grafana-kvcanary.json name only metrics the collector exports
(scraped from a faulted simulated run and a transformers run), with label names it sets; the vLLM names
are vLLM counters the adapter defines; the rules parse and the dashboard is JSON."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
OPS = DOCS / "operations.md"
DASHBOARD = DOCS / "grafana-kvcanary.json"
SUFFIXES = ("_total", "_created")


def _registry():
    """A registry with the collector over a faulted sim canary and a transformers handle."""
    pytest.importorskip("prometheus_client")
    pytest.importorskip("transformers")
    import torch
    from prometheus_client import CollectorRegistry

    import kvcanary
    from kvcanary.cli.demo import generate, tiny_model, workload
    from kvcanary.engines.sim import SimWorkload
    from kvcanary.faults.sim_hooks import flip_kv_bit
    from kvcanary.runtime.metrics import register_metrics
    from tests.runtime.conftest import make_sim, warm_sim

    engine, canary = make_sim(seed=4)
    warm_sim(engine, steps=30, seed=4)
    victim = next(r for r in engine.running if r.num_computed > 12)
    flip_kv_bit(engine, "full", victim.full_slots[3], side="k", byte=0, bit=1)
    engine.run(10, SimWorkload(seed=4, arrival_prob=0.0, abort_prob=0.0))
    model = tiny_model("llama", torch.device("cpu"))
    with kvcanary.attach(model, mode="log") as handle:
        generate(model, workload()[:4], max_new_tokens=4)
    registry = CollectorRegistry()
    register_metrics(canary, registry=registry, name="sim")
    register_metrics(handle, registry=registry, name="tf")
    return registry


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """metric family name (as scraped, counters without ``_total``) -> its label names (declared and on samples)."""
    out: dict[str, set[str]] = {}
    for fam in _registry().collect():
        labels = out.setdefault(fam.name, set())
        labels.update(getattr(fam, "_labelnames", ()))
        for sample in fam.samples:
            labels.update(sample.labels)
    return out


def _family(name: str, exported: dict) -> str:
    if name in exported:
        return name
    return next((name[: -len(s)] for s in SUFFIXES if name.endswith(s) and name[: -len(s)] in exported), name)


def _yaml_block() -> str:
    text = OPS.read_text()
    start = text.index("```yaml\n") + len("```yaml\n")
    return text[start : text.index("```", start)]


def _exprs() -> list[str]:
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load(_yaml_block())["groups"][0]["rules"]
    assert len(rules) >= 8 and all({"alert", "expr", "labels"} <= set(r) for r in rules)
    dash = json.loads(DASHBOARD.read_text())
    return [r["expr"] for r in rules] + [t["expr"] for p in dash["panels"] for t in p["targets"]] + \
        [v["query"] for v in dash["templating"]["list"]]


def test_every_kvcanary_metric_the_rules_and_dashboard_name_is_exported(exported):
    names = {n for e in _exprs() for n in re.findall(r"\bkvcanary_[a-z_]+", e)}
    names |= set(re.findall(r"\bkvcanary_[a-z_]+", OPS.read_text()))
    assert {"kvcanary_violations_by_tag_total", "kvcanary_unchecked_forwards_total", "kvcanary_canary_errors_total",
            "kvcanary_sweep_pass_slots"} <= names  # violations, unchecked forwards, canary errors, sweep coverage
    missing = sorted(n for n in names if _family(n, exported) not in exported)
    assert not missing, f"named in the docs, not exported: {missing}"


def test_label_names_in_selectors_and_by_clauses_exist(exported):
    for expr in _exprs():
        for name, labels in re.findall(r"\b(kvcanary_[a-z_]+)\{([^}]*)\}", expr):
            family = _family(name, exported)
            used = set(re.findall(r"(\w+)\s*=~?", labels))
            assert used <= exported[family], (name, used, exported[family])
        known = set().union(*exported.values())
        for clause in re.findall(r"\b(?:by|on|ignoring)\s*\(([^)]*)\)", expr):
            assert {x.strip() for x in clause.split(",")} <= known, (expr, clause)


def test_vllm_names_are_counters_the_adapter_defines():
    import ast

    import kvcanary

    source = Path(kvcanary.__file__).parent / "engines" / "vllm" / "metrics.py"  # imports vllm: read, not imported
    tree = ast.parse(source.read_text())
    COUNTS = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and any(getattr(t, "id", None) == "COUNTS" for t in n.targets))
    text = OPS.read_text()
    names = set(re.findall(r"vllm:kv_canary_([a-z_]+)", text))
    assert names
    defined = set(COUNTS) | {"violations_by_reason"}
    stripped = {n[: -len("_total")] if n.endswith("_total") else n for n in names}
    assert stripped <= defined, stripped - defined
