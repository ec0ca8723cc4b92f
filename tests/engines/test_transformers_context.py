"""``attach(..., context_of=...)``: a prefix computed under one context (LoRA adapter, tenant, salt) and served to a
request of another is caught on transformers continuous batching; silent within one context or without the hook.

Re-enactment (the engine's own behaviour, nothing patched): block sharing is on and transformers shares complete
blocks by tokens alone, so two requests whose prompts share two pages get the second one's prefix from the first.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import kvcanary  # noqa: E402
from engines.test_transformers_moves import host_pool  # noqa: E402,F401  (fixture)
from kvcanary.engines.transformers_cb import compat  # noqa: E402
from kvcanary.engines.transformers_cb.forward_view import find_batch_processor  # noqa: E402
from kvcanary.errors import KvCanaryTypeError  # noqa: E402
from kvcanary.ops import FailReason  # noqa: E402
from kvcanary.runtime.identity import IDENTITY_CONTEXT  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_engine")

SHARED = [(7 * i + 3) % 250 + 1 for i in range(40)]  # two full pages of 16, then a partial one
PROMPTS = [SHARED + [11, 12], SHARED + [13, 14, 15]]


def run(model, *, context_of=None, **canary):
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64, max_requests_per_batch=1,
                                  allow_block_sharing=True, use_cuda_graph=False, use_async_batching=False)
    starts = {}  # request -> first position of its first forward (one request per batch): a hit starts past 0

    def probe(module, args, kwargs):
        (fs,) = compat.requests_in_batch(find_batch_processor(kwargs["cache"]))
        starts.setdefault(fs.state.request_id, int(kwargs["position_ids"][0, 0]))

    hook = model.register_forward_pre_hook(probe, with_kwargs=True)
    try:
        with kvcanary.attach(model, context_of=context_of, **{"mode": "log", **canary}) as handle:
            out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=False)
    finally:
        hook.remove()
    served = [rid for rid, p in starts.items() if p == 32]
    assert len(served) == 1 and sorted(starts.values()) == [0, 32], f"no prefix hit: {starts}"
    return handle, served[0], {rid: list(o.generated_tokens) for rid, o in out.items()}


def test_prefix_hit_across_contexts_is_caught_against_the_request_served(llama):
    adapters = {"req_0": "lora-A", "req_1": "lora-B"}
    handle, served, tokens = run(llama, context_of=adapters.get)
    found = handle.violations()
    assert found and {v.request_id for v in found} == {served}
    head = [v for v in found if v.launch_tag.name == "HEAD_K_FULL"]
    assert head and head[0].stored_position == 0
    # the chain row, named at drain time: the stored record was produced under the other adapter's context
    assert head[0].reasons == FailReason.VERIFY_CHAIN_HASH_MISMATCH | IDENTITY_CONTEXT
    assert head[0].identity_detail == "stored -> expected: context 'lora-B' -> 'lora-A'"
    assert all(v.stored_position == 0 and v.launch_tag.phase in ("head", "tail") for v in found)
    _, _, plain = run(llama)
    assert tokens == plain  # the hook changes nothing the engine does


@pytest.mark.parametrize("context_of", [None, lambda rid: "lora-A", lambda rid: None], ids=["no-hook", "same", "none"])
def test_same_context_or_no_hook_is_silent_also_under_the_sweep(llama, context_of):
    handle, _, _ = run(llama, context_of=context_of, mode="raise", sweep_interval=1)
    c = handle.counters()
    assert c["total"] == 0 and handle.errors == [] and c["checked_forwards"] == c["engine_forwards"]
    (stats,) = handle.stats()
    assert stats.slots_verified["sweep"] > 0  # keyed slots were swept, position 0 included


def test_context_of_is_validated_at_attach(llama):
    with pytest.raises(KvCanaryTypeError, match=r"^kv-canary: context_of must be a callable"):
        kvcanary.attach(llama, context_of="lora-A")
    assert issubclass(KvCanaryTypeError, TypeError)


def test_unhashable_context_key_is_a_kv_canary_error(llama):
    gen = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64, max_requests_per_batch=1,
                                  use_cuda_graph=False, use_async_batching=False)
    with pytest.raises(KvCanaryTypeError, match="must return a hashable key"):
        with kvcanary.attach(llama, mode="raise", context_of=lambda rid: ["not", "hashable"]):
            llama.generate_batch(PROMPTS[:1], generation_config=gen, continuous_batching_config=cb, progress_bar=False)


def test_keyed_requests_restored_from_cpu_offload_and_forked_are_silent(llama, host_pool):
    """KV that moves keeps its context: a restore verifies position 0 against the request's key, and a forked
    child (``<id>__child#<i>``) takes its parent's key — a hook that would give children another key proves it."""
    from engines.test_transformers_moves import _checked, _fork_run, _offload_run

    _, handle, _ = _checked(llama, lambda: _offload_run(llama), context_of=lambda rid: "tenant-1")
    c = handle.counters()
    assert c["moves"]["restores"] >= 1 and c["moves"]["slots_restored"] > 0
    assert c["total"] == 0, handle.violations()[:3]
    _, handle, _ = _checked(llama, lambda: _fork_run(llama),
                            context_of=lambda rid: "child" if compat.FORK_CHILD_SEPARATOR in rid else "tenant-1")
    c = handle.counters()
    assert c["moves"]["fork_copies"] >= 1 and c["total"] == 0, handle.violations()[:3]
