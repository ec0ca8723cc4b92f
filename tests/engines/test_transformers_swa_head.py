"""Sliding-window chunks that move the window, on transformers continuous batching (CPU, the demo's tiny
Qwen3: window 16, 64 tokens per step, so prefill chunks have ``P + E > W``).

The chunk's first queries read positions ``[max(0, P - W + 1), P + E - W)`` before the chunk's own writes
overwrite their ring slots. They are verified at HEAD (the adapter's table covers every read position) and
skipped at TAIL (the group is a ring window): a stale read there is caught in the forward that makes it,
against the reading request, and a clean run stays silent.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from engines.cb_support import padded_like_graphs  # noqa: E402
from kvcanary.cli.demo import SLIDING_WINDOW, generate, workload  # noqa: E402
from kvcanary.engines.transformers_cb import attach  # noqa: E402
from kvcanary.faults.accounting import account  # noqa: E402
from kvcanary.faults.transformers import StaleWindowRead  # noqa: E402
from kvcanary.ops.constants import CanaryLaunchTag  # noqa: E402


pytestmark = pytest.mark.usefixtures("quiet_engine_and_canary")


@pytest.mark.parametrize("seed,padded", [(0, False), (2, False), (4, False), (1, True)])
def test_stale_read_of_a_position_leaving_the_window_is_caught_at_head(qwen3, seed, padded, monkeypatch):
    if padded:
        padded_like_graphs(monkeypatch)
    injector = StaleWindowRead(seed=seed, after_step=2).install(qwen3)
    try:
        with attach(qwen3, mode="log", sweep_interval=4, readable_per_step=0, graph_driver=padded) as handle:
            generate(qwen3, workload(seed))
    finally:
        injector.remove()
    (inj,) = injector.ledger
    outcome = account(inj, handle.violations())
    assert outcome.detected and outcome.latency_forwards == 0 and outcome.request_id == inj.request_id
    at_slot = [v for v in handle.violations() if v.slot == inj.slot]
    assert [(v.launch_tag, v.step, v.expected_position, v.request_id) for v in at_slot] == [
        (CanaryLaunchTag.HEAD_K_SWA, inj.step, inj.position, inj.request_id)]
    assert all(v.group == "swa" and v.request_id == inj.request_id and v.step == inj.step for v in handle.violations())


def test_chunks_that_move_the_window_run_clean(qwen3):
    """The same workloads without a fault: every HEAD entry of a read position verified, nothing reported
    (TAIL skips the recycled positions, whose KV the chunk overwrote)."""
    probe = _ChunkProbe(qwen3)
    try:
        for seed in (0, 1):
            with attach(qwen3, mode="raise", sweep_interval=4) as handle:
                generate(qwen3, workload(seed))
            assert handle.violations() == []
    finally:
        probe.remove()
    assert probe.sliding_chunks > 0  # the workload does move the window inside a chunk


class _ChunkProbe:
    """Counts rows whose chunk reads positions that leave the window during it (``P + E > W``, ``E >= 2``,
    ``P > 0``)."""

    def __init__(self, model) -> None:
        self.sliding_chunks = 0
        self._hook = model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        cu = kwargs["cu_seq_lens_q"].tolist()
        pos = kwargs["position_ids"][0].tolist()
        for i in range(len(cu) - 1):
            e = cu[i + 1] - cu[i]
            if e >= 2 and pos[cu[i]] > 0 and pos[cu[i]] + e > SLIDING_WINDOW:
                self.sliding_chunks += 1

    def remove(self) -> None:
        self._hook.remove()
