"""Timing jitter (*extension*, docs/design.md §3.11): seeded stalls inside the verify and write kernels.

A race between the engine's KV writes and reads (a copy on a side stream without an event, a block freed while
the step before still reads it) strikes only in one interleaving of the GPU's work. Stalling some of the canary's
own programs for a few thousand cycles shifts that interleaving, so a rare race shows up more often. A launch
handed a `KernelJitter` decides, for each of its *jitter entries*, whether the entry stalls and for how long:

* verify: the active entries whose slot is not the padding slot 0 (the entries it checks, out-of-range ones too);
* write: the flat entries ``i`` in ``[write_offsets[0], write_offsets[a])`` (``a`` and the work gate as in
  docs/design.md §3.6) whose slot lies in ``[0, num_slots)`` (for a well-formed plan, the entries it stores).

The decision is a counter-based hash, identical on every device and implementation (``jitter_draws``)::

    key    = mix3(seed, launch_key, kernel_kind)        # launch_key: e.g. the runtime's step, read on the device
    h      = splitmix64(key ^ slot)
    fire   = (h & 0xFFFF) < fire_threshold              # fire_threshold = round(fire_prob * 65536), in [0, 65536]
    cycles = 1 + (((h >>> 32) * max_cycles) >> 32)      # in [1, max_cycles]

A firing entry adds 1 to ``counters[0]`` (stalls) and ``cycles`` to ``counters[1]`` (cycles drawn). On CUDA the
Triton program holding the entry then spins on the SM clock (``%clock64``) for the largest draw among its
firing entries (its lanes stall together; a two-context launch stalls once per context), before it reads the
records and the KV. The spin is the only part that is not computed everywhere: the torch twins and the Triton
interpreter count exactly the same stalls and cycles; the interpreter and the twins on CUDA tensors do not wait,
while the twins on CPU tensors stall the calling host thread before they read, for the launch's longest fired draw
at 1 ns per cycle (`kvcanary.ops.reference.jitter.host_stall`). Nothing else a launch does depends on the
jitter: buffers, rings, indices and the launch counters are byte-identical with or without it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.hashing import to_signed64

JITTER_FIRE_SCALE = 1 << 16
"""Fire probabilities are quantised to multiples of 1 / 65536 (a draw's low 16 bits)."""
JITTER_MAX_CYCLES_LIMIT = (1 << 31) - 1
"""Largest stall length: keeps ``(h >>> 32) * max_cycles`` inside int64."""
PARAM_SEED, PARAM_FIRE_THRESHOLD, PARAM_MAX_CYCLES = 0, 1, 2
JITTER_PARAMS = 3
COUNTER_STALLS, COUNTER_CYCLES = 0, 1


def fire_threshold_of(fire_prob: float) -> int:
    """``round(fire_prob * 65536)``: the threshold the low 16 bits of a draw are compared with."""
    if isinstance(fire_prob, bool) or not isinstance(fire_prob, (int, float)) or not math.isfinite(fire_prob) \
            or not 0.0 <= fire_prob <= 1.0:
        raise KvCanaryValueError(f"kv-canary: jitter fire_prob must be a number in [0, 1], got {fire_prob!r}")
    return int(round(float(fire_prob) * JITTER_FIRE_SCALE))


@dataclass(frozen=True, kw_only=True)
class KernelJitter:
    """What a verify or write launch needs to stall its entries (module docstring). All int64 tensors on the
    launch's device, read (``params``, ``launch_key``) or bumped in place (``counters``) by the kernels, so a launch
    captured in a CUDA graph draws anew at every replay from the current ``launch_key``.

    params: ``[seed, fire_threshold, max_cycles]`` (int64 [3]; build it with `create`).
    launch_key: int64 [1], mixed into every draw (the runtime passes its device step number).
    counters: int64 [2], ``[stalls, cycles drawn]`` (may be a view of a larger table).
    """

    params: torch.Tensor
    launch_key: torch.Tensor
    counters: torch.Tensor

    def __post_init__(self) -> None:
        for name, numel in (("params", JITTER_PARAMS), ("launch_key", 1), ("counters", 2)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise KvCanaryTypeError(f"kv-canary: KernelJitter.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int64 or t.dim() != 1 or t.numel() != numel or not t.is_contiguous():
                raise KvCanaryValueError(f"kv-canary: KernelJitter.{name} must be contiguous int64 [{numel}], got "
                                         f"{t.dtype} shape {tuple(t.shape)}")
        if len({self.params.device, self.launch_key.device, self.counters.device}) != 1:
            raise KvCanaryValueError("kv-canary: KernelJitter tensors must share one device, got "
                                     f"{self.params.device}, {self.launch_key.device}, {self.counters.device}")

    @classmethod
    def create(cls, *, fire_prob: float, max_cycles: int, seed: int, launch_key: torch.Tensor,
               counters: torch.Tensor) -> "KernelJitter":
        """A jitter drawing with probability ``fire_prob`` (quantised, `fire_threshold_of`) stalls of 1 to
        ``max_cycles`` cycles from ``seed`` (any int; its 64-bit pattern is used); ``params`` is allocated on
        ``launch_key``'s device (do it before any graph capture)."""
        threshold = fire_threshold_of(fire_prob)
        if isinstance(max_cycles, bool) or not isinstance(max_cycles, int) or not 1 <= max_cycles <= JITTER_MAX_CYCLES_LIMIT:
            raise KvCanaryValueError(
                f"kv-canary: jitter max_cycles must be an integer in [1, {JITTER_MAX_CYCLES_LIMIT}], got {max_cycles!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise KvCanaryValueError(f"kv-canary: jitter seed must be an integer, got {seed!r}")
        params = torch.tensor([to_signed64(seed), threshold, max_cycles], dtype=torch.int64)
        return cls(params=params.to(launch_key.device), launch_key=launch_key, counters=counters)

    @property
    def device(self) -> torch.device:
        return self.params.device


def check_jitter(op: str, jitter: object, dev: torch.device) -> None:
    """A launcher's check of its ``jitter`` argument: None or a `KernelJitter` on ``dev``."""
    if jitter is None:
        return
    if not isinstance(jitter, KernelJitter):
        raise KvCanaryTypeError(f"kv-canary: {op} jitter must be a KernelJitter or None, got {type(jitter).__name__}")
    if jitter.device != dev:
        raise KvCanaryValueError(f"kv-canary: {op} jitter is on {jitter.device}, expected {dev} (all tensors on one device)")
