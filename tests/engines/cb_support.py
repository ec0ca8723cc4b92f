"""Helpers for the transformers continuous-batching tests (CPU and CUDA graphs).

* `padded_like_graphs` — on a machine without graphs, make the engine pad its batches and run its warmup
  exactly as in CUDA-graph mode (static shapes, padding sequences, ``__warmup_*`` forwards); with
  ``attach(..., graph_driver=True)`` the adapter drives the steps from its ``compute_batch`` wrapper:
  everything of graph mode but the capture.
* `BetweenSteps` — runs a demo fault injector after the engine prepared each batch, on the engine's static
  buffers: outside any graph, so the fault reaches replayed forwards (forward pre-hooks do not run there).
"""
from __future__ import annotations

import torch
from transformers.generation.continuous_batching import model_runner
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

from kvcanary.engines.transformers_cb import compat


def padded_like_graphs(monkeypatch) -> None:
    init = model_runner.ModelRunner.__init__

    def padded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_inputs = True

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padded_init)


def static_kwargs(io) -> dict:
    """The parts of the forward's kwargs a demo injector reads, as views of the engine's static buffers."""
    n = len(io.cache.cache_allocators)
    reads = [io.read_index_storage[i, : io.true_read_sizes[i] if io.max_kv_read else 0] for i in range(n)]
    return {
        "block_table": io.block_table[:, : io.num_request_in_batch] if io.use_block_table else None,
        "read_index": reads,
        "write_index": [io.write_index_storage[i, : io.true_write_sizes[i]] for i in range(n)],
        "cu_seq_lens_k": io.cumulative_seqlens_k,
    }


class BetweenSteps:
    """Fire ``injector`` (a `kvcanary.cli.demo` injector) between the engine's batch preparation and the
    forward, numbering steps as the canary does (warmup batches are not steps). With ``replays_only`` (the
    default) it fires only into a forward whose graph already exists, i.e. a replay; ``replayed`` records
    that per injection."""

    def __init__(self, injector, handle, *, replays_only: bool = True) -> None:
        self.injector = injector
        self.handle = handle
        self.replays_only = replays_only  # fire only into a forward whose graph already exists
        self.replayed: list[bool] = []
        self.seen_steps: list[tuple] = []  # (step, query tokens, replay?) of every forward seen (diagnostics)

    @staticmethod
    def _replay(io) -> bool:
        graphs = getattr(io, "graphs", None)
        return graphs is not None and graphs.get_graph(io._get_graph_key()) is not None

    def install(self, monkeypatch) -> "BetweenSteps":
        prepare = ContinuousBatchingIOs.prepare_batch_tensors
        inj = self.injector

        def prepare_then_inject(io, *args, **kwargs):
            prepare(io, *args, **kwargs)
            batch = list(io.requests_in_batch)
            if compat.is_warmup(batch):
                return
            current = self.handle._current
            inj.step = (current.canary.step if current is not None and current.cache is io.cache else 0) + 1
            replay = self._replay(io)
            self.seen_steps.append((inj.step, getattr(io, "num_q_tokens", None), replay))
            if not inj.ledger and inj.step > inj.after_step and (replay or not self.replays_only):
                inj.fire(io.cache, static_kwargs(io), batch)
                if inj.ledger:
                    self.replayed.append(replay)
            inj.seen.update(fs.state.request_id for fs in batch)

        monkeypatch.setattr(ContinuousBatchingIOs, "prepare_batch_tensors", prepare_then_inject)
        return self


def count_replays(monkeypatch) -> list:
    """Count ``torch.cuda.CUDAGraph.replay`` calls: one list element per replay, the ``id`` of the graph
    replayed (so a test can leave out graphs of its own, e.g. the canary's sweep-slice graph)."""
    calls: list = []
    replay = torch.cuda.CUDAGraph.replay

    def counted(self, *args, **kwargs):
        calls.append(id(self))
        return replay(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    return calls
