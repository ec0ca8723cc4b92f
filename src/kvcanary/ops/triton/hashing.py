"""Triton device helpers shared by the kernels: splitmix64, mix3, real-KV fingerprints, and the
host side of the real-KV sources and lazy checks (docs/design.md §3.2, §3.3).

PARTIAL and ALL fold a strip's words serially; LANES (the deep buffers' mode) hashes them as [BLOCK, LANES_CH]
tiles and sums each row. Which one a kernel runs is the constexpr ``LANES_CH`` (0: the serial fold), so PARTIAL
and ALL launches compile the same code as before LANES existed.

Interpreter rules (docs/design.md §3.9): hash math runs on ``tl.uint64`` values bitcast from int64, never
mixes signed and unsigned operands, and never applies ``~`` to unsigned values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.constants import PARTIAL_REAL_KV_READ_BYTES, RealKvHashMode
from kvcanary.ops.hashing import CHAIN_HEAD_HASH, to_signed64
from kvcanary.ops.records import RealKvSource
from kvcanary.ops.triton.constants import GAMMA_1, GAMMA_2, LANES_KEY, SHIFT_1, SHIFT_2, SHIFT_3

H0_SIGNED = to_signed64(CHAIN_HEAD_HASH)
"""The chain head hash H0 as the int64 value kernels receive."""


@triton.jit
def splitmix64(x):
    """splitmix64 finaliser of a tl.uint64 tensor."""
    x = x ^ (x >> SHIFT_1)
    x = x * GAMMA_1
    x = x ^ (x >> SHIFT_2)
    x = x * GAMMA_2
    return x ^ (x >> SHIFT_3)


@triton.jit
def as_u64(x):
    """Bit pattern of an integer tensor as tl.uint64 (sign-extending narrower ints first)."""
    return x.to(tl.int64).to(tl.uint64, bitcast=True)


@triton.jit
def as_i64(x):
    """tl.uint64 bit pattern as tl.int64 (what the buffers store)."""
    return x.to(tl.int64, bitcast=True)


@triton.jit
def mix3(h, b, c):
    """``splitmix64(splitmix64(splitmix64(h) ^ b) ^ c)``; all tl.uint64."""
    h = splitmix64(h)
    h = splitmix64(h ^ b)
    return splitmix64(h ^ c)


@triton.jit
def slot_hash_of_fields(prev_hash, token, position):
    """mix3 over a record's stored (int64) prev_hash, token and position; returns tl.uint64."""
    return mix3(as_u64(prev_hash), as_u64(token), as_u64(position))


UNROLLED_WORDS = tl.constexpr(8)
"""Strips of at most this many 8-byte words are folded by unrolled code; longer ones by a loop (compile time
and registers stay flat however many bytes ALL mode hashes per token)."""


