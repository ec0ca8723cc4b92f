"""Vectorised torch twins of the record copy, export and import ops (contract: ``ops/copy.py``).

Every op works on "record tables": a canary buffer (uint8 [num_slots, stride_bytes]) or any
int64 [num_slots, >= 4] table; only the first four int64 words of a row move. Copy semantics are
gather-all-then-scatter: the sources are read (``index_select`` makes a copy) before any
destination is stored, and a destination named twice keeps its last entry.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvcanary.errors import KvCanaryIndexError, KvCanaryValueError
from kvcanary.ops.constants import CANARY_FIELDS_PER_SLOT, TOKEN_TO_KV_SLOT_PADDING
from kvcanary.ops.copy_format import (
    CANARY_RECORDS_HEADER_ROWS,
    canary_records_shape,
    check_canary_records,
    write_canary_records_header,
)
from kvcanary.ops.reference.common import last_occurrence_mask

_F = CANARY_FIELDS_PER_SLOT


def record_fields(table: torch.Tensor, *, name: str = "canary_bufs[0]") -> torch.Tensor:
    """int64 view [num_slots, row_words] of a record table (uint8 canary buffer or int64 table).

    ValueError when a row is not a whole number of int64 words or holds fewer than four.
    """
    if table.dim() != 2:
        raise KvCanaryValueError(f"kv-canary: {name} must be 2-D [num_slots, row], got shape {tuple(table.shape)}")
    if table.dtype == torch.int64:
        fields = table
    else:
        if table.dtype != torch.uint8 or table.shape[1] % 8:
            raise KvCanaryValueError(
                f"kv-canary: {name} must be uint8 [num_slots, stride_bytes] with stride_bytes a multiple of 8 "
                f"or int64 [num_slots, words], got {table.dtype} shape {tuple(table.shape)}"
            )
        fields = table.view(torch.int64)
    if fields.shape[1] < _F:
        raise KvCanaryValueError(f"kv-canary: {name} rows must hold at least 4 int64 fields, got {int(fields.shape[1])}")
    return fields


def entry_count(num_valid: Optional[torch.Tensor], capacity: int) -> int:
    """Entries a launch reads: ``clamp(num_valid[0], 0, capacity)``, or all of them."""
    if num_valid is None:
        return capacity
    return min(max(int(num_valid[0]), 0), capacity)


def _last_entries(dst: torch.Tensor, num_slots: int) -> Optional[torch.Tensor]:
    """Bool mask of the entries that are the last to name their destination; None when every
    entry is (no duplicates). Raises IndexError for a destination outside the tables."""
    n = dst.numel()
    if n and int(dst.max()) >= num_slots:
        raise KvCanaryIndexError(f"kv-canary: destination slot {int(dst.max())} is outside tables of {num_slots} slots")
    if n < 2 or bool((dst[1:] > dst[:-1]).all()):
        return None
    order = torch.arange(n, device=dst.device)
    if 8 * n >= num_slots:  # dense: one pass over a slot-sized scratch beats a sort
        winner = torch.full((num_slots,), -1, dtype=torch.int64, device=dst.device)
        winner.scatter_reduce_(0, dst, order, reduce="amax")
        keep = winner.index_select(0, dst) == order
    else:
        keep = last_occurrence_mask(dst)
    return None if bool(keep.all()) else keep


def _bump(counter: Optional[torch.Tensor], amount: int) -> None:
    if counter is not None:
        counter.add_(amount)


def canary_copy_slots_torch_reference(
    *,
    canary_bufs: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    num_valid: Optional[torch.Tensor] = None,
    slot_run_counter: Optional[torch.Tensor] = None,
    kernel_run_counter: Optional[torch.Tensor] = None,
) -> None:
    """Twin of ``launch_canary_copy_slots_kernel``: same arguments, same bytes, no validation.

    Mutates: the first 32 bytes of the destination rows of every table; ``kernel_run_counter``
    (+1, first); ``slot_run_counter`` (+ entries copied, at the end). Out-of-range slots may
    raise IndexError (after the kernel counter moved).
    """
    _bump(kernel_run_counter, 1)
    tables = [record_fields(t, name=f"canary_bufs[{i}]")[:, :_F] for i, t in enumerate(canary_bufs)]
    n = entry_count(num_valid, int(dst_slots.shape[0]))
    src = src_slots[:n].to(torch.int64)
    dst = dst_slots[:n].to(torch.int64)
    live = (src > TOKEN_TO_KV_SLOT_PADDING) & (dst > TOKEN_TO_KV_SLOT_PADDING)
    if not bool(live.all()):
        src, dst = src[live], dst[live]
    copied = int(dst.numel())
    keep = _last_entries(dst, int(tables[0].shape[0]))
    if keep is not None:
        src, dst = src[keep], dst[keep]
    if copied:
        for fields in tables:
            fields.index_copy_(0, dst, fields.index_select(0, src))  # gather (a copy), then scatter
    _bump(slot_run_counter, copied)


def export_canary_records_torch_reference(
    *, canary_bufs: Sequence[torch.Tensor], slots: torch.Tensor, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Twin of ``export_canary_records``: int64 [1 + n, 4 * B] on the tables' device (layout:
    ``ops/copy_format.py``), written into ``out`` when given. Reads the tables only."""
    tables = [record_fields(t, name=f"canary_bufs[{i}]")[:, :_F] for i, t in enumerate(canary_bufs)]
    n = int(slots.shape[0])
    device = tables[0].device
    records = out if out is not None else torch.empty(canary_records_shape(n, len(tables)), dtype=torch.int64, device=device)
    write_canary_records_header(records, num_records=n, num_buffers=len(tables))
    payload = records[CANARY_RECORDS_HEADER_ROWS:]
    s = slots.to(device=device, dtype=torch.int64)
    live = s > TOKEN_TO_KV_SLOT_PADDING
    if bool(live.all()):
        for b, fields in enumerate(tables):  # gathered straight into the strided columns
            torch.index_select(fields, 0, s, out=payload[:, _F * b : _F * (b + 1)])
    else:
        payload.zero_()
        rows = live.nonzero().squeeze(1)
        for b, fields in enumerate(tables):
            payload[rows, _F * b : _F * (b + 1)] = fields.index_select(0, s[rows])
    return records


