"""Triton side of the timing jitter (docs/design.md §3.11, `kvcanary.ops.jitter`): the draw, the counts, the spin.

A kernel takes three pointers (params, launch key, counters) and two constexprs: ``JITTER`` (False: the branch
is not compiled, the kernel is the one without jitter) and ``SPIN`` (True only on a real GPU: under
``TRITON_INTERPRET=1`` the draws and counts run, the clock spin does not).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from kvcanary.ops.jitter import KernelJitter
from kvcanary.ops.triton.hashing import as_i64, as_u64, mix3, splitmix64


@triton.jit
def _clock64():
    """The SM's cycle counter (``%clock64``); GPU only."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin(cycles):
    """Busy-wait ``cycles`` SM clock cycles (int64 scalar); GPU only."""
    start = _clock64()
    now = start
    while now - start < cycles:
        now = _clock64()


@triton.jit
def jitter_stall(params_ptr, key_ptr, counters_ptr, kind, slot, mask, SPIN: tl.constexpr):
    """Draw for the entries ``slot`` (int64 block) under ``mask`` of a launch under tag ``kind``; count the firing
    ones (one relaxed atomic per counter when any fires) and, with ``SPIN``, stall the program for the largest draw.
    Same arithmetic as `kvcanary.ops.reference.jitter.jitter_draws`."""
    seed = tl.load(params_ptr)
    threshold = tl.load(params_ptr + 1)
    max_cycles = tl.load(params_ptr + 2)
    step = tl.load(key_ptr)
    key = mix3(as_u64(seed), as_u64(step), as_u64(kind))
    h = splitmix64(key ^ as_u64(slot))
    fire = mask & ((as_i64(h) & 0xFFFF) < threshold)
    cycles = 1 + ((as_i64(h >> 32) * max_cycles) >> 32)
    stalls = tl.sum(fire.to(tl.int64), 0)
    if stalls > 0:
        drawn = tl.where(fire, cycles, 0)
        tl.atomic_add(counters_ptr, stalls, sem="relaxed")
        tl.atomic_add(counters_ptr + 1, tl.sum(drawn, 0), sem="relaxed")
        if SPIN:
            _spin(tl.max(drawn, 0))


def spin_on(device: torch.device) -> bool:
    """True where the kernels really run on a GPU (a CUDA device, not the interpreter): only there they spin."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def jitter_args(jitter: Optional[KernelJitter], dummy: torch.Tensor) -> tuple[tuple, dict]:
    """The kernels' three jitter pointers and ``JITTER`` / ``SPIN`` constexprs; without a jitter, ``dummy`` (any
    int64 tensor of the launch: never read) stands in for the pointers and both constexprs are False."""
    if jitter is None:
        return (dummy, dummy, dummy), dict(JITTER=False, SPIN=False)
    return (jitter.params, jitter.launch_key, jitter.counters), dict(JITTER=True, SPIN=spin_on(jitter.device))
