"""Real-KV fingerprints of slots (docs/design.md §3.2, §3.3), vectorised over slots (and, in LANES mode, over
a strip's words).

Reads only the strips it hashes, on the sources' own device: no KV layer is copied.
"""
from __future__ import annotations


import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.constants import LANES_WORD_KEY, PARTIAL_REAL_KV_READ_BYTES, RealKvHashMode
from kvcanary.ops.hashing import splitmix64_xor_tensor, to_signed64
from kvcanary.ops.records import RealKvSource


def check_row_widths(sources: tuple[RealKvSource, ...]) -> None:
    """Raise for the first source whose logical row is narrower than its slot layout."""
    for src in sources:
        if src.row_bytes < src.slot_layout_bytes:
            raise KvCanaryValueError(
                "kv-canary: RealKvSource row is too narrow for its slot layout: dim-1 is "
                f"{src.row_bytes} bytes but page_size={src.page_size} x num_bytes_per_token="
                f"{src.num_bytes_per_token} needs {src.slot_layout_bytes}"
            )


def hashed_bytes(src: RealKvSource, mode: int) -> int:
    """Bytes of a strip folded into the fingerprint: 16 in PARTIAL, ``read_bytes`` in ALL and LANES."""
    return PARTIAL_REAL_KV_READ_BYTES if int(mode) == RealKvHashMode.PARTIAL else src.read_bytes


def _inner_dims_are_dense(t: torch.Tensor) -> bool:
    """True when each row's elements (dims 1..) are laid out contiguously in memory."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _column_byte_offsets(t: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Storage byte offset (relative to row start) of logical byte ``columns`` of a row."""
    es = t.element_size()
    elem, within = columns // es, columns % es
    offset = torch.zeros_like(columns)
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        offset += (elem % size) * (stride * es)
        elem = elem // size
    return offset + within


def strip_words(src: RealKvSource, slots: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of each slot's strip as little-endian words: int64 [N, nbytes // 8]."""
    t = src.tensor
    es = t.element_size()
    nwords = nbytes // 8
    storage = t.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
    rows = slots // src.page_size
    cols = (slots % src.page_size) * src.num_bytes_per_token
    row_start = t.storage_offset() * es + rows * (t.stride(0) * es)
    if _inner_dims_are_dense(t) and t.storage_offset() * es % 8 == 0:
        words = base[: storage.nbytes() // 8 * 8].view(torch.int64)
        first = (row_start + cols) // 8
        index = first[:, None] + torch.arange(nwords, device=t.device)
        return words[index]
    # General layout: gather byte by byte, then reassemble words (little-endian on every host
    # torch supports).
    byte_cols = cols[:, None] + torch.arange(nbytes, device=t.device)
    index = row_start[:, None] + _column_byte_offsets(t, byte_cols)
    return base[index].contiguous().view(torch.int64)


def fingerprint_slots(
    sources: tuple[RealKvSource, ...], mode: int, slots: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Fingerprint of each slot (int64 [N]); zeros when mode is NONE or there are no sources."""
    total = torch.zeros(slots.shape[0], dtype=torch.int64, device=device)
    if int(mode) == RealKvHashMode.NONE or not sources or slots.numel() == 0:
        return total
    lanes = int(mode) == RealKvHashMode.LANES
    for src in sources:
        words = strip_words(src, slots.to(src.tensor.device), hashed_bytes(src, mode)).to(device)
        if lanes:
            acc = lanes_fold(words)
        else:
            acc = torch.zeros_like(total)
            for k in range(words.shape[1]):
                acc = splitmix64_xor_tensor(acc, words[:, k])
        total = splitmix64_xor_tensor(total, acc)
    return total


def lanes_keys(nwords: int, device: torch.device) -> torch.Tensor:
    """int64 [nwords]: the LANES key of word ``i``, ``(i + 1) * LANES_WORD_KEY mod 2^64`` (as its int64 pattern)."""
    return torch.arange(1, nwords + 1, dtype=torch.int64, device=device) * to_signed64(LANES_WORD_KEY)


_LANES_TWIN_COLS = 64  # words hashed per step of the twin: temporaries stay a fraction of ``words``


def lanes_fold(words: torch.Tensor) -> torch.Tensor:
    """LANES accumulator of each strip: int64 [N, W] words -> int64 [N], the wrapping sum over ``i`` of
    ``splitmix64(w_i ^ key_i)`` (`lanes_keys`). Hashed a block of columns at a time; the sums are taken over the
    32-bit halves (no int64 overflow below 2^31 words), then recombined mod 2^64."""
    keys = lanes_keys(words.shape[1], words.device)
    lo = torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)
    hi = torch.zeros_like(lo)
    for c in range(0, words.shape[1], _LANES_TWIN_COLS):
        h = splitmix64_xor_tensor(words[:, c : c + _LANES_TWIN_COLS], keys[None, c : c + _LANES_TWIN_COLS])
        lo += (h & 0xFFFFFFFF).sum(dim=1)
        hi += ((h >> 32) & 0xFFFFFFFF).sum(dim=1)
    return lo + (hi << 32)


__all__ = ["check_row_widths", "fingerprint_slots", "strip_words", "hashed_bytes", "lanes_fold", "lanes_keys"]
