"""`kvcanary report`: JSON-lines violation files (two "ranks" from faulted simulated runs) summarised by
reason, tag, group, request, slot and step; --json for programs; --png; bad input is one `kv-canary:` line."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from kvcanary.cli.main import main
from kvcanary.engines.sim import SimWorkload
from kvcanary.faults.sim_hooks import flip_kv_bit, redirect_slot

from tests.runtime.conftest import make_sim, warm_sim


@pytest.fixture(scope="module")
def rank_files(tmp_path_factory):
    """Two files as two workers' ``jsonl_path`` would leave them: a flipped K bit and a redirected read each."""
    d = tmp_path_factory.mktemp("report")
    paths = []
    for rank in (0, 1):
        path = d / f"v.jsonl.rank{rank}"
        engine, canary = make_sim(seed=4 + rank, canary_options=dict(jsonl_path=str(path)))
        warm_sim(engine, steps=30, seed=4 + rank)
        victim = next(r for r in engine.running if r.num_computed > 12)
        flip_kv_bit(engine, "full", victim.full_slots[3], side="k", byte=0, bit=1)
        other = next(r for r in engine.running if r is not victim and r.num_computed > 8)
        redirect_slot(engine, other.rid, 4, victim.full_slots[5])
        engine.run(4, SimWorkload(seed=4, arrival_prob=0.0, abort_prob=0.0))
        canary.close()
        paths.append(path)
    return paths


def _rows(paths):
    return [json.loads(line) for p in paths for line in p.read_text().splitlines()]


def test_report_summarises_across_files_exactly(rank_files, capsys):
    rows = _rows(rank_files)
    assert rows
    rc = main(["report", *map(str, rank_files), "--json", "-"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 1  # violations present
    assert s["violations"] == len(rows)
    assert {f["key"]: f["violations"] for f in s["files"]} == dict(Counter(str(p) for p in rank_files for _ in
                                                                           p.read_text().splitlines()))
    reasons = Counter(r for row in rows for r in row["fail_reason"].split("+"))
    assert {r["key"]: r["violations"] for r in s["by_reason"]} == dict(reasons)
    assert all(r["meaning"] and r["meaning"] != "unknown reason" for r in s["by_reason"])
    assert {r["key"]: r["violations"] for r in s["by_tag"]} == dict(Counter(row["launch_tag"] for row in rows))
    assert sum(r["violations"] for r in s["by_request"]) == len(rows) or s["requests"] > 10
    first = min(rows, key=lambda r: r["step"])
    assert s["first"]["step"] == first["step"] and s["last"]["step"] == max(r["step"] for r in rows)
    by_slot = Counter(f"{row['group']}/{row['slot']}" for row in rows)
    assert {r["key"]: r["violations"] for r in s["by_slot"]} == dict(by_slot.most_common(10))


def test_report_text_png_and_json_file(rank_files, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "timeline.png", tmp_path / "summary.json"
    rc = main(["report", *map(str, rank_files), "--png", str(png), "--json", str(out), "--top", "3"])
    text = capsys.readouterr().out
    assert rc == 1
    assert text.startswith("kvcanary report: ") and "by reason" in text and "usually means" in text
    assert "the K/V bytes changed after they were written" in text  # the flipped bit's reason, explained
    assert "by request" in text and "by slot" in text and "by step (top 3 of" in text
    assert f"wrote {out}" in text and f"wrote {png}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.read_text())["violations"] == len(_rows(rank_files))
    header = next(line for line in text.splitlines() if line.strip().startswith("reason "))
    row = next(line for line in text.splitlines() if line.strip().startswith("verify_real_kv_hash "))
    assert header.index("violations") == row.index(row.split()[1], len("  verify_real_kv_hash"))  # columns line up


def test_report_of_an_empty_file_says_so(tmp_path, capsys):
    empty = tmp_path / "v.jsonl"
    empty.write_text("")
    assert main(["report", str(empty)]) == 0
    assert "no violations" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["missing", "not_json", "not_a_violation", "top"])
def test_report_bad_input_is_one_kvcanary_line(case, tmp_path, capsys):
    bad = tmp_path / "v.jsonl"
    argv = ["report", str(bad)]
    if case == "not_json":
        bad.write_text('{"launch_tag": "HEAD_K_FULL", "slot": 1}\nnot json\n')
    elif case == "not_a_violation":
        bad.write_text('{"hello": 1}\n')
    elif case == "top":
        bad.write_text("")
        argv += ["--top", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kv-canary: "), err
    if case == "not_json":
        assert f"{bad}:2" in err[0]
