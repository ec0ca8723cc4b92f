"""transformers 5.24.0 KV moves the adapter does not observe yet — forks (num_return_sequences > 1) and CPU
offload / restore — are refused with a kv-canary: error instead of reported as corruption."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("transformers")

from kvcanary.cli.demo import PAGE_SIZE, tiny_model, workload  # noqa: E402
from kvcanary.engines.transformers_cb import attach, compat  # noqa: E402
from kvcanary.engines.transformers_cb.attach import _refuse_unobservable_paths  # noqa: E402


def _processor(*, children=0, cpu_pool=None):
    runner = types.SimpleNamespace(use_cuda_graph_varlen=False, use_cuda_graph_decode=False,
                                   _compiled_varlen=None, _compiled_decode=None)
    return types.SimpleNamespace(model_runner=runner, use_async_batching=False, num_return_sequences=children + 1,
                                 offloading_manager=types.SimpleNamespace(_cpu_pool=cpu_pool))


def test_probes_and_refusals():
    assert compat.forked_children(_processor()) == 0 and not compat.cpu_offload_enabled(_processor())
    _refuse_unobservable_paths(_processor())
    assert compat.forked_children(_processor(children=1)) == 1
    with pytest.raises(RuntimeError, match=r"^kv-canary: num_return_sequences > 1 forks requests"):
        _refuse_unobservable_paths(_processor(children=1))
    assert compat.cpu_offload_enabled(_processor(cpu_pool=object()))
    with pytest.raises(RuntimeError, match=r"^kv-canary: CPU offloading is on .*cpu_offload_space=0"):
        _refuse_unobservable_paths(_processor(cpu_pool=object()))


def _generate(model, prompts, **cb_options):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=4, do_sample=True, num_return_sequences=2, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=40, max_batch_tokens=64, max_requests_per_batch=4,
                                  use_cuda_graph=False, use_async_batching=False, **cb_options)
    return model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)


def test_forking_run_is_refused_not_reported(caplog):
    import torch

    model = tiny_model("llama", torch.device("cpu"))
    with attach(model, mode="log"):  # log mode: the refusal is logged, the session runs unchecked
        _generate(model, workload(seed=0, num_requests=2))
    assert "kv-canary: num_return_sequences > 1 forks requests" in caplog.text
    assert "kv_canary violation" not in caplog.text
