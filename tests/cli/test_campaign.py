"""`kvcanary campaign`: report.json / report.md / detection.png, on the sim engine and (short, CPU)
on the transformers engine with the demo's tiny models."""
import json

import pytest

from kvcanary.cli.main import main

KEYS = {"injected", "detected", "missed", "expected_detectable", "median_latency_forwards", "collateral_reasons",
        "detected_by"}


def _report(out):
    for name in ("report.json", "report.md", "detection.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("deep", [True, False])  # deep fingerprints: on by default
def test_sim_campaign_report(tmp_path, deep):
    rc = main(["campaign", "--engine", "sim", "--faults", "slot_redirect,kv_flip_deep_layer", "--per-class", "1",
               "--out", str(tmp_path), "--no-progress"] + ([] if deep else ["--no-deep-fingerprints"]))
    report = _report(tmp_path)
    assert rc == 0
    assert set(report["classes"]) == {"slot_redirect", "kv_flip_deep_layer"}
    assert all(KEYS <= set(c) for c in report["classes"].values())
    assert report["classes"]["slot_redirect"]["detected"] == 1
    deep_layer = report["classes"]["kv_flip_deep_layer"]
    assert deep_layer["expected_detectable"] == deep_layer["detected"] == int(deep)
    assert report["clean"]["violations"] == 0 and report["clean"]["forwards"] > 0
    assert len(report["ledger"]) == 2


def test_transformers_campaign_short(tmp_path):
    pytest.importorskip("transformers")
    rc = main(["campaign", "--engine", "transformers", "--faults", "kv_flip_used,slot_redirect", "--per-class", "1",
               "--out", str(tmp_path), "--no-progress"])
    report = _report(tmp_path)
    assert rc == 0, report
    for name in ("kv_flip_used", "slot_redirect"):
        c = report["classes"][name]
        assert c["injected"] == 1 and c["detected"] == 1 and c["missed"] == 0
    assert report["clean"]["violations"] == 0 and report["clean"]["forwards"] > 0


def test_bad_arguments(tmp_path):
    assert main(["campaign", "--faults", "nope", "--per-class", "1", "--out", str(tmp_path), "--no-progress"]) == 2
    assert main(["campaign", "--engine", "transformers", "--faults", "double_alloc", "--per-class", "1",
                 "--out", str(tmp_path), "--no-progress"]) == 2
