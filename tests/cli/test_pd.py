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
