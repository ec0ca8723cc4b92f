"""Sliding-window and hybrid models, and attention backends other than FlashAttention, on vLLM on a GPU as vLLM runs
them by default (V2 runner, FULL_AND_PIECEWISE CUDA graphs, FlashAttention 3, which runs a window of 40 as (39, 0)): an
all-sliding 4-layer model (one ``swa`` group) and a 5-layer hybrid whose uneven full / sliding counts make vLLM split
the full layers into two KV cache groups (the canary's ``full``, ``full.1`` and ``swa``), each on the tiny workload
(prefix sharing, preemption, chunked prefill) with the canary in ``log`` mode: silent, every forward checked, graph
replays included; then the llama workload on Triton attention and FlashInfer. Skips without CUDA or vLLM."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "vllm"))
from vllm_support import run_workload  # noqa: E402

L = "model.layers.{}.self_attn.attn"
MODELS = {
    "all_sliding": (("--model", "mistral_swa", "--layers", "4", "--window", "40"), {"swa": [0, 1, 2, 3]}),
    "hybrid_split": (("--model", "llama", "--layers", "5", "--window", "40", "--sliding-layers", "1,3", "--num-blocks", "48"),
                     {"full": [0, 4], "full.1": [2], "swa": [1, 3]}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gpu_sliding_and_hybrid_models_silent_every_forward_checked(name, tmp_path_factory):
    extra, groups = MODELS[name]
    run = run_workload("clean", tmp_path_factory, *extra)
    m = run["metrics"]
    assert m["kv_canary_violations"] == 0 and not m["by_reason"] and run["violations"] == [], m["by_reason"]
    assert m["kv_canary_forwards"] > 20 and m["kv_canary_checked_forwards"] == m["kv_canary_forwards"]
    assert m["kv_canary_full_graph_forwards"] > 0 and m["kv_canary_prefix_hits"] > 0
    assert run["canary_layers"]["groups"] == {g: [L.format(i) for i in ids] for g, ids in groups.items()}


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLASHINFER"])
def test_gpu_other_attention_backends_silent_every_forward_checked(backend, tmp_path_factory):
    """The tiny workload on vLLM's Triton attention and FlashInfer backends (FlashInfer's metadata holds no block table:
    the adapter reads the V2 runner's); skips FlashInfer where it is not installed."""
    if backend == "FLASHINFER":
        pytest.importorskip("flashinfer")
    run = run_workload("clean", tmp_path_factory, "--attention-backend", backend)
    m = run["metrics"]
    assert m["kv_canary_violations"] == 0 and not m["by_reason"] and run["violations"] == [], m["by_reason"]
    assert m["kv_canary_forwards"] > 20 and m["kv_canary_checked_forwards"] == m["kv_canary_forwards"]
    assert m["kv_canary_canary_errors"] == 0 and m["kv_canary_unchecked_forwards"] == 0
