"""Each replayed bug is caught with an expected reason, charged to the injected request; clean twins silent."""
import json

import pytest

from kvcanary.cli.main import main
from kvcanary.faults.replay import BUG_MODES, run_replay


@pytest.mark.parametrize("name", list(BUG_MODES))
def test_replay_caught_against_the_right_request(name):
    r = run_replay(name)
    assert r.outcome is not None, f"{name}: not injected"
    assert r.clean_violations == 0 and r.clean_forwards > 0
    if not r.mode.expect_caught:
        assert not r.caught and r.outcome.injection.why_not
        return
    assert r.caught, r.to_json()
    assert set(r.outcome.reasons) & set(r.outcome.injection.expected)


def test_at_least_fifteen_caught_modes():
    assert sum(m.expect_caught for m in BUG_MODES.values()) >= 15


def test_cli_replay_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["replay", "--bug", "hbm-bit-flip-in-use,lora-cross-adapter-hit", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "hbm-bit-flip-in-use" in text and "lora-cross-adapter-hit" in text
    data = json.loads(out.read_text())
    assert [d["bug"] for d in data] == ["hbm-bit-flip-in-use", "lora-cross-adapter-hit"]
    assert data[0]["caught"] and data[0]["reasons"] == ["verify_real_kv_hash"] and data[0]["request"]
    assert main(["replay", "--bug", "nope"]) == 2
