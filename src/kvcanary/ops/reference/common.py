"""Helpers shared by the reference ops: buffer views, slot hashes, the violation ring."""
from __future__ import annotations

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.constants import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_TOKEN,
    CANARY_FIELDS_PER_SLOT,
    VIOLATION_FIELDS,
)
from kvcanary.ops.hashing import CHAIN_HEAD_HASH, splitmix64_mix3_tensor, to_signed64

H0_SIGNED = to_signed64(CHAIN_HEAD_HASH)


def canary_fields(canary_buf: torch.Tensor) -> torch.Tensor:
    """int64 view [num_slots, row_bytes // 8] of a uint8 canary buffer; checks the stride."""
    if canary_buf.dim() != 2 or canary_buf.shape[1] % 8:
        raise KvCanaryValueError(
            "kv-canary: canary_buf must be uint8 [num_slots, stride_bytes] with stride_bytes a "
            f"multiple of 8, got shape {tuple(canary_buf.shape)}"
        )
    fields = canary_buf.view(torch.int64)
    slot_stride_i64 = int(fields.shape[1])
    if slot_stride_i64 < CANARY_FIELDS_PER_SLOT:
        raise KvCanaryValueError(
            f"kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got {slot_stride_i64}"
        )
    return fields


def read_records(fields: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``fields[s]`` for int64 slots [N]; a row outside ``[0, num_slots)`` reads as zeros
    (never indexed)."""
    inside = (slots >= 0) & (slots < fields.shape[0])
    rec = fields.index_select(0, torch.where(inside, slots, torch.zeros_like(slots)))
    if bool(inside.all()):
        return rec
    return rec * inside[:, None].to(rec.dtype)


def slot_hash(fields: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``slot_hash(buf, s)`` for int64 slots [N]: H0 where ``s < 0``, else mix3 of the record
    (a slot ``>= num_slots`` reads as an all-zero record)."""
    head = slots < 0
    rec = read_records(fields, slots)
    h = splitmix64_mix3_tensor(
        rec[:, CANARY_FIELD_PREV_HASH], rec[:, CANARY_FIELD_TOKEN], rec[:, CANARY_FIELD_POSITION]
    )
    return torch.where(head, torch.full_like(h, H0_SIGNED), h)


def append_violations(ring: torch.Tensor, write_index: torch.Tensor, rows: torch.Tensor) -> None:
    """Fill-once append (docs/design.md §3.4): rows go to ``[base, min(base + k, cap))``; index += k."""
    k = int(rows.shape[0])
    if k == 0:
        return
    base = int(write_index[0])
    cap = int(ring.shape[0])
    keep = max(0, min(k, cap - max(base, 0)))
    if keep:
        ring[base : base + keep] = rows[:keep].to(device=ring.device, dtype=ring.dtype)
    write_index += k


def violation_rows(*columns: torch.Tensor) -> torch.Tensor:
    """Stack eight int64 columns [N] (or scalars broadcast) into violation rows [N, 8]."""
    assert len(columns) == VIOLATION_FIELDS
    sizes = [c.numel() for c in columns]
    # An empty column means no rows (a one-element column is then broadcast to nothing).
    n = 0 if 0 in sizes else max(sizes)
    cols = [c.expand(n) if c.numel() == 1 else c for c in columns]
    return torch.stack([c.to(torch.int64) for c in cols], dim=1)


def last_occurrence_mask(keys: torch.Tensor) -> torch.Tensor:
    """Bool [N]: True where ``keys[i]`` does not occur again later (last write wins)."""
    n = keys.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=keys.device)
    order = torch.sort(keys, stable=True).indices
    sorted_keys = keys[order]
    last_sorted = torch.ones(n, dtype=torch.bool, device=keys.device)
    last_sorted[:-1] = sorted_keys[1:] != sorted_keys[:-1]
    mask = torch.empty(n, dtype=torch.bool, device=keys.device)
    mask[order] = last_sorted
    return mask


def segment_ids(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For non-negative int64 lengths [R]: (segment of each element, index within its segment)."""
    total = int(lengths.sum()) if lengths.numel() else 0
    # searchsorted, not repeat_interleave: the latter takes milliseconds on a busy 2-core CPU.
    ends = torch.cumsum(lengths, 0)
    seg = torch.searchsorted(ends, torch.arange(total, device=lengths.device), right=True)
    starts = ends - lengths
    local = torch.arange(total, device=lengths.device) - starts[seg]
    return seg, local
