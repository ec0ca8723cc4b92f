"""Host-cheap CUDA queries for the per-forward path.

``torch.cuda.is_available()`` reads the environment on every call and ``torch.cuda.current_stream()`` builds
a new Python ``Stream`` object each time (each a few µs on the H200's host, measured in docs/lab/NOTES.md run 39);
the per-forward path asks these several times per step.
"""
from __future__ import annotations

import functools

import torch

_STREAMS_KEPT = 64  # distinct (stream id, device, type) keys remembered; past that the memo starts over


@functools.cache
def cuda_present() -> bool:
    """``torch.cuda.is_available()``, asked once per process."""
    return torch.cuda.is_available()


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return cuda_present() and torch.cuda.is_current_stream_capturing()


_streams: dict[tuple, torch.cuda.Stream] = {}


def current_stream() -> torch.cuda.Stream:
    """The current CUDA stream of the current device (as ``torch.cuda.current_stream()``), one ``Stream``
    object per distinct stream: for ``Event.record(stream)`` on the per-forward path."""
    try:
        key = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
    except AttributeError:  # a torch without these private bindings: the public call
        return torch.cuda.current_stream()
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= _STREAMS_KEPT:
            _streams.clear()
        stream = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream
