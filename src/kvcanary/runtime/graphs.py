"""`CanaryGraphs`: the canary's own per-forward device work captured once into CUDA graphs.

For an engine that runs its forward eagerly (or captures it without the canary), the canary's launches
are the remaining per-forward host cost: ~20 kernel launches and small torch ops. Because every launch
reads only the static buffers (`StaticBatch`, plans, rings, counters) and spans their whole capacity
while capturing, three graphs serve every batch that fits:

* ``head``  — ring marks, request-row history, plan, HEAD verify + write, slot records;
* ``tail``  — TAIL verify + write, row stamps (``stamps``: the stamps alone, for a forward that raised);
* ``sweep`` — one rotating sweep slice (cursor on the device);
* ``head_sweep`` — ``head`` with the forward's sweep slice on a parallel branch (None without a sweep): the branch
  forks once the step is open (`ForwardLaunches.head`'s ``on_open``), its slice plans join the main branch before
  the slot records are written (they read the records as the step found them), and its verify + stamps overlap the
  HEAD checks and record writes; the whole branch joins before the graph ends (the engine writes KV next).

HEAD / TAIL / stamps / head_sweep exist per bucket (`GraphSet`): the full capacity and a decode bucket, each
reading its own set of static buffers (`StaticBatch.sets`: the decode bucket reads the decode-sized set, so its
upload is a few KiB).
An engine that captures HEAD / TAIL inside its own graphs still runs the sweep slice between forwards:
`capture_sweep_slice` captures that slice alone (one replay instead of its launches from Python each step).

Capturing freezes the static buffers (a batch that no longer fits is an error, not a silent regrowth).
Warm-up runs each half of each bucket on an empty batch (all padding rows: nothing planned, written or verified)
so Triton compiles before capture; the launch counters and sweep cursors it moved are restored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryValueError
from kvcanary.runtime.capture import capture_graph
from kvcanary.runtime.launch import ForwardLaunches
from kvcanary.runtime.staging import StaticBatch
from kvcanary.runtime.sweep import Sweeper


@dataclass(frozen=True)
class GraphSet:
    """The graphs of one bucket: launches sized to ``rows`` x ``tokens`` of buffer set ``buffers``."""

    rows: int
    tokens: int
    buffers: str
    head: torch.cuda.CUDAGraph
    tail: torch.cuda.CUDAGraph
    stamps: torch.cuda.CUDAGraph
    head_sweep: Optional[torch.cuda.CUDAGraph]


class CanaryGraphs:
    """Captured HEAD / TAIL / sweep-slice work (see the module docstring). CUDA only.

    Buckets: the full static capacity, plus — when the static buffers have a decode-sized set
    (`StaticBatch.has_small_set`: more tokens than ``small_tokens``, rows that fit the write op's single-CTA
    path) — a decode bucket of ``small_tokens`` tokens over that set, whose writes run as one small kernel each
    instead of two kernels spanning every token of the capacity. `pick` returns the bucket of the set the last
    stage filled; the static buffers stay padded past the batch (see `StaticBatch`)."""

    def __init__(self, *, launches: ForwardLaunches, sweeper: Sweeper, static: StaticBatch, counters,
                 error_mode: str = "global") -> None:
        require_cuda(static.device)
        self.launches, self.sweeper, self.static = launches, sweeper, static
        self.error_mode = error_mode  # torch.cuda.graph capture_error_mode; "thread_local" beside an engine's threads
        static.frozen = True
        self.branch = _SweepBranch(sweeper) if sweeper.interval > 0 else None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            shapes = run_empty_buckets(launches=launches, sweeper=sweeper, static=static, counters=counters,
                                       head_with_sweep=self._head_with_sweep if self.branch is not None else None,
                                       rounds=2)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        self.sweep = self._capture(self._sweep, pool)
        self.sets = [self._capture_set(*shape, pool) for shape in shapes]  # smallest first
        self._by_buffers = {graph_set.buffers: graph_set for graph_set in self.sets}

    def pick(self, buffers: str) -> GraphSet:
        """The bucket reading buffer set ``buffers`` (`StaticBatch.active` after a stage)."""
        return self._by_buffers[buffers]

    def _capture_set(self, rows: int, tokens: int, buffers: str, pool) -> GraphSet:
        self.static.activate(buffers)  # the captured launches read this set's views
        head = self._capture(lambda: self.launches.head(limit=(rows, tokens)), pool)  # TAIL reads HEAD's shape
        tail, stamps = (self._capture(fn, pool) for fn in (self._tail, self._stamps))
        head_sweep = (self._capture(lambda: self._head_with_sweep(rows, tokens), pool)
                      if self.branch is not None else None)
        return GraphSet(rows=rows, tokens=tokens, buffers=buffers, head=head, tail=tail, stamps=stamps,
                        head_sweep=head_sweep)

    def _tail(self) -> None:
        self.launches.tail(run_checks=True)

    def _stamps(self) -> None:  # the forward raised: no TAIL checks, the HEAD rows still get stamps
        self.launches.tail(run_checks=False)

    def _sweep(self) -> None:
        self.sweeper.slice_device()

    def _head_with_sweep(self, rows: int, tokens: int) -> None:
        self.launches.head(limit=(rows, tokens), on_open=self.branch.fork, before_records=self.branch.wait_plans)
        self.branch.join()

    def _capture(self, fn, pool) -> torch.cuda.CUDAGraph:
        return capture_graph(fn, pool=pool, error_mode=self.error_mode)  # a failed capture leaves the stream as it was


def run_empty_buckets(*, launches: ForwardLaunches, sweeper: Sweeper, static: StaticBatch, counters,
                      head_with_sweep=None, rounds: int = 1, eager_sizes: bool = False) -> list[tuple[int, int, str]]:
    """Run HEAD (``head_with_sweep(rows, tokens)`` when given) and TAIL of every bucket ``rounds`` times on an empty
    batch (all padding: nothing planned, written or verified), so every kernel they launch is compiled; the launch
    counters and sweep cursors they moved are restored. ``eager_sizes``: also the spans of eager decode-sized
    batches (powers of two up to 256 tokens: the single-CTA write kernel's variants). Returns the buckets
    ``(rows, tokens, buffer set)``, smallest first. Leaves the static buffers cleared."""
    static.clear()
    shapes = [(static.max_rows, static.max_tokens, "full")]
    if "small" in static.sets:
        shapes.insert(0, (static.max_rows, static.small_tokens, "small"))
    spans = [(min(static.max_rows, t), t, shapes[0][2]) for t in (1, 32, 64, 128, 256) if t <= shapes[0][1]]
    saved = [t.clone() for t in [counters.table, *sweeper.cursor_state()]]
    for _ in range(rounds):
        for rows, tokens, buffers in shapes + (spans if eager_sizes else []):
            static.activate(buffers)
            if head_with_sweep is not None:
                head_with_sweep(rows, tokens)
            else:
                launches.head(limit=(rows, tokens))
            launches.tail(run_checks=True)
    for t, v in zip([counters.table, *sweeper.cursor_state()], saved):
        t.copy_(v)
    return shapes


class _SweepBranch:
    """The sweep slice on a second stream, forked from and joined to the current one (captured as a parallel
    branch of the graph): `fork` enqueues the slice plans, then its checks; `wait_plans` makes the current
    stream wait for the plans only; `join` for the whole branch."""

    def __init__(self, sweeper: Sweeper) -> None:
        self.sweeper = sweeper
        self.stream = torch.cuda.Stream()
        self.planned = torch.cuda.Event()

    def fork(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.sweeper.slice_plans()
            self.planned.record(self.stream)
            self.sweeper.slice_checks()

    def wait_plans(self) -> None:
        torch.cuda.current_stream().wait_event(self.planned)

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


def require_cuda(device: torch.device) -> None:
    """``kv-canary:`` ValueError unless the canary lives on a CUDA device (graphs are CUDA only)."""
    if device.type != "cuda":
        raise KvCanaryValueError(f"kv-canary: CUDA graphs need a CUDA canary, this one is on {device}")


def capture_sweep_slice(sweeper: Sweeper, device: torch.device) -> torch.cuda.CUDAGraph:
    """The rotating sweep slice alone in one CUDA graph (cursor, live set and plans are static device buffers).
    No warm-up: a warm-up would verify a real slice a second time. So at least one eager slice must have run
    (the kernels are compiled) — else ``kv-canary:`` RuntimeError; ``device`` must be CUDA (`require_cuda`)."""
    if sweeper.slices_run < 1:
        raise KvCanaryRuntimeError("kv-canary: capture the sweep slice after one eager slice (its kernels compile there)")
    require_cuda(device)
    # thread-local: an engine serving from a background thread (transformers' generate_batch) may make CUDA calls
    # on another thread meanwhile, which a global-mode capture would turn into errors there
    return capture_graph(sweeper.slice_device, error_mode="thread_local")