@triton.jit
def _strip(ptr, slot, mask, page_size, nbpt_words, row_words):
    """(int64 word pointer, index of each slot's first word) of a source; ``ptr`` points at its first byte
    (8-byte aligned); strips start on 16-byte boundaries."""
    s = tl.where(mask, slot, 0)
    first = (s // page_size) * row_words + (s % page_size) * nbpt_words
    return ptr.to(tl.pointer_type(tl.int64)), tl.multiple_of(first, 2)


@triton.jit
def _source_fold(ptr, slot, mask, page_size, nbpt_words, row_words, NWORDS: tl.constexpr):
    """Fold the first NWORDS little-endian words of each slot's strip: acc = splitmix64(acc ^ w).
    Loads go two words (16 bytes) at a time."""
    wptr, first = _strip(ptr, slot, mask, page_size, nbpt_words, row_words)
    acc = tl.zeros(slot.shape, dtype=tl.uint64)
    if NWORDS <= UNROLLED_WORDS:  # PARTIAL (2 words) and short rows: unrolled
        for k in tl.static_range(NWORDS // 2):
            acc = _fold_two_words(acc, wptr, first, mask, k)
    else:  # ALL over long rows (e.g. 128 words per token and layer): a loop, not thousands of unrolled steps
        for q in range(NWORDS // 8):  # four 16-byte loads issued before their folds: four in flight, not one
            acc = _fold_eight_words(acc, wptr, first, mask, 4 * q)
        for k in range((NWORDS // 8) * 4, NWORDS // 2):
            acc = _fold_two_words(acc, wptr, first, mask, k)
    return acc


@triton.jit
def _load_two_words(wptr, first, mask, k):
    """Each slot's words 2k and 2k+1 (one 16-byte load), as two int64 tensors."""
    pair = tl.arange(0, 2)
    two = tl.load(wptr + first[:, None] + (2 * k + pair)[None, :], mask=mask[:, None], other=0)
    return tl.split(two)


@triton.jit
def _fold_pair(acc, w0, w1):
    """acc = splitmix64(splitmix64(acc ^ w0) ^ w1)."""
    acc = splitmix64(acc ^ as_u64(w0))
    return splitmix64(acc ^ as_u64(w1))


@triton.jit
def _fold_two_words(acc, wptr, first, mask, k):
    """acc = splitmix64(splitmix64(acc ^ w[2k]) ^ w[2k+1]) for each slot's words 2k, 2k+1 (one 16-byte load)."""
    w0, w1 = _load_two_words(wptr, first, mask, k)
    return _fold_pair(acc, w0, w1)


@triton.jit
def _fold_eight_words(acc, wptr, first, mask, k):
    """`_fold_two_words` for pairs k .. k+3, the four loads issued first (they do not depend on ``acc``)."""
    a0, b0 = _load_two_words(wptr, first, mask, k)
    a1, b1 = _load_two_words(wptr, first, mask, k + 1)
    a2, b2 = _load_two_words(wptr, first, mask, k + 2)
    a3, b3 = _load_two_words(wptr, first, mask, k + 3)
    acc = _fold_pair(acc, a0, b0)
    acc = _fold_pair(acc, a1, b1)
    acc = _fold_pair(acc, a2, b2)
    return _fold_pair(acc, a3, b3)


LANES_MAX_COLS = 32
"""Widest word tile of the LANES fold: ``LANES_CH = min(next_pow2(max W), LANES_MAX_COLS)``."""


@triton.jit
def _lanes_fold(ptr, slot, mask, page_size, nbpt_words, row_words, NWORDS: tl.constexpr, CH: tl.constexpr):
    """LANES accumulator (tl.uint64) of each slot's strip: the wrapping sum over ``i < NWORDS`` of
    ``splitmix64(w_i ^ (i + 1) * LANES_KEY)``. Reads [BLOCK, CH] word tiles (CH a power of two); columns past
    NWORDS are not loaded and add nothing."""
    wptr, first = _strip(ptr, slot, mask, page_size, nbpt_words, row_words)
    acc = tl.zeros(slot.shape, dtype=tl.uint64)
    cols = tl.arange(0, CH)
    for c0 in range(0, NWORDS, CH):
        col = c0 + cols
        inside = col < NWORDS
        tile = tl.load(wptr + first[:, None] + col[None, :], mask=mask[:, None] & inside[None, :], other=0)
        key = as_u64(col + 1) * LANES_KEY
        h = splitmix64(as_u64(tile) ^ key[None, :])
        if NWORDS % CH != 0:  # a masked word would add splitmix64(key), not 0
            h = tl.where(inside[None, :], h, tl.zeros_like(h))
        acc += tl.sum(h, axis=1)
    return acc


@triton.jit
def fingerprint(
    slot, mask,
    s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
    NSRC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    LANES_CH: tl.constexpr,
):
    """Real-KV fingerprint (tl.uint64) of each slot over NSRC sources; 0 when NSRC == 0.

    Per source: base pointer, page size, bytes-per-token in words, row stride in words, and the
    constexpr number of words hashed (2 in PARTIAL, read_bytes // 8 in ALL and LANES). ``LANES_CH`` > 0: LANES
    mode with word tiles that wide (`_lanes_fold`); 0: the serial fold of PARTIAL / ALL.
    """
    total = tl.zeros(slot.shape, dtype=tl.uint64)
    if LANES_CH > 0:
        if NSRC > 0:
            total = splitmix64(total ^ _lanes_fold(s0, slot, mask, p0, n0, r0, W0, LANES_CH))
        if NSRC > 1:
            total = splitmix64(total ^ _lanes_fold(s1, slot, mask, p1, n1, r1, W1, LANES_CH))
        if NSRC > 2:
            total = splitmix64(total ^ _lanes_fold(s2, slot, mask, p2, n2, r2, W2, LANES_CH))
        if NSRC > 3:
            total = splitmix64(total ^ _lanes_fold(s3, slot, mask, p3, n3, r3, W3, LANES_CH))
    elif NSRC > 1 and W0 > UNROLLED_WORDS and W1 == W0 and (NSRC < 3 or W2 == W0) and (NSRC < 4 or W3 == W0):
        # ALL mode over sources of one row shape (deep fingerprints, the sweep): the sources' folds advance
        # together, so every iteration has one 16-byte load per source in flight instead of one in all
        a0, a1, a2, a3 = _folds_together(slot, mask, s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
                                         NSRC, W0)
        total = splitmix64(total ^ a0)
        total = splitmix64(total ^ a1)
        if NSRC > 2:
            total = splitmix64(total ^ a2)
        if NSRC > 3:
            total = splitmix64(total ^ a3)
    else:
        if NSRC > 0:
            total = splitmix64(total ^ _source_fold(s0, slot, mask, p0, n0, r0, W0))
        if NSRC > 1:
            total = splitmix64(total ^ _source_fold(s1, slot, mask, p1, n1, r1, W1))
        if NSRC > 2:
            total = splitmix64(total ^ _source_fold(s2, slot, mask, p2, n2, r2, W2))
        if NSRC > 3:
            total = splitmix64(total ^ _source_fold(s3, slot, mask, p3, n3, r3, W3))
    return total


@triton.jit
def _folds_together(
    slot, mask, s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3, NSRC: tl.constexpr, NWORDS: tl.constexpr,
):
    """`_source_fold` of NSRC (2-4) sources of NWORDS words each, in one loop (each source's fold unchanged;
    the accumulators of absent sources stay 0)."""
    w0, f0 = _strip(s0, slot, mask, p0, n0, r0)
    w1, f1 = _strip(s1, slot, mask, p1, n1, r1)
    w2, f2 = _strip(s2, slot, mask, p2, n2, r2)
    w3, f3 = _strip(s3, slot, mask, p3, n3, r3)
    a0 = tl.zeros(slot.shape, dtype=tl.uint64)
    a1 = tl.zeros(slot.shape, dtype=tl.uint64)
    a2 = tl.zeros(slot.shape, dtype=tl.uint64)
    a3 = tl.zeros(slot.shape, dtype=tl.uint64)
    for q in range(NWORDS // 8):  # per source four 16-byte loads in flight (`_fold_eight_words`)
        a0 = _fold_eight_words(a0, w0, f0, mask, 4 * q)
        a1 = _fold_eight_words(a1, w1, f1, mask, 4 * q)
        if NSRC > 2:
            a2 = _fold_eight_words(a2, w2, f2, mask, 4 * q)
        if NSRC > 3:
            a3 = _fold_eight_words(a3, w3, f3, mask, 4 * q)
    for k in range((NWORDS // 8) * 4, NWORDS // 2):
        a0 = _fold_two_words(a0, w0, f0, mask, k)
        a1 = _fold_two_words(a1, w1, f1, mask, k)
        if NSRC > 2:
            a2 = _fold_two_words(a2, w2, f2, mask, k)
        if NSRC > 3:
            a3 = _fold_two_words(a3, w3, f3, mask, k)
    return a0, a1, a2, a3


@dataclass(frozen=True)
class SourceArgs:
    """Kernel arguments describing the real-KV sources of one launch."""

    args: tuple  # 16 runtime values: (tensor, page_size, nbpt_words, row_words) x 4
    consts: dict  # NSRC, W0..W3, LANES_CH (0 unless LANES mode)

    @staticmethod
    def none(dummy: torch.Tensor) -> "SourceArgs":
        return SourceArgs(args=(dummy, 1, 2, 2) * 4, consts=dict(NSRC=0, W0=2, W1=2, W2=2, W3=2, LANES_CH=0))


def _kernel_addressable(src: RealKvSource) -> bool:
    """True when a row's bytes are contiguous in memory and the tensor starts 16-byte aligned
    (then word ``k`` of slot ``s`` is at a fixed offset from ``data_ptr``)."""
    t = src.tensor
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def source_args(sources: tuple, mode: int, dummy: torch.Tensor):
    """SourceArgs for the launch (LANES mode: ``LANES_CH`` > 0), or None when a source's layout needs the torch twin
    (rows not contiguous in memory, or a base address not 16-byte aligned)."""
    if int(mode) == RealKvHashMode.NONE or not sources:
        return SourceArgs.none(dummy)
    args: list = []
    consts = dict(NSRC=len(sources))
    for i in range(4):
        if i < len(sources):
            src = sources[i]
            if not _kernel_addressable(src):
                return None
            nbytes = PARTIAL_REAL_KV_READ_BYTES if int(mode) == RealKvHashMode.PARTIAL else src.read_bytes
            args += [src.tensor, src.page_size, src.num_bytes_per_token // 8,
                     src.tensor.stride(0) * src.tensor.element_size() // 8]
            consts[f"W{i}"] = nbytes // 8
        else:
            args += [dummy, 1, 2, 2]
            consts[f"W{i}"] = 2
    widest = max(consts[f"W{i}"] for i in range(len(sources)))
    lanes = int(mode) == RealKvHashMode.LANES
    consts["LANES_CH"] = min(triton.next_power_of_2(widest), LANES_MAX_COLS) if lanes else 0
    return SourceArgs(args=tuple(args), consts=consts)


def static_error(context, *, check_input_assert=None) -> Exception | None:
    """The lazy-check error a launch with work would raise, judged from shapes alone (no device
    read); None when the launch is well-formed. Order as in docs/design.md §3.6/§3.7: stride, input-assert
    rule (write), narrow rows."""
    buf = context.canary_buf
    if buf.shape[1] % 8:
        return KvCanaryValueError(
            "kv-canary: canary_buf must be uint8 [num_slots, stride_bytes] with stride_bytes a "
            f"multiple of 8, got shape {tuple(buf.shape)}"
        )
    if buf.shape[1] // 8 < 4:
        return KvCanaryValueError(f"kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got {buf.shape[1] // 8}")
    if check_input_assert is not None:
        flag, tokens, positions = check_input_assert
        if flag and (tokens is None or positions is None):
            return KvCanaryValueError("kv-canary: expected input tensors are required when enable_write_input_assert=True")
        if not flag and (tokens is not None or positions is not None):
            return KvCanaryValueError("kv-canary: expected input tensors must be None when enable_write_input_assert=False")
    if context.hashing_on:
        for src in context.real_kv_sources:
            if src.row_bytes < src.slot_layout_bytes:
                return KvCanaryValueError(
                    "kv-canary: RealKvSource row is too narrow for its slot layout: dim-1 is "
                    f"{src.row_bytes} bytes but page_size={src.page_size} x num_bytes_per_token="
                    f"{src.num_bytes_per_token} needs {src.slot_layout_bytes}"
                )
    return None
