"""Torch twin of the timing jitter's draws and counts (docs/design.md §3.11, `kvcanary.ops.jitter`).

The twins count exactly what the Triton kernels count; they never wait (the stall is a GPU clock spin).
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.ops.hashing import splitmix64_mix3_tensor, splitmix64_xor_tensor
from kvcanary.ops.jitter import (
    COUNTER_CYCLES, COUNTER_STALLS, PARAM_FIRE_THRESHOLD, PARAM_MAX_CYCLES, PARAM_SEED, KernelJitter,
)


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


def apply_jitter_torch_reference(jitter: Optional[KernelJitter], kernel_kind: int, slots: torch.Tensor) -> None:
    """Count the stalls of a launch's jitter entries ``slots`` (already selected by the op): ``counters[0]`` +=
    entries that fire, ``counters[1]`` += their cycles. No-op without a jitter or entries."""
    if jitter is None or slots.numel() == 0:
        return
    fire, cycles = jitter_draws(jitter, kernel_kind, slots)
    c = jitter.counters
    c[COUNTER_STALLS : COUNTER_STALLS + 1] += fire.sum().to(c.device)
    c[COUNTER_CYCLES : COUNTER_CYCLES + 1] += torch.where(fire, cycles, 0).sum().to(c.device)
