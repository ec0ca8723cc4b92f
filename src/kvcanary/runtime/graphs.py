"""`CanaryGraphs`: the canary's own per-forward device work captured once into CUDA graphs.

For an engine that runs its forward eagerly (or captures it without the canary), the canary's launches
are the remaining per-forward host cost: ~20 kernel launches and small torch ops. Because every launch
reads only the static buffers (`StaticBatch`, plans, rings, counters) and spans their whole capacity
while capturing, three graphs serve every batch that fits:

* ``head``  — ring marks, request-row history, plan, HEAD verify + write, slot records;
* ``tail``  — TAIL verify + write, row stamps (``stamps``: the stamps alone, for a forward that raised);
* ``sweep`` — one rotating sweep slice (cursor on the device);
* ``tail_sweep`` — ``tail`` then ``sweep`` in one graph (one replay fewer per forward; None without a sweep).

Capturing freezes the static buffers (a batch that no longer fits is an error, not a silent regrowth).
Warm-up runs each half once on an empty batch (all padding rows: nothing planned, written or verified)
so Triton compiles before capture; the launch counters and sweep cursors it moved are restored.
"""
from __future__ import annotations

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.runtime.launch import ForwardLaunches
from kvcanary.runtime.staging import StaticBatch
from kvcanary.runtime.sweep import Sweeper


class CanaryGraphs:
    """Captured HEAD / TAIL / sweep-slice work (see the module docstring). CUDA only."""

    def __init__(self, *, launches: ForwardLaunches, sweeper: Sweeper, static: StaticBatch, counters) -> None:
        if static.device.type != "cuda":
            raise KvCanaryValueError(f"kv-canary: CUDA graphs need a CUDA canary, this one is on {static.device}")
        self.launches, self.sweeper, self.static = launches, sweeper, static
        static.clear()
        static.frozen = True
        saved = [t.clone() for t in [counters.table, *sweeper.cursor_state()]]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._head()
                self._tail()
                self._sweep()
        torch.cuda.current_stream().wait_stream(side)
        for t, v in zip([counters.table, *sweeper.cursor_state()], saved):
            t.copy_(v)
        pool = torch.cuda.graph_pool_handle()
        self.head, self.tail, self.stamps, self.sweep = (
            self._capture(fn, pool) for fn in (self._head, self._tail, self._stamps, self._sweep)
        )
        self.tail_sweep = self._capture(self._tail_then_sweep, pool) if sweeper.interval > 0 else None

    def _head(self) -> None:
        self.launches.head(full=True)

    def _tail(self) -> None:
        self.launches.tail(run_checks=True)

    def _stamps(self) -> None:  # the forward raised: no TAIL checks, the HEAD rows still get stamps
        self.launches.tail(run_checks=False)

    def _sweep(self) -> None:
        self.sweeper.slice_device()

    def _tail_then_sweep(self) -> None:
        self._tail()
        self._sweep()

    @staticmethod
    def _capture(fn, pool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph
