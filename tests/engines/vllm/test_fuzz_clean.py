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
