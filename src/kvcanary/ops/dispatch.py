"""Choose the implementation for a launch: Triton on CUDA tensors when Triton imports (and has not been turned off
for this process, `disable_triton`), else the twin. `selected_backend` overrides the choice inside a block:
``"torch"`` (the twins everywhere) or ``"triton"`` (the Triton launchers on any device — on the CPU under
``TRITON_INTERPRET=1``, set before Triton is imported: how the kernels' logic is tested without a GPU)."""
from __future__ import annotations

import contextlib
import functools
from types import ModuleType
from typing import Iterator, Optional

import torch

from kvcanary.errors import KvCanaryValueError

BACKENDS = ("torch", "triton")

_disabled: Optional[str] = None  # why Triton was turned off for this process (None: not turned off)
_selected: Optional[str] = None  # `selected_backend`'s choice (None: by device)


@contextlib.contextmanager
def selected_backend(name: Optional[str]) -> Iterator[None]:
    """Inside the block every launch of this process uses ``name`` (``"torch"``, ``"triton"``, or None: by device)
    and `disable_triton` starts afresh; both are restored on exit. Not thread-safe: select before the engine's
    threads start."""
    global _selected, _disabled
    if name is not None and name not in BACKENDS:
        raise KvCanaryValueError(f"kv-canary: unknown ops backend {name!r}; use one of {BACKENDS} or None")
    if name == "triton" and _triton_ops() is None:
        raise KvCanaryValueError("kv-canary: the 'triton' ops backend needs Triton (pip install triton)")
    before = (_selected, _disabled)
    _selected, _disabled = name, None
    try:
        yield
    finally:
        _selected, _disabled = before


def selected() -> Optional[str]:
    """The backend `selected_backend` forces now, or None (chosen by device)."""
    return _selected


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
    """The Triton op module when ``device`` is CUDA and Triton is usable (or `selected_backend` chose Triton),
    else None."""
    if _selected is not None:
        return _triton_ops() if _selected == "triton" else None
    if device.type != "cuda" or _disabled is not None:
        return None
    return _triton_ops()


def capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is being captured into a graph (never on CPU): host
    reads are then impossible and a launcher skips its host-side range checks."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
