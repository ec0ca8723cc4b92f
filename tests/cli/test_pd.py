"""`kvcanary pd` end to end on the CPU: two processes over gloo, clean transfer silent with the same tokens
as one process, every faulted transfer caught on receipt against its request before any decode step."""
from __future__ import annotations

import json

from kvcanary.cli.main import main


def test_pd_table_and_json(tmp_path, capsys):
    out = tmp_path / "pd.json"
    rc = main(["pd", "--json", str(out), "--seed", "0", "--backend", "gloo"])
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert rc == 0 and result["ok"]
    rows = {r["scenario"]: r for r in result["rows"]}
    assert list(rows) == ["clean", "unfilled_block", "zeroed_in_flight", "out_of_order", "stale_block"]
    clean = rows.pop("clean")
    assert clean["violations"] == 0 and clean["same_tokens_as_one_process"] and len(clean["tokens"]) > 1
    assert result["prefill_violations"] == 0
    expected = {"unfilled_block": {"verify_real_kv_hash"}, "zeroed_in_flight": {"verify_real_kv_hash"},
                "out_of_order": {"verify_position"}, "stale_block": {"verify_token", "verify_chain_hash"}}
    for name, row in rows.items():
        assert row["caught"] and row["blamed"] == [row["request"]], row
        assert expected[name] <= set(row["reasons"]), row
        assert row["decode_forwards_before_catch"] == 0 and "tokens" not in row
        assert set(row["tags"]) == {"MOVE_K_FULL", "MOVE_V_FULL"}
    for name in ("scenario", "clean", "stale_block", "same as one process", "result: OK"):
        assert name in table


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kv-canary: "), err
    return err[0]


def test_pd_refuses_an_unknown_backend_before_starting(capsys):
    assert main(["pd", "--backend", "foo"]) == 2
    assert "--backend 'foo' is not one of gloo, nccl" in _one_error_line(capsys)


def test_pd_refuses_nccl_where_it_cannot_run_before_starting(capsys):
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= 2:
        import pytest

        pytest.skip("NCCL and two GPUs are here: nccl is a valid backend")
    assert main(["pd", "--backend", "nccl"]) == 2
    assert "--backend nccl" in _one_error_line(capsys)


def test_pd_refuses_bad_max_new_and_json_path(tmp_path, capsys):
    assert main(["pd", "--max-new", "0"]) == 2
    assert "--max-new" in _one_error_line(capsys)
    assert main(["pd", "--json", str(tmp_path / "missing" / "pd.json")]) == 2
    assert "does not exist" in _one_error_line(capsys)


def test_pd_table_says_yes_no_and_keeps_columns_aligned():
    from kvcanary.cli.pd import format_table

    rows = [dict(scenario="clean", blocks=6, caught=False, violations=0, reasons=[], blamed=[], tokens=[1],
                 same_tokens_as_one_process=True),
            dict(scenario="stale_block", blocks=6, caught=True, violations=12,
                 reasons=["verify_chain_hash", "verify_position", "verify_real_kv_hash", "verify_token"],
                 blamed=["req4-stale_block"])]
    text = format_table(dict(backend="gloo", seed=0, prefill_violations=0, rows=rows, ok=True))
    lines = text.splitlines()
    assert "True" not in text and "False" not in text
    head, clean, stale = lines[1], lines[2], lines[3]
    assert clean.split()[2] == "no" and stale.split()[2] == "yes"
    assert head.index("blamed") == stale.index("req4-stale_block") == clean.index("-", head.index("blamed"))
    assert head.index("tokens") == clean.index("same as one process")
