"""Launch helpers shared by the Triton launchers: device facts, graph capture, and programmatic
dependent launch (PDL).

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

import torch
import triton
import triton.language as tl


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


def capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is being captured into a graph (never on CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (4 under the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(_index(device))
