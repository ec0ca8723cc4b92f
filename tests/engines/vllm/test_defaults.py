"""The canary's default options on deeper and mixed vLLM models, and single-bit flips in cached KV.

One subprocess (``python -m kvcanary.faults.vllm_experiments defaults``) starts, in turn, Llamas of 4, 6
and 8 layers, a 6-layer hybrid (odd layers sliding, W = 40) and a 5-layer Mistral (every layer sliding),
each with the canary's defaults in ``raise`` mode, and runs 8 requests of the standard workload; on the
4-layer model it then flips 40 single bits in cached blocks (random block, token, layer, K or V, byte,
bit), one at a time, each followed by one sweep pass. ~3 min on 2 cores.
"""
from __future__ import annotations

import sys

from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import run_experiment  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_experiment("defaults", tmp_path_factory, "--flips", "40", timeout=1200)


@pytest.mark.parametrize("model", ["llama4", "llama6", "llama8", "hybrid6",
                                   "mistral5"])
def test_defaults_start_and_stay_silent(runs, model):
    row = runs[model]
    assert "start_error" not in row, row.get("start_error")
    assert "run_error" not in row, row.get("run_error")
    t = row["totals"]
    assert t["violations"] == 0 and t["forwards"] > 10 and t["checked_forwards"] == t["forwards"]


def test_every_single_bit_flip_in_cached_kv_is_caught_by_one_sweep_pass(runs):
    flips = runs["llama4"]["flips"]
    assert len(flips) == 40
    assert {f["side"] for f in flips} == {"K", "V"} and len({f["layer"] for f in flips}) == 4
    assert any(f["byte"] >= 16 for f in flips)  # beyond the partial fingerprint's 16 bytes
    missed = [f for f in flips if not f["caught"]]
    assert not missed, missed[:3]
    assert all(f["reasons"] == ["verify_real_kv_hash"] for f in flips)
