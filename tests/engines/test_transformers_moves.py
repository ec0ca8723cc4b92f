"""transformers 5.24.0 KV moves seen by the adapter (engines/transformers_cb/moves.py): fork copies
(num_return_sequences > 1) and CPU offload / restore carry the canary records, so clean runs stay silent and
KV damaged in the host pool is caught when it comes back, against the request that restores it."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from kvcanary.cli.demo import PAGE_SIZE, tiny_model, workload  # noqa: E402
from kvcanary.engines.transformers_cb import attach, compat  # noqa: E402
from kvcanary.engines.transformers_cb import moves as moves_mod  # noqa: E402
from kvcanary.engines.transformers_cb.layout import GroupLayout  # noqa: E402
from kvcanary.errors import KvCanaryRuntimeError  # noqa: E402
from kvcanary.ops import FailReason  # noqa: E402

OFFLOAD_BLOCKS = 16  # 6 requests of up to 80 tokens + 24 new ones cannot all stay: two get offloaded


class _HostTorch:
    """``torch`` as the offloading manager sees it on a machine without an accelerator: its host pool is
    allocated with ``pin_memory=True``, which CPU-only torch refuses; plain host memory behaves the same."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)


@pytest.fixture
def host_pool(monkeypatch):
    if not torch.cuda.is_available():
        from transformers.generation.continuous_batching import offloading_manager

        monkeypatch.setattr(offloading_manager, "torch", _HostTorch())


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", torch.device("cpu"))


def _generate(model, prompts, *, fork=False, num_blocks=40, offload=0.0, max_new_tokens=8) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    torch.manual_seed(1234)  # sampling (forks) draws from the global generator
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=fork, num_return_sequences=2 if fork else 1,
                           eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=num_blocks, max_batch_tokens=64,
                                  max_requests_per_batch=4, use_cuda_graph=False, use_async_batching=False,
                                  cpu_offload_space=offload)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def _checked(model, run, **options):
    """(tokens, handle, the session's cache and processor) of ``run()`` with the canary attached."""
    with attach(model, mode="log", **options) as handle:
        tokens = run()
        session = handle._current
        engine = (session.cache, session.processor) if session is not None else (None, None)
    return tokens, handle, engine


def _offload_run(model):
    return _generate(model, workload(seed=0, num_requests=6), num_blocks=OFFLOAD_BLOCKS, offload=0.01,
                     max_new_tokens=24)


def _fork_run(model):
    return _generate(model, workload(seed=0, num_requests=4), fork=True)


def test_clean_cpu_offload_run_is_silent_and_unchanged(model, host_pool):
    reference = _offload_run(model)
    tokens, handle, (cache, processor) = _checked(model, lambda: _offload_run(model))
    counters = handle.counters()
    assert counters["moves"]["offloads"] >= 1 and counters["moves"]["restores"] == counters["moves"]["offloads"]
    assert counters["moves"]["slots_restored"] > 0
    assert counters["total"] == 0, handle.violations()[:3]
    assert counters["unchecked_forwards"] == 0 and counters["canary_errors"] == 0
    assert tokens == reference
    # detach removed exactly the three instance attributes: the class methods are visible again
    manager = compat.offloading_manager(processor)
    assert compat.FORK_COPY_METHOD not in vars(cache)
    assert not {compat.OFFLOAD_METHOD, compat.RESTORE_METHOD} & set(vars(manager))


def test_clean_fork_run_is_silent_and_unchanged(model):
    reference = _fork_run(model)
    assert len(reference) == 8 and any(rid.endswith("__child#0") for rid in reference)
    tokens, handle, (cache, _) = _checked(model, lambda: _fork_run(model))
    counters = handle.counters()
    assert counters["moves"]["fork_copies"] >= 1 and counters["moves"]["slots_copied"] > 0
    assert counters["total"] == 0, handle.violations()[:3]
    assert tokens == reference
    assert compat.FORK_COPY_METHOD not in vars(cache)


