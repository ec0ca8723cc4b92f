"""The sweep on the real transformers engine sees idle prefix-cached blocks (issue 11 item 7, the fifth
mutant of the outside audit: the adapter's live-slot set dropping them, so no check ever reads them).

A tiny random Llama runs a few requests that share a system prompt, one at a time, under the canary.
When they have all finished, the shared prefix stays in the prefix cache: blocks no running request
reads. One bit of one such block's KV (first layer, K side, inside the fingerprinted bytes) is flipped
between forwards; an explicit sweep must report exactly that slot, as a SWEEP row.
"""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("transformers")

from kvcanary.cli.demo import PAGE_SIZE, generate, tiny_model, workload  # noqa: E402
from kvcanary.engines.transformers_cb import attach, compat  # noqa: E402
from kvcanary.engines.transformers_cb.layout import FULL_ATTENTION  # noqa: E402
from kvcanary.ops import CanaryLaunchTag, FailReason  # noqa: E402

SWEEP_TAGS = {CanaryLaunchTag.SWEEP_K_FULL, CanaryLaunchTag.SWEEP_V_FULL}


pytestmark = pytest.mark.usefixtures("quiet_engine")


def _flip_k_bit(cache, alloc, block: int, offset: int, byte: int, bit: int) -> None:
    """Flip one bit of byte ``byte`` of the first layer's K of (block, offset) in the paged cache: the
    allocator's rows are [H, D] K pages, ``block_physical_stride`` rows per block."""
    kv = alloc.cache_tensor
    row_bytes = kv.shape[-2] * kv.shape[-1] * kv.element_size()
    row = block * alloc.block_physical_stride + offset
    cache.cache_tensor[row * row_bytes + byte] ^= 1 << bit


def test_flipped_bit_in_an_idle_prefix_cached_block_is_reported_by_the_sweep():
    model = tiny_model("llama", torch.device("cpu"), seed=0)
    prompts = [p for p in workload(seed=2, num_requests=6) if len(p) > 40][:3]  # share a 40-token prefix
    assert len(prompts) == 3

    with attach(model, mode="log", sweep_interval=0) as handle:
        generate(model, prompts, max_requests_per_batch=1)
        assert handle.violations() == []
        session = handle._current
        cache = session.cache
        processor = session.processor
        alloc = cache.cache_allocators[FULL_ATTENTION]
        assert compat.active_requests(processor) == {}, "a request is still running"
        referenced = {b for blocks in compat.request_blocks(alloc).values() for b in blocks}
        idle = sorted(b for b in compat.cached_blocks(alloc) if b not in referenced)
        assert idle, "the run left no idle prefix-cached block"

        clean = handle.sweep()  # before the flip: the idle blocks are swept and found clean
        assert handle.violations() == []

        block, offset, byte, bit = idle[-1], 3, 5, 2
        slot = block * alloc.tokens_per_page + offset
        _flip_k_bit(cache, alloc, block, offset, byte, bit)
        report = handle.sweep()
        found = handle.violations()

    assert found, "the sweep did not report the flipped idle prefix-cached block"
    assert {(v.group, v.slot) for v in found} == {("full", slot)}
    assert all(v.launch_tag in SWEEP_TAGS and v.phase == "sweep" for v in found)
    assert any(v.launch_tag == CanaryLaunchTag.SWEEP_K_FULL and v.reasons & FailReason.VERIFY_REAL_KV_HASH_MISMATCH
               for v in found)
    # and the live set the sweeps walked held every slot of the idle blocks
    for r in (clean, report):
        assert r.complete and r.live.get("full", 0) >= PAGE_SIZE * len(idle)
