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
    assert report["shortfall"] == {}  # both classes reached the count asked for


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


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kv-canary: "), err  # no progress bar around it, no traceback
    return err[0]


def test_out_that_is_an_existing_file_is_refused_before_the_campaign(tmp_path, capsys):
    existing = tmp_path / "report"
    existing.write_text("not a directory")
    assert main(["campaign", "--faults", "slot_redirect", "--per-class", "1", "--out", str(existing)]) == 2
    assert "exists and is not a directory" in _one_error_line(capsys)
    assert existing.read_text() == "not a directory"


def test_unknown_fault_class_is_one_line_without_a_progress_bar(tmp_path, capsys):
    assert main(["campaign", "--faults", "bitflip", "--per-class", "1", "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert "bitflip" in line and "kv_flip_used" in line  # names what exists
    assert not (tmp_path / "o").exists()


def test_bad_real_kv_layers_is_refused_before_the_campaign(tmp_path, capsys):
    assert main(["campaign", "--real-kv-layers", "0,last", "--per-class", "1", "--out", str(tmp_path / "o")]) == 2
    assert "--real-kv-layers" in _one_error_line(capsys)


def test_a_class_short_of_its_count_says_why():
    from kvcanary.cli.campaign import format_markdown, shortfall

    c = {"injected": 18, "detected": 18, "missed": 0, "expected_detectable": 18, "detected_expected": 18,
         "median_latency_forwards": 0, "collateral_reasons": {}, "detected_by": {"chain": 18}, "why_not": []}
    full = dict(c, injected=20, detected=20, expected_detectable=20, detected_expected=20)
    classes = {"prefix_collision": c, "slot_redirect": full}
    why = shortfall(classes, 20, "sim", 30)
    assert list(why) == ["prefix_collision"] and why["prefix_collision"].startswith("18 of 20 injected: 2 attempt(s)")
    md = format_markdown({"classes": classes, "clean": {"forwards": 1, "violations": 0},
                          "config": {"engine": "sim", "seed": 0, "real_kv_hash": "partial", "per_class": 20},
                          "shortfall": why})
    assert "fewer injections than asked (20 per class):" in md and "- prefix_collision: 18 of 20" in md
