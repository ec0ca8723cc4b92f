"""Appending violation rows from a kernel (docs/design.md §3.4): reserve with one atomic, store eight fields.

Rows of one block get consecutive indices in lane order; a row at or past the ring's capacity
is counted (the write index grows by the full count) but not stored (fill-once).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.triton.constants import (
    R_AUX, R_BITS, R_CHAIN, R_EXPECTED_TOKEN, R_KIND, R_POSITION, R_SLOT, R_STORED_TOKEN, RING_FIELDS,
)


@triton.jit
def reserve_rows(widx_ptr, counts):
    """Reserve ``sum(counts)`` rows (int32 counts per lane, > 0 in total); returns each lane's
    first row index (int64): the exclusive running sum of ``counts`` from the old write index."""
    base = tl.atomic_add(widx_ptr, tl.sum(counts, 0)).to(tl.int64)
    return base + (tl.cumsum(counts, 0) - counts).to(tl.int64)


@triton.jit
def store_rows(ring_ptr, ring_cap, row, want, kind, slot, position, stored_token, expected_token, chain, aux, bits):
    """Store one ring row per lane where ``want`` and ``0 <= row < ring_cap`` (all fields int64)."""
    keep = want & (row >= 0) & (row < ring_cap)
    out = ring_ptr + row * RING_FIELDS
    tl.store(out + R_KIND, kind, mask=keep)
    tl.store(out + R_SLOT, slot, mask=keep)
    tl.store(out + R_POSITION, position, mask=keep)
    tl.store(out + R_STORED_TOKEN, stored_token, mask=keep)
    tl.store(out + R_EXPECTED_TOKEN, expected_token, mask=keep)
    tl.store(out + R_CHAIN, chain, mask=keep)
    tl.store(out + R_AUX, aux, mask=keep)
    tl.store(out + R_BITS, bits, mask=keep)
