"""Torch twin of the timing jitter's draws and counts (docs/design.md §3.11, `kvcanary.ops.jitter`).

The twins count exactly what the Triton kernels count. On CUDA tensors that is all they do (the stall is the
kernels' clock spin). On CPU tensors a launch with firing entries also stalls the calling host thread, before the
op reads any record or real-KV byte, for its longest fired draw at `HOST_NS_PER_CYCLE` (`host_stall`): other host
threads (an engine's copy or offload thread) run meanwhile, so on the CPU too the jitter shifts the interleaving.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from kvcanary.ops.hashing import splitmix64_mix3_tensor, splitmix64_xor_tensor
from kvcanary.ops.jitter import (
    COUNTER_CYCLES, COUNTER_STALLS, PARAM_FIRE_THRESHOLD, PARAM_MAX_CYCLES, PARAM_SEED, KernelJitter,
)

HOST_NS_PER_CYCLE = 1
"""Nominal rate of a host stall: one drawn cycle waits one nanosecond (a 1 GHz clock), so ``jitter_max_cycles=50000``
stalls a CPU launch for up to 50 µs. A GPU SM clock runs at about 1.1 to 2 GHz: the same draw spins there for
roughly half to the whole of that time."""
HOST_SLEEP_MIN_NS = 200_000
"""Stalls at least this long first sleep (``time.sleep``) for all but `HOST_SLEEP_MARGIN_NS`; shorter ones, and
the rest of long ones, poll the clock with ``time.sleep(0)``. Both release the GIL."""
HOST_SLEEP_MARGIN_NS = 100_000
"""What a long stall leaves to the polling loop: a Linux ``time.sleep`` wakes some 50 to 100 µs late."""


def host_stall(ns: int, *, clock: Callable[[], int] = time.perf_counter_ns,
               sleep: Callable[[float], object] = time.sleep) -> int:
    """Wait at least ``ns`` nanoseconds of ``clock`` (a monotonic ns clock) without holding the GIL; returns the
    nanoseconds waited as ``clock`` saw them (>= ``ns``; more when the host is busy: never an upper bound).

    Long waits sleep (``sleep(seconds)``) for all but `HOST_SLEEP_MARGIN_NS` of the time, then every wait polls
    ``clock`` with ``sleep(0)`` until the deadline: a pure-Python spin would keep the GIL for a whole switch interval
    (5 ms) and starve the very threads the stall is meant to let run. ``clock`` and ``sleep`` are parameters so a
    test can drive the loop without waiting."""
    start = clock()
    deadline = start + int(ns)
    if ns >= HOST_SLEEP_MIN_NS:
        sleep((int(ns) - HOST_SLEEP_MARGIN_NS) / 1e9)
    now = clock()
    while now < deadline:
        sleep(0)
        now = clock()
    return now - start


def jitter_draws(jitter: KernelJitter, kernel_kind: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fire bool [n], cycles int64 [n] in ``[1, max_cycles]``) of entries naming ``slots`` (int [n]) in a launch
    under tag ``kernel_kind``: the hash of the module docstring of `kvcanary.ops.jitter`."""
    params = jitter.params.to(slots.device)
    key = splitmix64_mix3_tensor(params[PARAM_SEED : PARAM_SEED + 1], jitter.launch_key.to(slots.device),
                                 torch.full((1,), int(kernel_kind), dtype=torch.int64, device=slots.device))
    h = splitmix64_xor_tensor(key, slots.to(torch.int64))
    fire = (h & 0xFFFF) < params[PARAM_FIRE_THRESHOLD]
    high = (h >> 32) & 0xFFFFFFFF  # the logical shift of the 64-bit pattern
    cycles = 1 + ((high * params[PARAM_MAX_CYCLES]) >> 32)
    return fire, cycles


def apply_jitter_torch_reference(jitter: Optional[KernelJitter], kernel_kind: int, slots: torch.Tensor, *,
                                 stall: Callable[[int], object] = host_stall) -> None:
    """Count the stalls of a launch's jitter entries ``slots`` (already selected by the op): ``counters[0]`` +=
    entries that fire, ``counters[1]`` += their cycles. On the CPU, if any entry fires, then call ``stall`` with the
    longest fired draw in nanoseconds (``cycles * HOST_NS_PER_CYCLE``; default `host_stall`, a real wait). The op
    calls this before it reads records or real KV. No-op without a jitter or entries; on CUDA it never waits nor
    reads anything back to the host."""
    if jitter is None or slots.numel() == 0:
        return
    fire, cycles = jitter_draws(jitter, kernel_kind, slots)
    fired_cycles = torch.where(fire, cycles, 0)
    fired = fire.sum()
    c = jitter.counters
    c[COUNTER_STALLS : COUNTER_STALLS + 1] += fired.to(c.device)
    c[COUNTER_CYCLES : COUNTER_CYCLES + 1] += fired_cycles.sum().to(c.device)
    if slots.device.type == "cpu" and int(fired) > 0:
        stall(int(fired_cycles.max()) * HOST_NS_PER_CYCLE)
