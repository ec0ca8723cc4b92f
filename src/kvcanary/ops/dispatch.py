"""Choose the implementation for a launch: Triton on CUDA tensors when Triton imports (and has not been turned off
for this process, `disable_triton`), else the twin."""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch


_disabled: Optional[str] = None  # why Triton was turned off for this process (None: not turned off)


def disable_triton(reason: str) -> None:
    """Route every later launch of this process to the torch twins (a CUDA machine whose Triton cannot run,
    where the user opted in to the eager fallback). ``reason`` is kept for `triton_disabled`. Not undone."""
    global _disabled
    _disabled = reason


def triton_disabled() -> Optional[str]:
    """Why Triton was turned off for this process, or None."""
    return _disabled


@functools.lru_cache(maxsize=None)
def _triton_ops() -> Optional[ModuleType]:
    try:
        from kvcanary.ops import triton as triton_ops
    except ImportError:
        return None
    return triton_ops if getattr(triton_ops, "AVAILABLE", False) else None


def triton_backend(device: torch.device) -> Optional[ModuleType]:
    """The Triton op module when ``device`` is CUDA and Triton is usable, else None."""
    if device.type != "cuda" or _disabled is not None:
        return None
    return _triton_ops()


def capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is being captured into a graph (never on CPU): host
    reads are then impossible and a launcher skips its host-side range checks."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
