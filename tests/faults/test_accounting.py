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


# ---- summarize over several outcomes (mutation audit, docs/mutation.md) ----------------------------

def test_summary_of_several_outcomes_under_a_custom_key():
    outcomes = [
        # detected at once against its own request, by two checks; a token row elsewhere is collateral
        account(_inj(), [_v(10, 7, "a", "verify_position+verify_chain_hash"), _v(10, 3, "q", "verify_token")]),
        # detected one forward later on its slot but charged to another request; collateral again
        account(_inj(step=20), [_v(21, 7, "b", "verify_position"), _v(21, 5, "q", "verify_token")]),
        # detected two forwards later; the injection names no request, so it cannot be charged wrongly
        account(_inj(step=40, slot=9, request_id=None, expected_detectable=False, why_not="shadowed"),
                [_v(42, 9, "y", "verify_position")]),
        # detected on its slot against yet another request
        account(_inj(step=50), [_v(50, 7, "c", "verify_chain_hash")]),
        # missed: only an unrelated write row in its window
        account(_inj(step=30), [_v(30, 2, "z", "write_token")]),
        # another engine, missed twice with the same reason for it
        account(_inj(engine="transformers", expected_detectable=False, why_not="no history"), []),
        account(_inj(engine="transformers", expected_detectable=False, why_not="no history"), []),
    ]
    s = summarize(outcomes, key=lambda o: f"{o.injection.fault}@{o.injection.engine}")
    assert set(s) == {"slot_redirect@sim", "slot_redirect@transformers"}
    assert s["slot_redirect@sim"] == {
        "injected": 5, "detected": 4, "missed": 1, "expected_detectable": 4, "detected_expected": 3,
        "wrong_request": 2, "collateral_reasons": {"verify_token": 2, "write_token": 1},
        "detected_by": {"position": 3, "chain": 2}, "why_not": ["shadowed"], "median_latency_forwards": 0.5,
    }
    assert s["slot_redirect@transformers"] == {
        "injected": 2, "detected": 0, "missed": 2, "expected_detectable": 0, "detected_expected": 0,
        "wrong_request": 0, "collateral_reasons": {}, "detected_by": {}, "why_not": ["no history"],
        "median_latency_forwards": None,
    }


def test_summary_without_a_key_groups_by_fault_class():
    outcomes = [account(_inj(), [_v(10, 7, "a", "verify_position")]),
                account(_inj(fault="kv_flip_cached", expected=("verify_real_kv_hash",)), [])]
    s = summarize(outcomes)
    assert set(s) == {"slot_redirect", "kv_flip_cached"}
    assert (s["slot_redirect"]["detected"], s["kv_flip_cached"]["missed"]) == (1, 1)


def test_outcome_fields_of_a_miss_and_of_a_hit():
    miss = account(_inj(), [_v(10, 3, "q", "verify_token"), _v(9, 7, "a", "verify_position")])
    assert miss.detected is False and miss.latency_forwards is None and miss.request_id is None
    assert (miss.detected_by, miss.reasons, miss.collateral, miss.violations_in_window) == ((), (), ("verify_token",), 1)
    hit = account(_inj(), [_v(10, 7, "a", "verify_position"), _v(10, 3, "q", "verify_token"), _v(11, 4, "r", "x")])
    assert hit.detected is True and hit.violations_in_window == 3 and hit.reasons == ("verify_position",)


def test_slot_zero_is_a_slot_and_an_unknown_reason_names_its_own_check():
    """``slot >= 0`` names a slot (0 included; -1: none); a reason outside the check table is its own check."""
    inj = _inj(slot=0, request_id=None, expected=("some_new_reason",))
    o = account(inj, [_v(10, 0, "z", "some_new_reason")])
    assert o.detected and o.detected_by == ("some_new_reason",) and o.reasons == ("some_new_reason",)
    assert not account(_inj(slot=-1, request_id=None), [_v(10, -1, "z", "verify_position")]).detected
