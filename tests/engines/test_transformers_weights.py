"""Weights updated in place while serving (the RL loop): a prefix-cache hit on KV computed by the old weights is a
violation of the hitting request, named ``identity_weights_version``; an update followed by the engine's own cache
reset, or no update at all, stays silent.

Re-enactment (the engine's own behaviour, nothing patched): a persistent continuous-batching manager with block
sharing serves request "a", the weights change inside ``manager.pause()`` (transformers' documented way to update a
serving model in place), and request "b" shares two full pages of "a"'s prompt, so the engine serves "a"'s KV.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import kvcanary  # noqa: E402
from kvcanary.engines.transformers_cb import compat  # noqa: E402
from kvcanary.engines.transformers_cb.forward_view import find_batch_processor  # noqa: E402
from kvcanary.errors import KvCanaryRuntimeError  # noqa: E402
from kvcanary.ops import FailReason  # noqa: E402
from kvcanary.runtime.identity import IDENTITY_WEIGHTS_VERSION  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_engine")

SHARED = [(7 * i + 3) % 250 + 1 for i in range(40)]  # two full pages of 16, then a partial one
PROMPT_A, PROMPT_B = SHARED + [11, 12], SHARED + [13, 14, 15]
WEIGHTS_HIT = FailReason.VERIFY_CHAIN_HASH_MISMATCH | IDENTITY_WEIGHTS_VERSION


@pytest.fixture
def model():
    """A fresh tiny Llama per test: the tests change its weights."""
    from kvcanary.cli.demo import tiny_model

    return tiny_model("llama", torch.device("cpu"), seed=0)


def load_shifted(model, handle, manager) -> None:
    model.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()})


def optimizer_step(model, handle, manager) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.enable_grad():
        ids = torch.tensor([PROMPT_A])
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def through_data(model, handle, manager) -> None:
    """A write the watch cannot see: through ``param.data`` (no version counter, no hook)."""
    for p in model.parameters():
        p.data.mul_(1.05)


def through_data_then_bump(model, handle, manager) -> None:
    through_data(model, handle, manager)
    handle.bump_weights_version()


def reset_cache_after(update):
    def run(model, handle, manager) -> None:
        update(model, handle, manager)
        manager.batch_processor.cache.reset()  # the engine's own prefix-cache reset: ledgers and pool
    return run


def serve(model, update, **attach):
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64, max_requests_per_batch=1,
                                  allow_block_sharing=True, use_cuda_graph=False, use_async_batching=False)
    starts = {}  # request -> first position of its first forward: a prefix hit starts past 0

    def probe(module, args, kwargs):
        if "cache" not in kwargs:  # the training forward of `optimizer_step`
            return
        for fs in compat.requests_in_batch(find_batch_processor(kwargs["cache"])):
            starts.setdefault(fs.state.request_id, int(kwargs["position_ids"][0, 0]))

    hook = model.register_forward_pre_hook(probe, with_kwargs=True)
    try:
        with kvcanary.attach(model, **{"mode": "log", **attach}) as handle:
            manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
            manager.start()
            try:
                manager.add_request(PROMPT_A, request_id="a")
                assert manager.get_result(request_id="a", timeout=60) is not None
                if update is not None:
                    with manager.pause():
                        update(model, handle, manager)
                manager.add_request(PROMPT_B, request_id="b")
                assert manager.get_result(request_id="b", timeout=60) is not None
            finally:
                manager.stop(block=True)
    finally:
        hook.remove()
    return handle, starts


@pytest.mark.parametrize("update", [load_shifted, optimizer_step, through_data_then_bump],
                         ids=["load_state_dict", "optimizer_step", "manual_bump"])
def test_prefix_hit_on_kv_of_old_weights_is_caught_against_the_request(model, update):
    handle, starts = serve(model, update)
    assert starts == {"a": 0, "b": 32}  # "b" was served "a"'s two pages, computed by the old weights
    found = handle.violations()
    assert found and {v.request_id for v in found} == {"b"}
    head = [v for v in found if v.launch_tag.name == "HEAD_K_FULL"]
    assert head and head[0].stored_position == 0 and head[0].reasons == WEIGHTS_HIT
    assert head[0].identity_detail == "stored -> expected: weights_version 0 -> 1"
    assert all(v.stored_position == 0 and v.reasons == WEIGHTS_HIT for v in found)
    assert handle.weights_version == 1 and handle.errors == []


@pytest.mark.parametrize("update", [None, reset_cache_after(load_shifted), reset_cache_after(optimizer_step)],
                         ids=["no_update", "load_then_reset", "optimizer_then_reset"])
def test_no_update_or_update_with_cache_reset_is_silent(model, update):
    handle, starts = serve(model, update, mode="raise", sweep_interval=1)
    assert starts == {"a": 0, "b": 32 if update is None else 0}  # after the reset "b" is recomputed
    c = handle.counters()
    assert c["total"] == 0 and handle.errors == [] and c["checked_forwards"] == c["engine_forwards"]
    assert handle.weights_version == (0 if update is None else 1)


def test_writes_through_data_need_the_manual_fallback(model):
    handle, starts = serve(model, through_data)
    assert starts == {"a": 0, "b": 32}
    # the limit the docs name: a write through ``param.data`` leaves no trace the watch reads
    assert handle.weights_version == 0 and handle.counters()["total"] == 0


def test_watch_off_keeps_no_version(model):
    handle, starts = serve(model, load_shifted, watch_weights=False)
    assert starts == {"a": 0, "b": 32} and handle.counters()["total"] == 0
    with pytest.raises(KvCanaryRuntimeError, match=r"^kv-canary: bump_weights_version\(\) needs"):
        handle.bump_weights_version()
