"""Accounting and the token oracle on hand-made inputs."""
from types import SimpleNamespace

import pytest
import torch

from kvcanary.faults import FaultLedger, Injection, TokenOracle, account, oracle_token, summarize


def _inj(**kw):
    base = dict(fault="slot_redirect", engine="sim", step=10, group="full", slot=7, position=3, request_id="a",
                expected=("verify_position", "verify_chain_hash"))
    return Injection(**{**base, **kw})


def _v(step, slot, rid, label, group="full"):
    return SimpleNamespace(step=step, slot=slot, request_id=rid, reason_label=label, group=group)


def test_detected_on_slot_with_latency_checks_and_collateral():
    vs = [_v(9, 7, "a", "verify_position"), _v(11, 7, "b", "verify_chain_hash+verify_token"),
          _v(11, 3, "c", "verify_real_kv_hash"), _v(12, 7, "a", "verify_position")]
    o = account(_inj(), vs)
    assert o.detected and o.latency_forwards == 1 and o.request_id == "b"
    assert o.detected_by == ("chain", "token") and o.collateral == ("verify_real_kv_hash", "verify_token")


def test_request_preferred_and_window_bounds():
    vs = [_v(10, 7, "b", "verify_position"), _v(10, 99, "a", "verify_chain_hash")]
    assert account(_inj(), vs).request_id == "a"
    assert not account(_inj(), vs, until_step=10).detected
    assert not account(_inj(), [_v(10, 7, "z", "verify_real_kv_hash")]).detected
    assert not account(_inj(), [_v(10, 7, "z", "verify_position", group="swa")]).detected


def test_summary_counts():
    outs = [account(_inj(), [_v(10, 7, "a", "verify_position")]), account(_inj(step=20), []),
            account(_inj(expected_detectable=False, why_not="x"), [])]
    s = summarize(outs)["slot_redirect"]
    assert (s["injected"], s["detected"], s["missed"], s["expected_detectable"], s["detected_expected"]) == (3, 1, 2, 2, 1)
    assert s["median_latency_forwards"] == 0 and s["detected_by"] == {"position": 1} and s["why_not"] == ["x"]


def test_ledger_rejects_unknown_class():
    with pytest.raises(ValueError, match="^kv-canary:"):
        FaultLedger().add(_inj(fault="nope"))


def test_token_oracle():
    assert oracle_token("r1", 5, 100) == oracle_token("r1", 5, 100)
    toks = {oracle_token("r1", q, 1000) for q in range(200)}
    assert len(toks) > 150 and min(toks) >= 1 and max(toks) < 1000
    assert oracle_token("r1", 5, 1000) != oracle_token("r2", 5, 1000) or oracle_token("r1", 6, 1000) != oracle_token("r2", 6, 1000)
    o = TokenOracle(1000)
    o.register("a", [11, 12, 13])
    o.register("b", [21])
    ids = o.expected_ids(["a", None, "b"], torch.tensor([1, 0, 1]), torch.tensor([3, 2, 1]))
    assert ids.tolist() == [12, 13, oracle_token("a", 3, 1000), -1, -1, oracle_token("b", 1, 1000)]
    with pytest.raises(ValueError, match="^kv-canary:"):
        oracle_token("a", 0, 1)
