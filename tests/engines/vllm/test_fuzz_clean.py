"""CI slice of the vLLM clean-workload fuzzer (`kvcanary.faults.fuzz.vllm`): fixed seeds, each drawn
configuration trimmed to four requests of at most 8 new tokens (CI time; `bench/fuzz_clean.py --engine vllm`
runs them whole), run without the canary and then with it in ``raise`` mode; every third one also runs
a faulted twin (fixed seeds chosen so the slice covers every architecture, block size, prefix caching
on and off, aborts, n > 1 and hash mode). All configurations share one worker process (engines start in seconds there).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvcanary.faults.fuzz import vllm as fuzz  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import assert_clean_outcome, ci_config as _trimmed  # noqa: E402

SEEDS = (0, 3, 4, 5, 7, 12, 16, 19, 24)  # chosen to cover every feature the slice asserts below


def test_the_slice_covers_the_engine_features():
    configs = [_trimmed(s) for s in SEEDS]
    assert {c["arch"] for c in configs} == {"llama", "mistral_swa", "hybrid"}
    assert {c["block_size"] for c in configs} == set(fuzz.BLOCK_SIZES)
    assert {c["prefix_caching"] for c in configs} == {True, False}
    assert {c["canary"]["real_kv_hash"] for c in configs} >= {"partial", "all"}
    assert any(c["aborts"] for c in configs) and any(r["n"] > 1 for c in configs for r in c["requests"])
    assert min(c["layers"] for c in configs) <= 3 and max(c["layers"] for c in configs) >= 6
    assert {c["canary"].get("sweep_max_bytes") for c in configs} >= {None, 1}  # whole-pool and one-block sweep windows


@pytest.mark.parametrize("seed", SEEDS)
def test_clean_configuration_is_silent_identical_and_fully_checked(seed):
    assert_clean_outcome(fuzz.run_config(_trimmed(seed), seed=seed, faulted=SEEDS.index(seed) % 3 == 0))


def test_found_same_step_share_followed_by_blocks_cached_earlier_is_silent():
    """Campaign 8117's configuration 12, whole (all-sliding Mistral shape, window 115, block 32, 9 blocks, n = 3, an
    abort): a row hits a block another row computes in the same forward followed by a block cached earlier. It raised
    a false alarm before the adapter's same-step claim ran from the first shared position (docs/vllm.md, "Prefix hits
    inside one forward"); now silent, identical and fully checked."""
    import random

    config = fuzz.sample_config(random.Random("vllm:8117:12"))
    assert config["arch"] == "mistral_swa" and config["aborts"] and config["window"] == 115
    assert_clean_outcome(fuzz.run_config(config, seed=8117 * 100_000 + 12, faulted=False))
