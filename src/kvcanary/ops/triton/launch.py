"""Launch helpers shared by the Triton launchers: device facts, graph capture, programmatic dependent
launch (PDL), one compiled variant per context geometry (`jit_batch_sized`), and two contexts per launch
(`launch_in_pairs`, `two_context_args`).

PDL (Hopper and later): a kernel launched with ``launch_pdl=True`` may be scheduled while the
kernel before it in the stream is still running; it must not touch memory before
``pdl_wait`` returns (then everything the earlier kernels did is visible). Every kernel here
calls ``pdl_wait`` first thing, in every program, so "kernel k finished" still implies "every
kernel before k finished", and ``pdl_release`` right after, so the next launch can be scheduled
early. What PDL saves is the gap between dependent launches, not any work. Under the
interpreter (and before Hopper) both helpers compile to nothing.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, TypeVar

import torch
import triton
import triton.language as tl


def jit_batch_sized(*names: str, scalar_ptrs: tuple[str, ...] = ()):
    """``triton.jit`` that compiles one variant whatever the values of the integer arguments ``names`` and
    the alignment of the pointers ``scalar_ptrs``.

    Triton specialises every integer argument by default (== 1, divisible by 16, other), so an argument
    that follows the batch (sizes, plan capacities) or the launch (its tag) would compile a new variant,
    seconds each, the first time a forward brings a new class of values: mid-serving on a real engine (on
    the H200 the e2e bench's first round with the canary took 88.5 s in one process and 5.2 s in the next,
    once Triton's cache was warm: docs/lab/NOTES.md run 33). Only bounds and scalars go here; strides and
    geometry stay specialised (they are fixed per engine and feed address arithmetic). ``scalar_ptrs`` are one-element counters, write indices and flags:
    views into shared tensors, so their 16-byte alignment differs from context to context, and a scalar
    load or atomic gains nothing from it."""
    return triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=scalar_ptrs)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until every earlier kernel of the stream has finished (no-op unless PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel of the stream be scheduled now (no-op unless PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def pdl_enabled(device: torch.device, wanted: bool) -> bool:
    """True when ``wanted`` and the device can launch dependents programmatically (CUDA sm_90+)."""
    return bool(wanted) and device.type == "cuda" and _capability(_index(device))[0] >= 9


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (4 under the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(_index(device))


Context = TypeVar("Context")


def launch_in_pairs(
    contexts: Sequence[Context],
    *,
    sources: Callable[[Context], Optional[object]],
    pairable: Callable[[Context, Context], bool],
    launch: Callable[[tuple, tuple], None],
    alone: Callable[[Context], None],
) -> tuple[int, ...]:
    """Launch ``contexts`` in order: ``launch(contexts, their sources)`` for one or two at a time, two where
    ``pairable(first, second)``; a context whose ``sources(ctx)`` is None (the kernel cannot take it) runs
    ``alone(ctx)`` in its turn, after whatever was pending. Returns the number of contexts of each ``launch``, in
    order (the ``alone`` runs are not counted): how the contexts were grouped."""
    pending: list = []
    launched: list[int] = []

    def flush() -> None:
        if pending:
            launch(tuple(c for c, _ in pending), tuple(s for _, s in pending))
            launched.append(len(pending))
            pending.clear()

    for ctx in contexts:
        srcs = sources(ctx)
        if srcs is None:
            flush()
            alone(ctx)
            continue
        if pending and not pairable(pending[0][0], ctx):
            flush()
        pending.append((ctx, srcs))
        if len(pending) == 2:
            flush()
    flush()
    return tuple(launched)


def two_context_args(contexts: Sequence, sources: Sequence, context_args: Callable) -> tuple[tuple, dict]:
    """Runtime arguments and constexprs of a kernel's A and B context slots, ``context_args(ctx, srcs, prefix)``
    for each; with one context, B repeats A (the kernel leaves it unused when ``NCTX == 1``)."""
    a_args, consts = context_args(contexts[0], sources[0], "A")
    if len(contexts) == 2:
        b_args, b_consts = context_args(contexts[1], sources[1], "B")
    else:
        b_args, b_consts = a_args, {k.replace("A_", "B_", 1): v for k, v in consts.items()}
    return (*a_args, *b_args), {**consts, **b_consts}
