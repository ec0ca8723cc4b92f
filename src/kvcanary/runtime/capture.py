"""`capture_graph`: capture a CUDA graph and leave the thread as it found it when the capture fails.

``torch.cuda.graph`` ends the capture before it restores the stream it switched to: when ending the capture
fails (an operation the capture forbids ran inside it, e.g. a host read of a device value), the calling thread
stays on the capture stream, and torch's CUDA generator stays marked as capturing, so the engine's next random
draw outside a graph fails (``Offset increment outside graph capture encountered unexpectedly``). This wrapper
restores the stream in a ``finally`` and, after a failed capture, ends the generator's capture state with one
tiny capture that succeeds.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

logger = logging.getLogger("kvcanary")


def capture_graph(fn: Callable[[], None], *, pool=None, error_mode: str = "global",
                  stream: Optional[torch.cuda.Stream] = None) -> torch.cuda.CUDAGraph:
    """``fn`` captured into a new ``CUDAGraph`` (``pool``, ``error_mode`` and ``stream`` as ``torch.cuda.graph``'s
    ``pool``, ``capture_error_mode`` and ``stream``). On any failure the thread's current stream is the one it
    had before, the generator's capture state is reset (`reset_generator_capture`), and the error propagates."""
    before = torch.cuda.current_stream()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode, stream=stream):
            fn()
    except BaseException:
        torch.cuda.set_stream(before)
        reset_generator_capture()
        raise
    finally:
        if torch.cuda.current_stream() != before:
            torch.cuda.set_stream(before)
    return graph


def reset_generator_capture() -> bool:
    """After a failed capture: run one tiny capture that succeeds, so the CUDA generator of the current device
    leaves capture mode (its capture end is skipped when a capture fails). Best effort: False if it failed."""
    before = torch.cuda.current_stream()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(before)
        scratch = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            scratch.add_(1)
        before.wait_stream(side)
        graph.reset()
        return True
    except Exception as exc:  # noqa: BLE001 — the caller is already handling a failure; do not mask it
        logger.debug("kv-canary: resetting the generator's capture state failed: %s", exc)
        return False
    finally:
        if torch.cuda.current_stream() != before:
            torch.cuda.set_stream(before)
