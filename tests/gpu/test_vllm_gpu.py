"""The canary in vLLM on a GPU, as vLLM runs by default there (V2 model runner, torch.compile, FULL_AND_PIECEWISE
CUDA graphs, FlashAttention), end to end: the tiny workload of `kvcanary.faults.vllm_workload` (prefix hits,
chunked prefill, preemption in a cramped block pool, ``n = 2``) without the canary, with it, and with it plus the
fault injector (a flipped bit in a cached block, a redirected block-table entry). Each engine in a process of its
own. Skips without CUDA or vLLM.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("vllm")

from kvcanary.faults.vllm_workload import BLOCK_SIZE  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "vllm"))
from vllm_support import detection, run_workload  # noqa: E402


def _run(mode: str, tmp_path_factory) -> dict:
    return run_workload(mode, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run("ref", tmp_path_factory)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _run("clean", tmp_path_factory)


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    return _run("faults", tmp_path_factory)


def test_gpu_identical_tokens_with_and_without_the_canary(reference, clean):
    assert reference["tokens"] and clean["tokens"] == reference["tokens"]


def test_gpu_clean_workload_every_forward_checked_graph_replays_included(clean):
    m = clean["metrics"]
    print(json.dumps({k: v for k, v in m.items() if k != "by_reason"}))
    assert m["kv_canary_violations"] == 0 and not m["by_reason"] and clean["violations"] == []
    assert m["kv_canary_forwards"] > 50 and m["kv_canary_checked_forwards"] == m["kv_canary_forwards"]
    assert m["kv_canary_full_graph_forwards"] > 0  # decode steps replayed from vLLM's FULL CUDA graphs, checked
    # after the first forward the canary's own work replays from its CUDA graphs
    assert m["kv_canary_canary_graph_forwards"] == m["kv_canary_forwards"] - 1
    assert m["kv_canary_prefix_hits"] > 0 and m["prefix_cache_hits"] > 0
    assert m["kv_canary_resumed"] > 0 and m["num_preemptions"] > 0
    assert m["kv_canary_slots_verified"] > 10 * m["kv_canary_slots_written"] > 0
    assert all(v == {"violations": 0, "reasons": []} for v in clean["verdicts"])


def test_gpu_faults_caught_against_the_right_request(faulted):
    ledger = {e["name"]: e for e in faulted["ledger"]}
    print(json.dumps(faulted["ledger"]))
    assert set(ledger) == {"redirect_block_table", "flip_cached_block_byte"}
    violations = faulted["violations"]
    redirect = ledger["redirect_block_table"]
    hits = detection(redirect, violations)
    assert any(v["launch_tag"] == "HEAD_K_FULL" for v in hits)
    assert redirect["slot"] // BLOCK_SIZE in {v["slot"] // BLOCK_SIZE for v in hits if "verify_position" in v["fail_reason"]}
    flip = ledger["flip_cached_block_byte"]
    hits = detection(flip, violations)
    assert {v["slot"] for v in hits if v["launch_tag"].startswith("TAIL_K")} == {flip["slot"]}
    first = min(e["forward"] for e in faulted["ledger"])
    assert not [v for v in violations if v["step"] < first]
    assert faulted["metrics"]["kv_canary_violations"] == len(violations) > 0
