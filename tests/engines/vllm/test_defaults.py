"""The canary's default options on deeper and mixed vLLM models, and single-bit flips in cached KV.

One subprocess (``python -m kvcanary.faults.vllm_experiments defaults``) starts, in turn, Llamas of 4, 6
and 8 layers, a 6-layer hybrid (odd layers sliding, W = 40) and a 5-layer Mistral (every layer sliding),
each with the canary's defaults in ``raise`` mode, and runs 8 requests of the standard workload; on the
4-layer model it then flips 40 single bits in cached blocks (random block, token, layer, K or V, byte,
bit), one at a time, each followed by one sweep pass. ~3 min on 2 cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-defaults")
    out = work / "defaults.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run([sys.executable, "-m", "kvcanary.faults.vllm_experiments", "defaults", str(work), str(out),
                           "--flips", "40"], env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        pytest.fail(f"defaults runs failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


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
