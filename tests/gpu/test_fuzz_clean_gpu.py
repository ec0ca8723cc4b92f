"""The clean-workload fuzzer on the GPU with CUDA graphs on (``use_cuda_graph=True``): a fixed-seed slice of
transformers configurations, each unchecked then checked in ``raise`` mode (0 violations, identical tokens,
every forward — replays included — checked), a third with a faulted twin injected between the engine's batch
preparation and the forward. The full campaign is ``bench/fuzz_clean.py --engine transformers --device cuda
--cuda-graphs --configs 100 --max-seconds 420``."""
from __future__ import annotations

import logging

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
