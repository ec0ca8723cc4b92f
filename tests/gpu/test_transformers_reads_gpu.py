"""The read-table check on the GPU: a surplus page handed to attention is reported with CUDA graphs on (the check is
captured with the engine's forward) and with the engine eager (the canary's own translation graph)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("quiet_engine")]
pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator  # noqa: E402

import kvcanary  # noqa: E402
from kvcanary.cli.demo import tiny_model, workload  # noqa: E402
from kvcanary.runtime.reads import READ_TABLE_MISMATCH  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.test_transformers_reads import SurplusPage  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", torch.device("cuda"), seed=0)


def _run(model, graphs: bool):
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=48, max_batch_tokens=64, max_requests_per_batch=4,
                                  use_cuda_graph=graphs, use_async_batching=False)
    with kvcanary.attach(model, mode="log", sweep_interval=4) as handle:
        model.generate_batch(workload(seed=3, num_requests=6), generation_config=gen, continuous_batching_config=cb,
                             progress_bar=False)
    return handle


@pytest.mark.parametrize("graphs", [True, False], ids=["engine-graphs", "eager-canary-graphs"])
def test_surplus_page_read_is_reported_on_the_gpu(llama, monkeypatch, graphs):
    clean = _run(llama, graphs)
    assert clean.counters()["total"] == 0
    surplus = SurplusPage(monkeypatch, FullAttentionCacheAllocator, target="req_5")
    handle = _run(llama, graphs)
    found = [v for v in handle.violations() if int(v.reasons) & READ_TABLE_MISMATCH]
    assert surplus.fired and [v.request_id for v in found] == ["req_5"], handle.counters()
    c = handle.counters()
    assert c["checked_forwards"] == c["engine_forwards"]
