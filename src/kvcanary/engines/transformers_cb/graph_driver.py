"""`GraphDriver`: the transformers adapter in graph mode (``use_cuda_graph=True``), where a replay runs no Python.

The handle's module hooks see eager forwards and the one forward of each capture; this driver shadows
``ModelRunner.compute_batch`` so the host half of a step runs around every replay (`wrap_compute_batch`), counts a
suspended cache's replays (`count_wrapper`), guards each new processor's first ``compute_batch`` (`wrap_init_cb`:
the graph-mode wrapper only exists from the first forward on), and repairs a CUDA-graph capture of the engine's that
failed with the canary inside (`_recover_capture`: `kvcanary.runtime.capture.recover_failed_capture`, then the
session is suspended and, in ``log`` mode, the forward runs again without the canary). It keeps no state of its
own: everything lives on the handle (``self.h``), which owns the sessions and the counts.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Optional

import torch

from kvcanary.engines.transformers_cb import compat
from kvcanary.engines.transformers_cb.session import CAUSE_INTERNAL, IDLE, WRAPPED_STEP, _Session
from kvcanary.runtime.capture import recover_failed_capture

if TYPE_CHECKING:
    from kvcanary.engines.transformers_cb.attach import TransformersCbHandle

logger = logging.getLogger("kvcanary")


class GraphDriver:
    """Graph-mode wrappers of one `TransformersCbHandle` (see the module docstring)."""

    def __init__(self, handle: "TransformersCbHandle") -> None:
        self.h = handle

    def wrap_init_cb(self, original):
        """``model.init_continuous_batching`` (``generate_batch`` calls it too): shadow the new manager's
        ``_create_batch_processor``, so each new processor gets `_capture_guard` before its first ``compute_batch``
        (the graph-mode wrapper only exists from the first forward on, inside that first call)."""
        def init_continuous_batching(*args, **kwargs):
            manager = original(*args, **kwargs)
            if not self.h._detached and compat.MANAGER_CREATE_PROCESSOR_METHOD not in vars(manager):
                compat.shadow_method(manager, compat.MANAGER_CREATE_PROCESSOR_METHOD, self._wrap_create_processor)
            return manager

        return init_continuous_batching

    def _wrap_create_processor(self, original):
        def create_batch_processor(*args, **kwargs):
            processor = original(*args, **kwargs)
            try:
                if not self.h._detached and torch.cuda.is_available() and self.h._graph_mode(processor):
                    compat.install_compute_guard(processor, lambda compute: self._capture_guard(processor, compute))
            except Exception as exc:  # noqa: BLE001 — without the guard only a failed first capture goes unrepaired
                logger.debug("kv-canary: could not guard the first compute_batch: %s", exc)
            return processor

        return create_batch_processor

    def _capture_guard(self, processor, original):
        """Until the graph-mode wrapper replaces it: a failed capture with the canary inside is repaired
        (`_recover_capture`) and, in ``log`` mode, the step runs again without the canary."""
        def compute_batch(model, batch_data):
            entry, hooks_before = torch.cuda.current_stream(), self.h._capture_hooks
            try:
                return original(model, batch_data)
            except Exception as exc:
                if self.h._detached or self.h._capture_hooks == hooks_before:
                    raise  # the canary was not inside a capture: not ours to repair
                s = self.h._current if self.h._current is not None and self.h._current.processor is processor else None
                if not self._recover_capture(s, processor, entry, exc):
                    raise
            return original(model, batch_data)  # suspended: the engine captures again, without the canary

        return compute_batch

    def wrap_compute_batch(self, s: _Session, original):
        """The graph-mode driver around ``ModelRunner.compute_batch`` (see the module docstring)."""
        stream = compat.compute_stream(s.processor)

        def compute_batch(model, batch_data):
            self.h._engine_forwards += 1
            self.h._in_compute = True
            try:
                return run(model, batch_data)
            finally:
                self.h._in_compute = False
                if s.failed_in_capture is not None and self.h._current is s:
                    self._suspend_after_capture(s)

        def run(model, batch_data):
            if self.h._current is not s:  # a stale session (detached or superseded): pass through
                return original(model, batch_data)
            on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            entry = torch.cuda.current_stream() if stream is not None else None
            hooks_before = self.h._capture_hooks
            try:
                with on_stream:
                    self.h._end_deferred(s)
                    self.h._begin(s, WRAPPED_STEP)
                if stream is not None:  # the engine staged its inputs on the caller's stream
                    stream.wait_stream(torch.cuda.current_stream())
            except Exception as exc:
                s.phase = IDLE
                self.h._canary_failed(s, s.cache, exc)  # log mode: suspended, the forward runs unchecked
                return original(model, batch_data)
            try:
                result = original(model, batch_data)
            except BaseException as exc:
                if entry is not None and self.h._capture_hooks > hooks_before and isinstance(exc, Exception):
                    if self._recover_capture(s, s.processor, entry, exc):
                        return original(model, batch_data)  # suspended: the engine captures again, without the canary
                    raise
                with on_stream:
                    self.h._abandon(s)
                raise
            try:
                with on_stream:
                    phase, s.phase = s.phase, IDLE
                    if phase == WRAPPED_STEP and s.failed_in_capture is None:
                        s.canary.end_step()
                        if s.sweep_graph_due and s.canary.sweeper.slices_run:
                            self.h._capture_sweep(s)
            except Exception as exc:
                self.h._canary_failed(s, s.cache, exc, forward_counted=True)
            return result

        return compute_batch

    def _recover_capture(self, s: Optional[_Session], processor, entry, exc: Exception) -> bool:
        """The engine's CUDA-graph capture failed with the canary's work inside it (whichever side caused it): repair
        the process (`recover_failed_capture`: the thread's stream, the allocator's pool routing, the generator;
        the engine's runner then captures into a fresh pool),
        suspend the session and drop its graphs. Returns True in ``log`` mode: run the forward again, unchecked (a
        failed capture ran nothing, so the engine captures that graph again, without the canary)."""
        fixed = recover_failed_capture(entry, pool=compat.graph_pool(processor) if processor is not None else None)
        if processor is not None and compat.renew_graph_pool(processor):
            fixed.append("a fresh graph pool for the engine")  # the failed capture's pool cannot be captured into
        if s is not None:
            s.head_open = False
            s.phase = IDLE
            if s.failed_in_capture is None:
                s.failed_in_capture = (CAUSE_INTERNAL, f"the engine's CUDA graph capture failed with the canary "
                                                       f"inside ({type(exc).__name__}: {exc})")
                self.h._canary_errors += 1
        logger.error("kv-canary: the engine's CUDA graph capture failed with the canary inside (%s: %s); repaired %s; "
                     "%s", type(exc).__name__, str(exc)[:200], ", ".join(fixed) or "nothing",
                     "raise mode: the step fails" if self.h.config.mode == "raise" else
                     "log mode: the rest of this engine session runs unchecked and the forward runs again without "
                     "the canary")
        if s is not None and self.h._current is s:
            self._suspend_after_capture(s)
        return self.h.config.mode != "raise"

    def _suspend_after_capture(self, s: _Session) -> None:
        """A canary failure inside the engine's capture (log mode), now that the capture has ended: the graph it
        made holds part of the canary's work, so every graph of the session is dropped (the engine recaptures,
        without the canary) and the session is suspended."""
        cause, reason = s.failed_in_capture
        s.phase = IDLE
        try:
            self.h._suspend(s, s.cache, cause, reason=reason)
        finally:
            s.graphs_dropped += compat.drop_graphs(s.processor, list(compat.graph_store(s.processor)))
        self.h._count_unchecked(cause)

    def count_wrapper(self, cache, original):
        def compute_batch(model, batch_data):
            self.h._engine_forwards += 1
            sus = self.h._suspended
            if sus is not None and sus.cache is cache:
                self.h._count_unchecked(sus.cause)
            self.h._in_compute = True
            try:
                return original(model, batch_data)
            finally:
                self.h._in_compute = False

        return compute_batch
