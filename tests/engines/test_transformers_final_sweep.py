"""The end of a generation session sweeps every live slot (transformers 5.24.0, CPU): damage to cached KV that
the last reads do not cover (a byte past the fingerprinted 16 of a token) and that no rotating slice reached
before the session ended is reported when the engine stops (``generate_batch`` returning), against the slot's
last writer; also at `detach` / `Canary.close` when the engine had not stopped."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvcanary.cli.demo import generate, workload  # noqa: E402
from kvcanary.engines.transformers_cb import attach, compat  # noqa: E402
from kvcanary.engines.transformers_cb.layout import FULL_ATTENTION, build_layouts, layer_kv_views  # noqa: E402
from kvcanary.ops import FailReason  # noqa: E402
from kvcanary.runtime import CanaryViolationError  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_engine")


def _prompts() -> list[list[int]]:
    """Three requests sharing a 40-token system prompt, run one at a time: the last reuses the cached prefix."""
    return [p for p in workload(seed=2, num_requests=6) if len(p) > 40][:3]


class _FlipBeforeLastRequest:
    """Forward pre-hook (before the canary's): at the first forward of ``rid``, flip a bit of byte 37 of layer 0's K
    (no read's fingerprint covers it: they hash 16 bytes a token) in a slot of the first prefix block it reuses."""

    def __init__(self, rid: str) -> None:
        self.rid, self.hit = rid, None

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is None or self.hit is not None:
            return None
        batch = compat.requests_in_batch(compat.find_batch_processor(cache))
        if not any(fs.state.request_id == self.rid for fs in batch):
            return None
        layout = next(g for g in build_layouts(cache) if g.layer_type == FULL_ATTENTION)
        block = compat.request_blocks(compat.allocators(cache)[FULL_ATTENTION])[self.rid][0]
        k, _, per_token = layer_kv_views(cache, layout, layout.layer_ids[0])
        k.view(torch.uint8)[block, 3 * per_token + 37] ^= 1 << 2
        self.hit = block * layout.page_size + 3
        return None


def _flipped_run(llama, **options):
    flip = _FlipBeforeLastRequest("req_2")
    hook = llama.register_forward_pre_hook(flip, with_kwargs=True, prepend=True)
    return flip, hook


def test_a_deep_byte_flipped_before_the_last_read_is_reported_when_generate_batch_returns(llama):
    flip, hook = _flipped_run(llama)
    try:
        with attach(llama, mode="log", sweep_interval=64) as handle:  # no rotating pass completes in this run
            generate(llama, _prompts(), max_requests_per_batch=1, max_new_tokens=4)
            found = handle.violations()  # before detach: the sweep ran when the engine stopped
            forwards = handle.forwards
    finally:
        hook.remove()
    assert flip.hit is not None
    assert found and {(v.group, v.slot) for v in found} == {("full", flip.hit)}
    assert all(v.phase == "sweep" and v.reasons == FailReason.VERIFY_REAL_KV_HASH_MISMATCH for v in found)
    assert {v.request_id for v in found} == {"req_0"}  # the prefix block's writer
    assert all(v.stored_fingerprint != v.recomputed_fingerprint and "every byte" in v.fingerprint_scope for v in found)
    assert len(handle.violations()) == len(found) and handle.forwards == forwards  # detach did not sweep it twice


def test_raise_mode_raises_the_final_sweeps_finding_on_leaving_the_with(llama):
    flip, hook = _flipped_run(llama)
    try:
        with pytest.raises(CanaryViolationError) as info:
            with attach(llama, mode="raise", sweep_interval=64):
                generate(llama, _prompts(), max_requests_per_batch=1, max_new_tokens=4)
    finally:
        hook.remove()
    assert {v.slot for v in info.value.violations} == {flip.hit}


def test_clean_session_end_sweeps_and_stays_silent(llama):
    with attach(llama, mode="raise", sweep_interval=64) as handle:
        generate(llama, _prompts(), max_requests_per_batch=1, max_new_tokens=4)
        (stats,) = handle.stats()
        assert stats.sweeps == 1 and sum(stats.last_sweep_verified.values()) > 0  # the session-end sweep
    assert handle.violations() == [] and handle.errors == []


def _stop_already_shadowed(model):
    """Another wrapper shadows each new manager's ``stop`` before the canary sees it (an instance attribute
    ``stop``): the adapter then installs no stop hook, as for a manager it cannot find. Returns the undo."""
    init = model.init_continuous_batching

    def init_continuous_batching(*args, **kwargs):
        manager = init(*args, **kwargs)
        manager.stop = manager.stop  # the bound method, as an instance attribute
        return manager

    model.init_continuous_batching = init_continuous_batching
    return lambda: delattr(model, "init_continuous_batching")


def test_close_sweeps_a_session_whose_engine_did_not_stop(llama):
    """Without the stop hook (a manager stopped without joining, never stopped, or whose ``stop`` another
    wrapper already shadows), `detach` closes the session's canary with its final sweep."""
    flip, hook = _flipped_run(llama)
    undo = _stop_already_shadowed(llama)
    try:
        with attach(llama, mode="log", sweep_interval=64) as handle:
            generate(llama, _prompts(), max_requests_per_batch=1, max_new_tokens=4)
            assert handle.violations() == []
    finally:
        undo()
        hook.remove()
    found = handle.violations()
    assert found and {v.slot for v in found} == {flip.hit} and all(v.phase == "sweep" for v in found)