def import_canary_records_torch_reference(
    *,
    canary_bufs: Sequence[torch.Tensor],
    slots: torch.Tensor,
    records: torch.Tensor,
    slot_run_counter: Optional[torch.Tensor] = None,
    kernel_run_counter: Optional[torch.Tensor] = None,
) -> None:
    """Twin of ``import_canary_records``. Checks the records' header (ValueError) before it
    changes anything, then installs row ``1 + i`` into slot ``slots[i]`` of every table.

    Mutates: the first 32 bytes of the imported rows; the counters as the copy does.
    """
    check_canary_records("import_canary_records", records, num_records=int(slots.shape[0]), num_buffers=len(canary_bufs))
    tables = [record_fields(t, name=f"canary_bufs[{i}]")[:, :_F] for i, t in enumerate(canary_bufs)]
    _bump(kernel_run_counter, 1)
    device = tables[0].device
    payload = records[CANARY_RECORDS_HEADER_ROWS:].to(device)
    dst = slots.to(device=device, dtype=torch.int64)
    live = dst > TOKEN_TO_KV_SLOT_PADDING
    rows = None  # None: every payload row, in order
    if not bool(live.all()):
        rows = live.nonzero().squeeze(1)
        dst = dst[rows]
    copied = int(dst.numel())
    keep = _last_entries(dst, int(tables[0].shape[0]))
    if keep is not None:
        rows = (rows if rows is not None else torch.arange(live.numel(), device=device))[keep]
        dst = dst[keep]
    if copied:
        picked = payload if rows is None else payload.index_select(0, rows)
        for b, fields in enumerate(tables):
            fields.index_copy_(0, dst, picked[:, _F * b : _F * (b + 1)])
    _bump(slot_run_counter, copied)
