"""The transformers adapter with CUDA graphs on: every forward checked, replays included.

Tiny random models from the demo (a 2-layer Llama with prefix sharing, a 4-layer Qwen3 with sliding-window
layers) on the GPU, ``ContinuousBatchingConfig(use_cuda_graph=True)``: the runner's warmup captures the
varlen graph with the canary's device work inside, and every later step with the same key is a replay
(no Python hooks run). Faults are injected between the engine's batch preparation and the forward, into
the engine's static buffers (`engines.cb_support.BetweenSteps`), where a replay would read them. In
transformers 5.24 the varlen graph key includes each group's max key length, which grows with every decode
step, so with these small workloads a graph is rarely replayed (run 15 on the H200: none of 35 forwards after
step 2); the fault tests therefore inject into the first eligible forward, captured or replayed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("quiet_engine")]
pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from kvcanary.cli.demo import PAGE_SIZE, RedirectRead, tiny_model, workload  # noqa: E402
from kvcanary.faults.transformers import FlipUsedBlockByte  # noqa: E402
from kvcanary.engines.transformers_cb import attach, compat  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.cb_support import BetweenSteps, count_replays  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", CUDA, seed=0)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3_swa", CUDA, seed=0)


def run(model, prompts, *, graphs=True, max_requests_per_batch=4) -> dict[str, list[int]]:
    """``generate_batch`` with the demo's small cache; ``graphs=None`` leaves graphs and async batching to
    the engine's GPU defaults."""
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    flags = {} if graphs is None else {"use_cuda_graph": graphs, "use_async_batching": False}
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=40, max_batch_tokens=64,
                                  max_requests_per_batch=max_requests_per_batch, **flags)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_every_graphed_forward_is_checked_and_tokens_are_unchanged(kind, llama, qwen3, monkeypatch):
    model = llama if kind == "llama" else qwen3
    prompts = workload(seed=1)
    reference = run(model, prompts)
    replays = count_replays(monkeypatch)
    with attach(model, mode="raise", sweep_interval=4) as handle:
        checked = run(model, prompts)
        engine_graphs = {id(g) for g in compat.graph_store(handle._current.processor).values()}
    # a replay of a graph the engine does not hold is the canary's own sweep-slice graph (capture_sweep); the
    # engine's graphs hold HEAD / TAIL, so the canary captures no other graph of its own here
    sweep_graphs = {r for r in replays if r not in engine_graphs}
    sweep_replays = sum(1 for r in replays if r in sweep_graphs)
    replays = [r for r in replays if r in engine_graphs]
    assert checked == reference, "the canary changed the generated tokens"
    assert handle.violations() == [] and handle.errors == []
    counters = handle.counters()
    assert len(replays) > 0, "no graph was replayed"
    assert counters["graphs_captured"] > 0 and counters["warmup_forwards"] > 0
    assert counters["checked_forwards"] == counters["engine_forwards"] == handle.forwards
    assert counters["engine_forwards"] >= len(replays)  # every replay was an engine forward, and checked
    assert sweep_graphs and sweep_replays > 0  # the sweep slice replayed from its own graph (capture_sweep default)


def test_gpu_default_config_is_checked(llama):
    """Graphs and async batching left to the engine: with sdpa it runs eagerly (the canary captures its own
    HEAD / TAIL work); with a flash kernel it turns graphs and async batching on, and async batching is
    refused with a kv-canary: error rather than run unchecked."""
    prompts = workload(seed=1, num_requests=6)
    reference = run(llama, prompts, graphs=None)
    handle = attach(llama, mode="log", sweep_interval=4)
    try:
        checked = run(llama, prompts, graphs=None)
    finally:
        handle.detach()
    if handle.errors:
        assert all(str(e).startswith("kv-canary: async batching is on") for e in handle.errors), handle.errors
        return
    assert checked == reference
    counters = handle.counters()
    assert counters["checked_forwards"] == counters["engine_forwards"] == handle.forwards > 0
    assert handle.violations() == []


def test_flipped_kv_byte_is_caught_in_graph_mode_and_charged_to_the_reader(llama, monkeypatch):
    """A bit flipped in a block only one request of the forward reads, injected into the engine's cache just
    before a graph-mode forward: TAIL re-hashes it in that forward, against that request."""
    injector = FlipUsedBlockByte(seed=3, after_step=2)
    handle = attach(llama, mode="log", sweep_interval=0)
    between = BetweenSteps(injector, handle, replays_only=False).install(monkeypatch)
    with handle:
        run(llama, workload(seed=1))
    assert injector.ledger, f"nothing injected; forwards seen (step, query tokens, replay): {between.seen_steps}"
    (inj,) = injector.ledger
    hits = [v for v in handle.violations() if v.slot == inj.slot and v.group == "full"]
    assert hits, f"flip at slot {inj.slot} not reported: {[v.log_line() for v in handle.violations()]}"
    first = min(hits, key=lambda v: v.step)
    assert first.reason_label == "verify_real_kv_hash" and first.launch_tag.name == "TAIL_K_FULL"
    assert first.request_id == inj.request_id and first.step == inj.step


@pytest.mark.parametrize("group", ["full", "swa"])
def test_redirected_read_index_is_caught_in_graph_mode_and_charged_to_the_reader(group, llama, qwen3, monkeypatch):
    model = llama if group == "full" else qwen3
    injector = RedirectRead(group=group, seed=4, after_step=2)
    handle = attach(model, mode="log", sweep_interval=0)
    between = BetweenSteps(injector, handle, replays_only=False).install(monkeypatch)
    with handle:
        run(model, workload(seed=1))
    assert injector.ledger, f"nothing injected; forwards seen (step, query tokens, replay): {between.seen_steps}"
    (inj,) = injector.ledger
    at_step = [v for v in handle.violations() if v.step == inj.step]
    assert at_step and {v.group for v in at_step} == {group}
    assert all(v.request_id == inj.request_id for v in at_step)
    assert any(v.slot == inj.slot and "verify_position" in v.reason_label for v in at_step)
    counters = handle.counters()
    assert counters["checked_forwards"] == counters["engine_forwards"]


def test_graph_mode_replays_the_sweep_slice_from_a_graph_of_its_own(llama, monkeypatch):
    """Graph mode: HEAD / TAIL live inside the engine's graphs, the rotating sweep slice runs between forwards.
    After the first swept step the slice is captured alone and replayed (no eager slice launches after that), and
    the rotating passes still complete and verify every live slot."""
    from kvcanary.runtime import Canary
    from kvcanary.runtime.sweep import Sweeper

    captured, eager = [], []
    capture = Canary.capture_sweep_graph

    def counted_capture(self):
        captured.append((capture(self), len(eager)))  # (captured?, eager slices before the capture)
        return captured[-1][0]

    monkeypatch.setattr(Canary, "capture_sweep_graph", counted_capture)
    slice_ = Sweeper.slice
    monkeypatch.setattr(Sweeper, "slice", lambda self: eager.append(1) or slice_(self))
    prompts = workload(seed=1)
    reference = run(llama, prompts)
    with attach(llama, mode="raise", sweep_interval=2, capture_sweep=True) as handle:
        checked = run(llama, prompts)
    stats = handle.stats()[-1]
    assert checked == reference and handle.violations() == [] and handle.errors == []
    assert [ok for ok, _ in captured] == [True], captured
    assert len(eager) == captured[0][1], "slices after the capture must replay the graph, not launch eagerly"
    assert len(eager) < 2 * stats.sweep_passes, (len(eager), stats.sweep_passes)  # so replays ran too
    assert stats.last_sweep_verified == stats.last_sweep_live, stats
