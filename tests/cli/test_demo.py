"""`kvcanary demo` end to end (CPU): table on stdout, JSON result, every fault caught, clean run clean."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvcanary.cli.main import main  # noqa: E402


def test_demo_prints_table_and_writes_json(tmp_path, capsys):
    out, jsonl = tmp_path / "demo.json", tmp_path / "violations.jsonl"
    rc = main(["demo", "--json", str(out), "--seed", "0", "--jsonl", str(jsonl)])
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    # every violation of the faulted runs reached the JSON lines, and `kvcanary report` reads them
    assert len(jsonl.read_text().splitlines()) == sum(f["violations_in_run"] for f in result["faults"]) > 0
    assert main(["report", str(jsonl), "--json", "-"]) == 1
    assert json.loads(capsys.readouterr().out)["violations"] == len(jsonl.read_text().splitlines())

    assert set(result["clean"]) >= {"forwards", "slots_verified", "violations"}
    assert result["clean"]["violations"] == 0
    assert result["clean"]["forwards"] > 0 and result["clean"]["slots_verified"] > 0
    assert set(result["models"]) == {"llama", "qwen3_swa"}
    assert all(m["clean"]["outputs_identical"] for m in result["models"].values())

    names = [f["name"] for f in result["faults"]]
    assert names == ["llama/flip_shared_block_byte", "llama/redirect_read[full]", "qwen3_swa/redirect_read[swa]"]
    for fault in result["faults"]:
        assert set(fault) >= {"name", "caught", "reasons", "request", "latency_forwards"}
        assert fault["caught"], fault
        assert fault["request"] == fault["injected"]["request_id"] or fault["name"].endswith("flip_shared_block_byte")
        assert fault["latency_forwards"] == 0  # both are caught in the forward that reads the slot
    assert result["faults"][0]["reasons"] == ["verify_real_kv_hash"]
    assert {"verify_position", "verify_chain_hash"} <= set(result["faults"][1]["reasons"])
    assert rc == 0

    assert "forwards" in table and "slots verified" in table and "caught" in table
    assert "llama/flip_shared_block_byte" in table and "qwen3_swa/redirect_read[swa]" in table
    for kind, model in result["models"].items():
        assert f"{model['clean']['slots_verified']}" in table


def test_demo_rejects_unknown_model(capsys):
    assert main(["demo", "--models", "gpt5"]) == 2
    assert capsys.readouterr().err.startswith("kv-canary: unknown demo model 'gpt5'")
