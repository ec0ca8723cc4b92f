"""Context keys on vLLM: KV computed under one cache salt (or LoRA adapter) and served under another is
caught against the request that was served it; equal contexts, and vLLM's own (salt-aware) prefix cache,
stay silent. One subprocess, two engine starts (~1 min on 2 cores)."""
from __future__ import annotations

import sys

from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import run_experiment  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_experiment("context", tmp_path_factory)


def test_a_prefix_served_across_cache_salts_is_caught_against_the_served_request(runs):
    first, same, other = runs["salt_blind"]
    assert first["violations"] == [] and first["cached_tokens"] == 0
    assert same["cached_tokens"] > 0 and same["violations"] == []  # a hit within one context is legitimate
    assert same["verdict"] == {"violations": 0, "reasons": []}
    assert other["cached_tokens"] > 0  # the (emulated) bug: salt b served salt a's blocks
    # the engine's internal request id is the user's id plus a suffix
    assert other["violations"] and {v["request_id"].rsplit("-", 1)[0] for v in other["violations"]} == {other["request_id"]}
    assert {v["reason"] for v in other["violations"]} >= {"verify_chain_hash"}
    assert other["verdict"]["violations"] > 0


def test_vllms_own_salted_prefix_cache_shares_nothing_and_is_silent(runs):
    a, b = runs["vllm_hashing"]
    assert b["cached_tokens"] == 0 and a["violations"] == b["violations"] == []


def test_context_keys_from_lora_and_salt():
    from kvcanary.engines.vllm.connector import context_key, request_context_key

    assert context_key() == 0 and context_key(None, None, "") == 0
    keys = {context_key(cache_salt="a"), context_key(cache_salt="b"), context_key(1, "sql"), context_key(2, "chat"),
            context_key(1, "sql", "a")}
    assert len(keys) == 5 and 0 not in keys and all(0 < k < 2**63 for k in keys)
    assert context_key(cache_salt="a") == context_key(cache_salt="a")

    class Lora:
        lora_int_id, lora_name = 3, "adapter"

    class Req:
        lora_request, cache_salt = Lora(), None

    assert request_context_key(Req()) == context_key(3, "adapter")
