"""The embedded transformers workload: tiny randomly initialised models and prompts (no download, no tokenizer),
shared by the demo, the campaigns and the tests.

* ``llama`` — 2 layers, full attention; ``qwen3_swa`` — 4 layers, sliding-window (16) and full attention alternating;
* `workload`: two shared system prompts (2+ pages each) with user turns, a few bare prompts;
* `generate`: ``generate_batch`` in a small cache (4 requests per batch, 64 tokens per step, no CUDA graphs).
"""
from __future__ import annotations

import random

import torch

from kvcanary.errors import KvCanaryValueError

PAGE_SIZE = 16
SLIDING_WINDOW = 16


def tiny_model(kind: str, device: torch.device, seed: int = 0):
    """A tiny randomly initialised ``llama`` (full attention) or ``qwen3_swa`` (sliding + full)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=256, max_position_embeddings=1024, attn_implementation="sdpa")
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **common))
    elif kind == "qwen3_swa":
        layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=4, sliding_window=SLIDING_WINDOW, use_sliding_window=True,
                                             max_window_layers=4, layer_types=layer_types, **common))
    else:
        raise KvCanaryValueError(f"kv-canary: unknown demo model {kind!r}")
    return model.to(device).eval()


def workload(seed: int = 0, num_requests: int = 14) -> list[list[int]]:
    """Prompts: two shared system prompts (2+ pages each), user turns of 3..40 tokens, a few bare."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 256) for _ in range(40)], [rng.randrange(1, 256) for _ in range(37)]]
    prompts = []
    for i in range(num_requests):
        user = [rng.randrange(1, 256) for _ in range(rng.randrange(3, 41))]
        prompts.append(user if i % 7 == 6 else systems[i % 2] + user)
    return prompts


def generate(model, prompts, *, max_new_tokens: int = 8, max_requests_per_batch: int = 4,
             num_blocks: int = 40) -> dict[str, list[int]]:
    """``generate_batch`` with a small cache: 4 requests per batch, 64 tokens per step, no graphs."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=num_blocks, max_batch_tokens=64,
                                  max_requests_per_batch=max_requests_per_batch,
                                  use_cuda_graph=False, use_async_batching=False)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


