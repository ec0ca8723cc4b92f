"""splitmix64 finaliser and the chain mix (docs/design.md §3.2), as Python ints and as int64 tensors.

Tensor versions work on int64 tensors holding the 64-bit pattern (two's complement): torch's
int64 multiply wraps mod 2^64 and the logical shifts are done with a mask, so the bytes equal
the unsigned definition on every device.
"""
from __future__ import annotations

import torch

from kvcanary.ops.constants import CANARY_CHAIN_ANCHOR, MASK64  # noqa: F401  (MASK64 re-exported)

SPLITMIX64_GAMMA_1 = 0xBF58476D1CE4E5B9
SPLITMIX64_GAMMA_2 = 0x94D049BB133111EB
SPLITMIX64_SHIFTS = (30, 27, 31)
"""The finaliser's multipliers and xor-shift distances (docs/design.md §3.2): the one definition that the
tensor code here, the numba scan and the Triton kernels all use."""


def to_signed64(x: int) -> int:
    """The int64 value with the same 64-bit pattern as ``x`` (any sign, reduced mod 2^64)."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """splitmix64 finaliser of ``x`` (any sign, reduced mod 2^64); returns ``[0, 2^64)``."""
    s1, s2, s3 = SPLITMIX64_SHIFTS
    x &= MASK64
    x = ((x ^ (x >> s1)) * SPLITMIX64_GAMMA_1) & MASK64
    x = ((x ^ (x >> s2)) * SPLITMIX64_GAMMA_2) & MASK64
    return x ^ (x >> s3)


def splitmix64_mix3(a: int, b: int, c: int) -> int:
    """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)``, all mod 2^64; returns ``[0, 2^64)``."""
    h = splitmix64(a)
    h = splitmix64(h ^ (b & MASK64))
    return splitmix64(h ^ (c & MASK64))


CHAIN_HEAD_HASH = splitmix64(CANARY_CHAIN_ANCHOR)
"""H0: the prev_hash stored in a sequence's first slot (0xDE7FAE23A9A1B716)."""

_S_GAMMA_1 = to_signed64(SPLITMIX64_GAMMA_1)
_S_GAMMA_2 = to_signed64(SPLITMIX64_GAMMA_2)


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _xor_lsr_(x: torch.Tensor, k: int, tmp: torch.Tensor) -> None:
    """``x ^= x >>> k`` (logical shift) in place, using ``tmp`` as scratch."""
    torch.bitwise_right_shift(x, k, out=tmp)
    tmp.bitwise_and_((1 << (64 - k)) - 1)
    x.bitwise_xor_(tmp)


def _splitmix64_inplace(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of an int64 tensor the caller owns, computed in place; returns it."""
    s1, s2, s3 = SPLITMIX64_SHIFTS
    tmp = torch.empty_like(x)
    _xor_lsr_(x, s1, tmp)
    x.mul_(_S_GAMMA_1)
    _xor_lsr_(x, s2, tmp)
    x.mul_(_S_GAMMA_2)
    _xor_lsr_(x, s3, tmp)
    return x


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """Elementwise splitmix64 of an int64 tensor (bit patterns in, bit patterns out)."""
    return _splitmix64_inplace(x.clone())


def splitmix64_xor_tensor(acc: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """``splitmix64(acc ^ word)`` elementwise, as a new tensor."""
    return _splitmix64_inplace(acc ^ word)


def splitmix64_mix3_tensor(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Elementwise mix3 of broadcastable int64 tensors."""
    h = splitmix64_tensor(a)
    h = _splitmix64_inplace(h ^ b)
    return _splitmix64_inplace(h ^ c)
