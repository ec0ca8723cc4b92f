"""`capture_graph`: capture a CUDA graph and leave the process able to serve when the capture fails;
`recover_failed_capture`: the same repair after someone else's capture (the engine's, with the canary inside) failed.

When ending a capture fails (an operation the capture forbids ran inside it, e.g. a host read of a device value),
``torch.cuda.graph`` raises from ``capture_end`` and skips everything after it, which leaves three things behind:

- the calling thread on the capture stream (the stream context is never exited);
- the caching allocator still routing the capture stream's allocations to the graph's memory pool: its next
  ``empty_cache`` (transformers calls one when a ``generate_batch`` ends) fails an internal assert
  (``captures_underway.empty()``) and the process aborts;
- with torch <= 2.12, the CUDA generator marked as capturing (one flag per generator state): the next random draw
  outside a graph fails (``Offset increment outside graph capture encountered unexpectedly``) — transformers'
  warmup draws its fake requests' tokens, so every request of the batch then fails.

`recover_failed_capture` undoes all three (best effort: each step that does not apply is skipped). A fourth thing
it cannot undo: torch 2.11's capture begin also routes the pinned host allocator to the pool, that routing is ended
only by a successful capture end, and torch offers no Python call to end it. So a failed capture's pool id can never
be captured into again ("beginAllocateToPool: already recording to mempool_id"): later captures need a fresh pool
(`capture_graph` makes one per graph; the transformers adapter gives the engine's runner a new one). Checked on an
H100 with torch 2.11 by ``tests/gpu/test_failed_capture_gpu.py`` (diagnostic: ``bench/diag/capture_recovery_gpu.py``).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

logger = logging.getLogger("kvcanary")


def capture_graph(fn: Callable[[], None], *, pool=None, error_mode: str = "global",
                  stream: Optional[torch.cuda.Stream] = None) -> torch.cuda.CUDAGraph:
    """``fn`` captured into a new ``CUDAGraph`` (``pool``, ``error_mode`` and ``stream`` as ``torch.cuda.graph``'s
    ``pool``, ``capture_error_mode`` and ``stream``; without ``pool`` the graph gets a private one). On any failure
    the process is repaired (`recover_failed_capture`) and the error propagates."""
    before = torch.cuda.current_stream()
    if pool is None:
        pool = torch.cuda.graph_pool_handle()  # known here, so a failed capture's pool routing can be ended
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode, stream=stream):
            fn()
    except BaseException:
        recover_failed_capture(before, pool=pool)
        raise
    finally:
        if torch.cuda.current_stream() != before:
            torch.cuda.set_stream(before)
    return graph


def recover_failed_capture(stream: torch.cuda.Stream, *, pool=None) -> list[str]:
    """After a capture that failed: the thread back on ``stream``, the allocator's routing to ``pool`` (the failed
    capture's memory pool id, when known) ended, the CUDA generator out of capture mode. Returns the steps that
    applied (``stream``, ``pool``, ``generator``); never raises."""
    done = []
    try:
        if torch.cuda.current_stream() != stream:
            torch.cuda.set_stream(stream)
            done.append("stream")
    except Exception as exc:  # noqa: BLE001 — best effort: the caller is already handling a failure
        logger.debug("kv-canary: restoring the stream after a failed capture failed: %s", exc)
    if pool is not None:
        try:
            torch._C._cuda_endAllocateToPool(stream.device_index, tuple(pool))
            done.append("pool")
        except Exception as exc:  # noqa: BLE001 — not routing to that pool (the capture ended it): nothing to do
            logger.debug("kv-canary: no allocator routing to end after the failed capture: %s", exc)
    if reset_generator_capture():
        done.append("generator")
    return done


def reset_generator_capture() -> bool:
    """Take the CUDA generator of the current device out of capture mode (a failed capture skips its capture end).
    First one tiny capture that succeeds (its end clears the mode); if the generator still refuses a draw
    (`generator_draws`), its state object is replaced by a copy of itself — same seed and offset, not capturing
    (``graphsafe_set_state(clone_state())``). Best effort, never raises: False if it still refuses."""
    _tiny_capture()
    if generator_draws():
        return True
    try:
        gen = torch.cuda.default_generators[torch.cuda.current_device()]
        gen.graphsafe_set_state(gen.clone_state())
    except Exception as exc:  # noqa: BLE001 — the caller is already handling a failure; do not mask it
        logger.debug("kv-canary: replacing the generator's state after a failed capture failed: %s", exc)
    return generator_draws()


def generator_draws() -> bool:
    """Whether the current device's CUDA generator serves a draw outside a capture; its offset is left as it was
    (the draw is undone), so the random stream the engine sees does not move."""
    before = torch.cuda.current_stream()
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    try:
        offset = gen.get_offset()
    except Exception:  # noqa: BLE001
        return False
    try:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.empty(1, device=torch.device("cuda", torch.cuda.current_device())).uniform_()
        before.wait_stream(side)
        return True
    except Exception:  # noqa: BLE001 — "Offset increment outside graph capture encountered unexpectedly"
        return False
    finally:
        try:
            gen.set_offset(offset)
        except Exception as exc:  # noqa: BLE001
            logger.debug("kv-canary: restoring the generator's offset failed: %s", exc)
        if torch.cuda.current_stream() != before:
            torch.cuda.set_stream(before)


def _tiny_capture() -> bool:
    """One tiny capture that succeeds on a side stream (into a pool of its own). False if it failed."""
    before = torch.cuda.current_stream()
    pool = torch.cuda.graph_pool_handle()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(before)
        scratch = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            scratch.add_(1)
        before.wait_stream(side)
        graph.reset()
        return True
    except Exception as exc:  # noqa: BLE001 — the caller is already handling a failure; do not mask it
        logger.debug("kv-canary: resetting the generator's capture state failed: %s", exc)
        try:
            torch._C._cuda_endAllocateToPool(before.device_index, tuple(pool))
        except Exception:  # noqa: BLE001
            pass
        return False
    finally:
        if torch.cuda.current_stream() != before:
            torch.cuda.set_stream(before)
