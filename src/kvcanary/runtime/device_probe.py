"""Prove the canary's device path before the first forward: `prove_device_path`.

On CUDA every launch of the canary runs a Triton kernel, and the per-forward work is captured in CUDA graphs
(the canary's own, or the engine's with the canary inside). Without a working Triton the launchers fall back to
the torch twins, which read device values on the host: fine eagerly, fatal inside a capture (the capture is
invalidated, and with it the engine's graph). So before the first forward the canary proves, once per process
and device, that the path it will use works:

1. Triton imports (``triton_missing`` otherwise);
2. a tiny Triton kernel compiles and runs with the right result — its first launch also builds Triton's C
   launcher with the system C compiler (``triton_compile``, ``kernel_result``);
3. the same kernel is captured in a CUDA graph and replayed with the right result (``graph_capture``).

A failed step is refused with a `DevicePathError` naming the cause and the remedy, unless the user opted in to
the eager fallback (``allow_eager_fallback=True`` / ``KVCANARY_ALLOW_EAGER_FALLBACK=1``): then every launch of
this process runs the torch twins eagerly (`kvcanary.ops.dispatch.disable_triton`), the canary never captures
its work, an engine that captures its forwards is refused, and a WARNING says so once. A CPU canary runs the
twins by design and probes nothing. The probe runs on a side stream of its own, uses no random numbers and
leaves the calling thread's stream as it found it.

The verdicts are kept by a `DeviceProber`; `prove_device_path` asks the process's, or the one `use_prober`
installed for a block (another probe, verdicts of its own).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch

from kvcanary.errors import KvCanaryRuntimeError
from kvcanary.ops import dispatch
from kvcanary.runtime.capture import capture_graph

try:  # Triton is optional: CPU-only installs use the twins.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the environment
    _PROBE_KERNEL = None
else:
    @triton.jit
    def _probe_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        keep = i < n
        x = tl.load(x_ptr + i, mask=keep, other=0)
        tl.store(out_ptr + i, x * 3 + 1, mask=keep)

    _PROBE_KERNEL = _probe_kernel

logger = logging.getLogger("kvcanary")

PATH_KERNELS = "kernels"  # CUDA: Triton kernels, capturable
PATH_TWINS = "twins"  # CPU: the torch twins are the implementation
PATH_EAGER_FALLBACK = "eager_fallback"  # CUDA without a working Triton, opted in: twins, eager only

CAUSE_TRITON_MISSING = "triton_missing"
CAUSE_TRITON_COMPILE = "triton_compile"
CAUSE_KERNEL_RESULT = "kernel_result"
CAUSE_GRAPH_CAPTURE = "graph_capture"

_N = 64

_REMEDIES = {
    CAUSE_TRITON_MISSING: (
        "Triton does not import, so every launch would run the torch twins, which cannot be captured in CUDA "
        "graphs. Install the Triton that matches your torch (pip install triton; torch wheels for CUDA pin one)"),
    CAUSE_TRITON_COMPILE: (
        "Triton cannot compile or launch a kernel here. Its first launch builds a small C launcher with the "
        "system C compiler: install one (e.g. apt-get install gcc) or point CC at one, and make sure "
        "TRITON_CACHE_DIR (default ~/.triton) is writable"),
    CAUSE_KERNEL_RESULT: (
        "a Triton kernel ran but returned a wrong result: the Triton build does not match this GPU or driver. "
        "Reinstall the Triton that matches your torch and driver"),
    CAUSE_GRAPH_CAPTURE: (
        "a Triton kernel cannot be captured in a CUDA graph and replayed on this device. Run the engine without "
        "CUDA graphs, and attach with capture_canary=False where the adapter has it"),
}
_FALLBACK_HINT = ("or opt in to the slow eager fallback (allow_eager_fallback=True or KVCANARY_ALLOW_EAGER_FALLBACK=1: "
                  "the torch twins, eagerly, with every CUDA graph of the canary off; an engine that captures its "
                  "own CUDA graphs is still refused)")


class DevicePathError(KvCanaryRuntimeError):
    """The canary's device path does not work on this machine; ``cause`` is one of the ``CAUSE_*`` names."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True, kw_only=True)
class DevicePath:
    """What serves the canary's launches on ``device``. ``path``: ``kernels`` (Triton on CUDA), ``twins`` (CPU) or
    ``eager_fallback`` (CUDA without a working Triton, opted in); ``graphs``: the canary's work may be captured in
    CUDA graphs; ``cause`` / ``detail``: why the probe failed (``eager_fallback`` only)."""

    device: str
    path: str
    graphs: bool
    cause: Optional[str] = None
    detail: Optional[str] = None

    @property
    def degraded(self) -> bool:
        return self.path == PATH_EAGER_FALLBACK

    def refusal(self, what: str) -> str:
        """The ``kv-canary:`` message refusing ``what`` (something that needs CUDA graphs) on this path."""
        return (f"kv-canary: {what} needs CUDA graphs, but the canary runs the eager fallback on {self.device} "
                f"({self.cause}: {self.detail}); the torch twins read device values on the host and cannot be "
                f"captured. Fix Triton ({_REMEDIES.get(self.cause, '')}) or turn the engine's CUDA graphs off")


Verdict = Optional[tuple[str, str]]  # a probe's result: None (the path works) or (cause, detail)


