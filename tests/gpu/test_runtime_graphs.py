"""The runtime's hot path on a real CUDA device: captured graphs == eager, and no host sync per forward.

* Two simulated engines with the same seed and the same faults, one canary eager and one replaying its
  captured graphs (`Canary.capture_graphs`): identical canary buffers, slot records and violations.
* In ``log`` mode, a steady-state forward (begin_step + stage + HEAD + TAIL + sweep slice + drain poll)
  runs under ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call raises.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload  # noqa: E402
from kvcanary.runtime import Canary, CanaryConfig  # noqa: E402
from tests.runtime.conftest import flip_and_redirect  # noqa: E402

SIM = dict(num_slots=2048, swa_num_slots=512, sliding_window=24, max_requests=24, max_context=256, chunk_size=48,
           max_batch_tokens=192, max_running=12, block_size=4, seed=5, device="cuda")


def _engine(graphs: bool, canary_tokens: Optional[int] = None, **overrides) -> tuple[SimEngine, Canary]:
    """``canary_tokens``: the canary's static token capacity when not the engine's budget."""
    sc = SimConfig(**{**SIM, **overrides})
    canary = Canary(CanaryConfig(mode="log", sweep_interval=16, health_interval=0, readable_per_step=0,
                                 chain_position_warmup=0),
                    groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                    max_batch_tokens=canary_tokens or sc.max_batch_tokens, device="cuda")
    return SimEngine(sc, canary), canary


def _run(graphs: bool, **overrides):
    engine, canary = _engine(graphs, **overrides)
    stream = SimWorkload(seed=5, new_tokens=(20, 60), abort_prob=0.0, arrival_prob=0.5).stream(256)

    def steps(n: int) -> None:
        for _ in range(n):
            for prompt, new in next(stream):
                engine.add_request(prompt, new)
            engine.step()

    while canary.step == 0:  # the workload may arrive late: capture needs one forward (the engine's tables)
        steps(1)
    if graphs:
        canary.capture_graphs()
    steps(60)
    flip_and_redirect(engine)
    steps(60)
    found = canary.violations()
    return canary, found


def _key(v):
    return (v.step, v.launch_tag.name, v.slot, v.stored_position, v.expected_position, int(v.reasons),
            v.request_id, v.request_row)


@pytest.mark.parametrize("max_batch_tokens", [192, 512])  # 512: decode forwards replay the small-token bucket
def test_captured_graphs_match_eager_records_and_violations(max_batch_tokens):
    eager, found_eager = _run(graphs=False, max_batch_tokens=max_batch_tokens)
    graphed, found_graphed = _run(graphs=True, max_batch_tokens=max_batch_tokens)
    assert found_eager, "the faults must be caught"
    if max_batch_tokens > 256:
        assert len(graphed._graphs.sets) == 2 and graphed._graphs.sets[0].tokens == 256
    assert sorted(map(_key, found_graphed)) == sorted(map(_key, found_eager))
    for name, g in eager.groups.items():
        h = graphed.groups[name]
        assert torch.equal(g.head_buf, h.head_buf)
        for side in g.tail_sides:
            assert torch.equal(g.tail_bufs[side], h.tail_bufs[side])
        for field in ("position", "prev_slot", "step", "owner"):  # the last element is the trash row (scratch)
            assert torch.equal(getattr(g.records, field)[:-1], getattr(h.records, field)[:-1]), field
    assert eager.counters()["checked_forwards"] == graphed.counters()["checked_forwards"] == graphed.step


@pytest.mark.parametrize("graphs,route", [(False, "device"), (True, "device"), (True, "host")])
def test_log_mode_forward_does_not_synchronise(graphs, route):
    """``route="host"``: the batch stays in host memory (pinned mirror + one upload per forward)."""
    engine, canary = _engine(graphs)
    batch = None
    while batch is None or batch.forward_kind != "decode":
        for prompt, new in [([1, 2, 3, 4, 5, 6, 7, 8] * 4, 40)] if engine.forwards == 0 else []:
            engine.add_request(prompt, new)
        batch = engine.step()
    dev = dataclasses.replace(batch, req_pool_indices=batch.req_pool_indices.cuda(), prefix_lens=batch.prefix_lens.cuda(),
                              extend_lens=batch.extend_lens.cuda(), input_ids=batch.input_ids.cuda(),
                              positions=batch.positions.cuda(), token_table_lens=batch.token_table_lens.cuda(),
                              groups={k: dataclasses.replace(g, out_cache_loc=g.out_cache_loc.cuda())
                                      for k, g in batch.groups.items()}) if route == "device" else batch
    if graphs:
        canary.capture_graphs()
    for _ in range(3):  # warm: drain buffers, kernels compiled
        canary.before_forward(dev)
        canary.after_forward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            canary.before_forward(dev)
            canary.after_forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert canary.counters()["checked_forwards"] == canary.step


def test_release_slots_between_forwards_does_not_synchronise():
    """Engines release freed slots between forwards (`Canary.release_slots`), often: no host sync, and the pass
    total counts the released slots out."""
    engine, canary = _engine(False)
    batch = None
    while batch is None or batch.forward_kind != "decode":
        for prompt, new in [([1, 2, 3, 4, 5, 6, 7, 8] * 4, 40)] if engine.forwards == 0 else []:
            engine.add_request(prompt, new)
        batch = engine.step()
    freed = [2000, 2001, 2002]  # never written: releasing them changes nothing the sweep checks
    for _ in range(3):  # warm: drain buffers, kernels compiled, the host allocator's pinned block cached
        canary.release_slots("full", freed)
        canary.before_forward(batch)
        canary.after_forward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            canary.release_slots("full", freed)
            canary.before_forward(batch)
            canary.after_forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert canary.counters()["checked_forwards"] == canary.step and canary.violations() == []



def _run_keys_late(graphs: bool):
    """Unkeyed requests first (graphs captured without context keys), then a weight update that keeps the prefix cache:
    the same prompts again are keyed with the new weights version and hit KV of the old weights (violations)."""
    engine, canary = _engine(graphs, sliding_window=0)  # (the sim serves no prefix hits under a window)
    prompts = [[3 + (7 * i + j) % 97 for j in range(40)] for i in range(4)]

    def drain() -> None:
        for _ in range(400):
            if not engine.running and not engine.waiting:
                return
            engine.step()

    for p in prompts:
        engine.add_request(p, 4, rid=f"before{len(engine.waiting)}")
    engine.step()
    if graphs:
        canary.capture_graphs()
    drain()
    engine.update_weights(reset_prefix_cache=False)
    for i, p in enumerate(prompts):
        engine.add_request(p, 4, rid=f"after{i}")
    engine.step()
    if graphs and not canary.replays_own_graphs:
        canary.capture_graphs()  # what an adapter does after a release
    drain()
    return canary, canary.violations()


def test_context_keys_after_capture_release_the_graphs_and_match_eager():
    eager, found_eager = _run_keys_late(graphs=False)
    graphed, found_graphed = _run_keys_late(graphs=True)
    assert graphed.suspended is None and graphed.graph_releases == 1 and graphed.replays_own_graphs
    assert {v.request_id for v in found_eager} == {f"after{i}" for i in range(4)}
    assert {v.reason_label for v in found_eager} == {"verify_chain_hash+identity_weights_version"}
    assert sorted(map(_key, found_graphed)) == sorted(map(_key, found_eager))
    assert eager.counters()["checked_forwards"] == graphed.counters()["checked_forwards"] == graphed.step


def _run_past_capacity(graphs: bool):
    """Graphs captured on buffers of 32 tokens after a one-request forward, then the engine's own batches of up to
    192 tokens (as an adapter's same-step shares add positions past the engine's budget): each batch that does not
    fit releases the graphs, the buffers grow (powers of two), the adapter captures again."""
    engine, canary = _engine(graphs, canary_tokens=32)
    engine.add_request([5 + i for i in range(8)], 30)
    engine.step()
    if graphs:
        canary.capture_graphs()
    stream = SimWorkload(seed=5, new_tokens=(20, 60), abort_prob=0.0, arrival_prob=0.5).stream(256)
    for i in range(120):
        for prompt, new in next(stream):
            engine.add_request(prompt, new)
        engine.step()
        if graphs and not canary.replays_own_graphs:
            canary.capture_graphs()
        if i == 60:
            flip_and_redirect(engine)
    return canary, canary.violations()


def test_a_batch_past_the_captured_buffers_releases_the_graphs_and_matches_eager():
    eager, found_eager = _run_past_capacity(graphs=False)
    graphed, found_graphed = _run_past_capacity(graphs=True)
    assert graphed.suspended is None and graphed.graph_releases >= 1 and graphed.replays_own_graphs
    assert graphed.static.growths == eager.static.growths >= 1
    assert found_eager, "the faults must be caught"
    assert sorted(map(_key, found_graphed)) == sorted(map(_key, found_eager))
    assert eager.counters()["checked_forwards"] == graphed.counters()["checked_forwards"] == graphed.step
