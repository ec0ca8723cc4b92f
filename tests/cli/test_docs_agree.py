"""The docs say what the code does: docs/replays.md's count and table match the replay modes (whose
outcomes tests/cli/test_replay.py checks one by one) and the committed output; the README and
docs/reading-violations.md state the same drain latency, derived from `CanaryConfig.drain_interval`."""
from __future__ import annotations

import json
import re
from pathlib import Path

from kvcanary.cli.replay import caught_label
from kvcanary.faults.replay import BUG_MODES
from kvcanary.runtime import CanaryConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"
README = DOCS.parent / "README.md"


def _replay_rows(text: str) -> dict[str, str]:
    """bug -> its ``caught`` cell, from a `kvcanary replay` table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+)\s{2,}(yes|NO|no \(exp\.\))\s", line)
        if m and m.group(1) != "bug":
            rows[m.group(1)] = m.group(2)
    return rows


def test_replays_md_count_and_table_match_the_replay_modes():
    md = (DOCS / "replays.md").read_text()
    caught = sum(m.expect_caught for m in BUG_MODES.values())  # what `kvcanary replay --bug all` reports when green
    claims = set(re.findall(r"(\d+) of (\d+) caught", md))
    assert claims == {(str(caught), str(len(BUG_MODES)))}, claims
    block = md[md.index("```", md.index("Latest run")):]
    rows = _replay_rows(block[: block.index("```", 3)])
    assert list(rows) == list(BUG_MODES)
    assert rows == {name: "yes" if m.expect_caught else "no (exp.)" for name, m in BUG_MODES.items()}
    assert _replay_rows((DOCS / "replays.out.txt").read_text()) == rows


def test_readme_replay_count_matches():
    caught = sum(m.expect_caught for m in BUG_MODES.values())
    m = re.search(r"# (\d+) kinds of reported KV bugs re-enacted, (\d+) caught", README.read_text())
    assert m and (int(m.group(1)), int(m.group(2))) == (len(BUG_MODES), caught)


def test_replays_json_matches_the_table():
    results = json.loads((DOCS / "replays.json").read_text())
    md = (DOCS / "replays.md").read_text()
    assert {r["bug"]: caught_label(r) for r in results} == _replay_rows(md)
    assert all(r["clean"]["violations"] == 0 for r in results)


def test_readme_and_reading_violations_agree_on_drain_latency():
    n = CanaryConfig().drain_interval
    bound = f"{2 * n} to {2 * n + 2} forwards"
    for doc in (README, DOCS / "reading-violations.md"):
        text = " ".join(doc.read_text().split())
        assert "2 x `drain_interval`" in text and bound in text, doc.name
        assert "one step late" not in text, doc.name