class DeviceProber:
    """Proves each device's path once and keeps what it proved: the probe verdicts and the one WARNING per device
    of the eager fallback. ``probe``: what a CUDA device is checked with (default `probe_device`)."""

    def __init__(self, probe: Optional[Callable[[torch.device], Verdict]] = None) -> None:
        self._probe = probe
        self._verdicts: dict[str, Verdict] = {}
        self._warned: set[str] = set()

    def prove(self, device: Union[str, torch.device], *, allow_eager_fallback: bool = False) -> DevicePath:
        """The `DevicePath` of ``device``, proved by the probe on CUDA (once per device). Raises `DevicePathError`
        when the probe fails and ``allow_eager_fallback`` is False; with it, turns Triton off for this process and
        says so once at WARNING."""
        dev = torch.device(device)
        if dev.type != "cuda":
            return DevicePath(device=str(dev), path=PATH_TWINS, graphs=False)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        key = str(dev)
        if key not in self._verdicts:
            self._verdicts[key] = (self._probe or probe_device)(dev)
        failure = self._verdicts[key]
        if failure is None and dispatch.triton_disabled() is None:
            return DevicePath(device=key, path=PATH_KERNELS, graphs=True)
        cause, detail = failure if failure is not None else (CAUSE_TRITON_COMPILE, dispatch.triton_disabled() or "")
        if not allow_eager_fallback:
            raise DevicePathError(
                f"kv-canary: the canary cannot use Triton on {key} ({cause}: {detail}): {_REMEDIES[cause]}; "
                f"{_FALLBACK_HINT}", cause=cause)
        dispatch.disable_triton(f"{cause}: {detail}")
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("kv-canary: eager fallback on %s (%s: %s): every canary launch runs the torch twins eagerly "
                           "(slower, a host sync per launch), the canary's CUDA graphs are off, and an engine that "
                           "captures CUDA graphs is refused. Remedy: %s", key, cause, detail, _REMEDIES[cause])
        return DevicePath(device=key, path=PATH_EAGER_FALLBACK, graphs=False, cause=cause, detail=detail)


_prober = DeviceProber()  # the one `prove_device_path` asks (`use_prober`); by default the process's


def prove_device_path(device: Union[str, torch.device], *, allow_eager_fallback: bool = False) -> DevicePath:
    """`DeviceProber.prove` of the prober in use: the process's (each CUDA device probed once per process), or the
    one `use_prober` installed. Every canary and engine adapter proves its device here."""
    return _prober.prove(device, allow_eager_fallback=allow_eager_fallback)


@contextlib.contextmanager
def use_prober(prober: DeviceProber) -> Iterator[DeviceProber]:
    """Inside the block `prove_device_path` asks ``prober`` (its own verdicts, its own probe); the prober before it
    is restored on exit. Not thread-safe: install it before the engine's threads start."""
    global _prober
    before = _prober
    _prober = prober
    try:
        yield prober
    finally:
        _prober = before


def probe_device(device: torch.device, *, launch: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None
                 ) -> Verdict:
    """Run the three steps of the module docstring on CUDA ``device``: None when they pass, else ``(cause,
    detail)`` of the first that failed. ``launch(x, out)``: writes ``x * 3 + 1`` into ``out`` on the current
    stream (default: the Triton probe kernel)."""
    launch = launch or _launch
    missing = _triton_missing()
    if missing is not None:
        return CAUSE_TRITON_MISSING, missing
    before = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(before)
    try:
        with torch.cuda.device(device), torch.cuda.stream(side):
            x = torch.arange(_N, dtype=torch.int64, device=device)
            out = torch.zeros_like(x)
            want = x * 3 + 1
            try:
                launch(x, out)
                ok = bool(torch.equal(out, want))
            except Exception as exc:  # noqa: BLE001 — every way a launch fails is the same verdict
                return CAUSE_TRITON_COMPILE, _describe(exc)
            if not ok:
                return CAUSE_KERNEL_RESULT, f"the probe kernel returned {out[:4].tolist()}..., expected {want[:4].tolist()}..."
            out.zero_()
            try:
                graph = capture_graph(lambda: launch(x, out), error_mode="thread_local")
                graph.replay()
                side.synchronize()
                ok = bool(torch.equal(out, want))
                graph.reset()
            except Exception as exc:  # noqa: BLE001
                return CAUSE_GRAPH_CAPTURE, _describe(exc)
            if not ok:
                return CAUSE_GRAPH_CAPTURE, "the probe kernel's graph replay returned a wrong result"
            return None
    finally:
        before.wait_stream(side)
        if torch.cuda.current_stream(device) != before:
            torch.cuda.set_stream(before)


def _triton_missing() -> Optional[str]:
    """Why the canary's Triton modules cannot serve launches, or None."""
    from kvcanary.ops import triton as triton_ops
    from kvcanary.runtime import deep_store, kernels

    if _PROBE_KERNEL is None or not getattr(triton_ops, "AVAILABLE", False):
        return "import triton failed"
    if not kernels.AVAILABLE or not deep_store.AVAILABLE:
        return "the runtime's Triton kernels did not import"
    return None


def _launch(x: torch.Tensor, out: torch.Tensor) -> None:
    _PROBE_KERNEL[(1,)](x, out, _N, BLOCK=_N)


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
