"""The rotating sweep and blocks the engine frees during a pass (transformers 5.24.0, CPU).

A pass takes its live set once, at its start. transformers frees blocks to its pool between forwards and may
reuse their bytes before the pass ends: for another request of the same group, or — its sector free — for the
other group of a hybrid model (both cut one byte tensor into blocks), or as the destination of a fork's copy.
The adapter releases freed blocks from the pass (``Canary.release_slots``), so the sweep never judges a slot that
is free, or reallocated and not yet written. Clean runs stay silent; a flipped byte in an idle cached block and a
redirected read are still caught.
"""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from kvcanary.cli.demo import RedirectRead, tiny_model  # noqa: E402
from kvcanary.engines.transformers_cb import attach, compat  # noqa: E402
from kvcanary.engines.transformers_cb.layout import FULL_ATTENTION, build_layouts, layer_kv_views  # noqa: E402
from kvcanary.ops import FailReason  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_engine")


@pytest.fixture(scope="module")
def hybrid():
    """Qwen3 with sliding and full layers (window 16, 4 layers)."""
    return tiny_model("qwen3_swa", torch.device("cpu"))


def _shared_prompts(seed: int, n: int) -> list[list[int]]:
    """``n`` short prompts over three system prompts of 10-29 tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 256) for _ in range(rng.randrange(10, 30))] for _ in range(3)]
    return [systems[i % 3] + [rng.randrange(1, 256) for _ in range(rng.randrange(2, 10))] for i in range(n)]


def _generate(model, prompts, *, page_size, num_blocks, per_batch, new_tokens, fork=False, max_batch_tokens=64):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    torch.manual_seed(1234)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=fork, num_return_sequences=2 if fork else 1,
                           eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=per_batch, use_cuda_graph=False, use_async_batching=False,
                                  allow_block_sharing=True)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def _hybrid_run(model, requests=6, num_blocks=32, new_tokens=1, **canary):
    """Short requests over shared system prompts, one per forward, pages of 4: the pool frees and hands blocks
    (and their sectors, across the two groups) around within every sweep pass."""
    with attach(model, mode="log", **canary) as handle:
        tokens = _generate(model, _shared_prompts(61, requests), page_size=4, num_blocks=num_blocks, per_batch=1,
                           new_tokens=new_tokens)
    return tokens, handle


def test_hybrid_model_with_block_sharing_is_silent_under_a_rotating_sweep(hybrid):
    tokens, handle = _hybrid_run(hybrid, sweep_interval=3)
    counters = handle.counters()
    assert handle.violations() == [] and counters["total"] == 0
    assert counters["moves"]["slots_released"] > 0  # the pool freed blocks during the run, and the sweep heard of it
    assert counters["checked_forwards"] == counters["engine_forwards"] > 0
    assert tokens == _generate(hybrid, _shared_prompts(61, 6), page_size=4, num_blocks=32, per_batch=1, new_tokens=1)


class _FlipRunningRequestKv:
    """A forward pre-hook (before the canary's) that flips one bit of the last full-attention layer's K, past the
    first 16 bytes of the token (only the sweep's every-byte fingerprints cover it), in position 1 of the request
    this forward continues, once, at the first forward after ``after`` that continues one with 4+ cached tokens."""

    def __init__(self, after: int) -> None:
        self.after, self.step, self.hit = after, 0, None

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is None:
            return None
        self.step += 1
        if self.hit is not None or self.step <= self.after:
            return None
        layout = next(g for g in build_layouts(cache) if g.layer_type == FULL_ATTENTION)
        running = compat.active_requests(compat.find_batch_processor(cache))
        tables = compat.request_blocks(compat.allocators(cache)[FULL_ATTENTION])
        rid = next((r for r, st in running.items() if compat.kv_length(st) >= 4 and tables.get(r)), None)
        if rid is None:
            return None
        block, offset = tables[rid][0], 1
        k, _, per_token = layer_kv_views(cache, layout, layout.layer_ids[-1])
        k.view(torch.uint8)[block, offset * per_token + 37] ^= 1 << 5
        self.hit = (block * layout.page_size + offset, rid)
        return None


def test_flipped_deep_byte_in_a_live_full_slot_is_still_caught_by_the_rotating_sweep(hybrid):
    flip = _FlipRunningRequestKv(after=2)
    hook = hybrid.register_forward_pre_hook(flip, with_kwargs=True, prepend=True)
    try:
        _, handle = _hybrid_run(hybrid, new_tokens=6, sweep_interval=3)
    finally:
        hook.remove()
    assert flip.hit is not None, "no running request to flip"
    slot, rid = flip.hit
    found = handle.violations()
    assert found and {(v.group, v.slot) for v in found} == {("full", slot)}
    assert all(v.phase == "sweep" and v.reasons & FailReason.VERIFY_REAL_KV_HASH_MISMATCH for v in found)
    assert {v.request_id for v in found} == {rid}


def test_redirected_read_is_still_caught_on_the_hybrid_model(hybrid):
    injector = RedirectRead(group="full", seed=3, after_step=3).install(hybrid)
    try:
        _, handle = _hybrid_run(hybrid, new_tokens=6, sweep_interval=3)
    finally:
        injector.remove()
    (inj,) = injector.ledger
    at_step = [v for v in handle.violations() if v.step == inj.step]
    assert at_step and all(v.request_id == inj.request_id for v in at_step)


def test_forks_reusing_freed_blocks_within_a_pass_are_silent(llama):
    """Ten prompts of 30-75 tokens, each forked in two, eight per forward, pages of 16, a pass every 8 forwards:
    blocks of finished requests are handed to fork children within a pass (as copy destinations)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randrange(30, 76))] for _ in range(10)]
    with attach(llama, mode="log", sweep_interval=8) as handle:
        _generate(llama, prompts, page_size=16, num_blocks=64, per_batch=8, new_tokens=8, fork=True)
    counters = handle.counters()
    assert counters["moves"]["fork_copies"] > 0
    assert handle.violations() == [] and counters["total"] == 0