def test_unobserved_fork_copies_would_read_as_corruption(model):
    """The same fork run with the move wrappers left out (each session's `MoveObserver` removed at its first
    forward, before any fork): the copied blocks carry no records."""
    with attach(model, mode="log") as handle:
        def unobserve(module, args, kwargs):  # runs after the canary's pre-hook, which opened the session
            if handle._current is not None:
                handle._current.moves.remove()

        hook = model.register_forward_pre_hook(unobserve, with_kwargs=True)
        try:
            _fork_run(model)
        finally:
            hook.remove()
    assert handle.counters()["total"] > 0


def test_offloaded_kv_corrupted_in_host_memory_is_caught_at_restore(model, host_pool, monkeypatch):
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    damaged: list[str] = []
    original = OffloadingManager._offload_to_cpu

    def offload_then_damage(self, victims, victim_block_tables):
        moved = original(self, victims, victim_block_tables)
        if moved and not damaged:
            rid = sorted(moved)[0]
            view, host_blocks = compat.host_kv_blocks(self, rid, "full_attention")
            view[host_blocks[0], 0] ^= 0x55  # layer 0, K, token 0 of the request's first block
            damaged.append(rid)
        return moved

    monkeypatch.setattr(OffloadingManager, "_offload_to_cpu", offload_then_damage)
    _, handle, _ = _checked(model, lambda: _offload_run(model))
    assert damaged
    found = handle.violations()
    assert found, "the damaged block came back unnoticed"
    first = found[0]
    assert first.launch_tag.phase == "move" and first.group == "full"
    assert first.reasons & FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    assert first.request_id == damaged[0] and first.forward_kind == "import:" + moves_mod.RESTORE_LABEL
    assert first.stored_position == 0  # token 0 of the first block
    # every later report is the same damaged slot (a request sharing the block by prefix de-duplication reads
    # the same bad bytes and is named for it): nothing else in the run is reported
    assert {(v.group, v.slot) for v in found} == {(first.group, first.slot)}


def test_live_positions_full_and_sliding():
    def layout(window):
        return GroupLayout(name="g", layer_type="t", index=0, layer_ids=(0,), page_size=4, block_stride=8,
                           first_data_block=2, total_blocks=16, sliding_window=window, pages_stride=2)

    pos, block, off = moves_mod.live_positions(layout(0), 6, 3)
    assert pos.tolist() == [0, 1, 2, 3, 4, 5] and block.tolist() == [0, 0, 0, 0, 1, 1] and off.tolist() == [0, 1, 2, 3, 0, 1]
    pos, block, off = moves_mod.live_positions(layout(0), 20, 2)  # only what the blocks hold
    assert pos.tolist() == list(range(8))
    pos, block, off = moves_mod.live_positions(layout(8), 11, 2)  # window of 8: positions 3..10, ring p % 8
    assert pos.tolist() == list(range(3, 11))
    assert (block * 4 + off).tolist() == [3, 4, 5, 6, 7, 0, 1, 2]
    assert moves_mod.block_slots(layout(0), [5, 2]).tolist() == [20, 21, 22, 23, 8, 9, 10, 11]


def test_restore_without_parked_records_is_refused_not_reported():
    """A request restored whose offload the canary never saw: a kv-canary: error for the handle's policy
    (log mode suspends the session: unchecked, never a false violation), not an import of nothing."""
    errors: list = []
    canary = object()
    obs = moves_mod.MoveObserver(cache=None, processor=types.SimpleNamespace(offloading_manager=None), layouts=[],
                                 enter=lambda: canary, failed=errors.append)
    state = types.SimpleNamespace(request_id="r1", position_offset=5, initial_tokens=[1] * 5, generated_tokens=[])
    with pytest.raises(KvCanaryRuntimeError, match=r"^kv-canary: request r1 was restored from CPU offload"):
        obs._unpark(canary, [("r1", state, {"full_attention": 1})])
