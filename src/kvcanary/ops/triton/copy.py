"""Triton record copy, export and import (contract: ``ops/copy.py``), capturable in a CUDA graph.

Each op is a few grid-from-capacity launches on one stream; the launch boundaries are the
barriers the contract needs:

1. ``_claim_kernel``: kernel counter +1 (program 0), slot counter += live entries (one atomic
   per block), and ``winner[dst] = -1`` for every live entry;
2. ``_elect_kernel``: ``atomic_max(winner[dst], i)`` — the last entry naming a destination wins,
   whatever order the programs run in;
3. ``_gather_kernel``: every live entry's source rows -> a scratch table (or the export);
4. ``_scatter_kernel``: winners store their scratch (or imported) row into the destination.

The copy runs 1-4, the import 1, 2 and 4 (reading the records), the export 3 alone.
Sources are all read (3) before any destination is stored (4), so an entry whose source is
another entry's destination sees the state before the launch. ``winner`` is an int32
[num_slots] scratch; only the cells of live destinations are ever read, so it is never cleared.
Tables are handled four per launch (``NBUF``); more take one gather/scatter pair per four.
Entry counts stay on the device (``num_valid``); nothing here reads the host.

Out-of-range slots (``>= num_slots``) are treated as padding by every kernel, so a launch
captured without the public launcher's host-side range check can never store out of bounds.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kvcanary.ops.constants import CANARY_FIELDS_PER_SLOT, TOKEN_TO_KV_SLOT_PADDING
from kvcanary.ops.copy_format import CANARY_RECORDS_HEADER_ROWS, canary_records_shape, write_canary_records_header
from kvcanary.ops.reference.copy import record_fields
from kvcanary.ops.triton.launch import jit_batch_sized

BLOCK = 512
"""Entries per program (large blocks keep the CPU interpreter quick; 32-byte rows per entry)."""
TABLES_PER_LAUNCH = 4
_F = CANARY_FIELDS_PER_SLOT
FIELDS = tl.constexpr(CANARY_FIELDS_PER_SLOT)
"""int64 words of a record, as the kernels see it."""
PADDING = tl.constexpr(TOKEN_TO_KV_SLOT_PADDING)
"""Slots at or below this are padding entries (skipped)."""


@triton.jit
def _entry_count(num_valid_ptr, capacity, HAS_NUM_VALID: tl.constexpr):
    """Entries the launch reads: clamp(num_valid[0], 0, capacity), or capacity."""
    n = tl.full([], 0, tl.int64) + capacity
    if HAS_NUM_VALID:
        n = tl.minimum(tl.maximum(tl.load(num_valid_ptr).to(tl.int64), 0), n)
    return n


@triton.jit
def _live_entries(src_ptr, dst_ptr, num_valid_ptr, idx, capacity, num_slots,
                  HAS_SRC: tl.constexpr, HAS_NUM_VALID: tl.constexpr):
    """(live, dst) of entries idx: live = read (idx < n) and both slots in [1, num_slots)."""
    inside = idx < _entry_count(num_valid_ptr, capacity, HAS_NUM_VALID)
    dst = tl.load(dst_ptr + idx, mask=inside, other=0).to(tl.int64)
    live = inside & (dst > PADDING) & (dst < num_slots)
    if HAS_SRC:
        src = tl.load(src_ptr + idx, mask=inside, other=0).to(tl.int64)
        live = live & (src > PADDING) & (src < num_slots)
    return live, dst


@jit_batch_sized('capacity')
def _claim_kernel(
    src_ptr, dst_ptr,          # int32/int64 [capacity] slot lists (src unused without HAS_SRC)
    num_valid_ptr,             # int32 [1] (unused without HAS_NUM_VALID)
    winner_ptr,                # int32 [num_slots] election scratch
    slot_counter_ptr, kernel_counter_ptr,   # int64 [1] each (unused without the COUNT_* flags)
    capacity, num_slots,
    HAS_SRC: tl.constexpr, HAS_NUM_VALID: tl.constexpr,
    COUNT_SLOTS: tl.constexpr, COUNT_KERNEL: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if COUNT_KERNEL:
        if pid == 0:
            tl.store(kernel_counter_ptr, tl.load(kernel_counter_ptr) + 1)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    live, dst = _live_entries(src_ptr, dst_ptr, num_valid_ptr, idx, capacity, num_slots, HAS_SRC, HAS_NUM_VALID)
    tl.store(winner_ptr + dst, tl.full([BLOCK], -1, tl.int32), mask=live)
    if COUNT_SLOTS:
        k = tl.sum(live.to(tl.int64), 0)
        if k > 0:
            tl.atomic_add(slot_counter_ptr, k)


@jit_batch_sized('capacity')
def _elect_kernel(src_ptr, dst_ptr, num_valid_ptr, winner_ptr, capacity, num_slots,
                  HAS_SRC: tl.constexpr, HAS_NUM_VALID: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live, dst = _live_entries(src_ptr, dst_ptr, num_valid_ptr, idx, capacity, num_slots, HAS_SRC, HAS_NUM_VALID)
    tl.atomic_max(winner_ptr + dst, idx, mask=live)


@triton.jit
def _gather_one(fields_ptr, words, slot, live, out_rows, out_mask):
    """out_rows[:, 0:4] = fields[slot, 0:4] where live, 0 elsewhere."""
    cols = tl.arange(0, FIELDS)
    rec = tl.load(fields_ptr + slot[:, None] * words + cols[None, :], mask=live[:, None], other=0)
    tl.store(out_rows + cols[None, :], rec, mask=out_mask[:, None])


@jit_batch_sized('capacity')
def _gather_kernel(
    slot_ptr,                  # int32/int64 [capacity]: the rows to read
    num_valid_ptr, capacity, num_slots,
    out_ptr, out_words,        # int64 [capacity, out_words]: table t of the launch -> columns 4t..4t+3
    b0, w0, b1, w1, b2, w2, b3, w3,   # int64 views of up to four tables and their row widths in words
    NBUF: tl.constexpr, HAS_NUM_VALID: tl.constexpr, BLOCK: tl.constexpr,
):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < _entry_count(num_valid_ptr, capacity, HAS_NUM_VALID)
    slot = tl.load(slot_ptr + idx, mask=inside, other=0).to(tl.int64)
    live = inside & (slot > PADDING) & (slot < num_slots)
    rows = out_ptr + idx.to(tl.int64)[:, None] * out_words
    m = idx < capacity
    _gather_one(b0, w0, slot, live, rows, m)
    if NBUF > 1:
        _gather_one(b1, w1, slot, live, rows + FIELDS, m)
    if NBUF > 2:
        _gather_one(b2, w2, slot, live, rows + 2 * FIELDS, m)
    if NBUF > 3:
        _gather_one(b3, w3, slot, live, rows + 3 * FIELDS, m)


@triton.jit
def _scatter_one(fields_ptr, words, dst, win, in_rows):
    """fields[dst, 0:4] = in_rows[:, 0:4] where win."""
    cols = tl.arange(0, FIELDS)
    rec = tl.load(in_rows + cols[None, :], mask=win[:, None], other=0)
    tl.store(fields_ptr + dst[:, None] * words + cols[None, :], rec, mask=win[:, None])


@jit_batch_sized('capacity')
def _scatter_kernel(
    src_ptr, dst_ptr, num_valid_ptr, winner_ptr, capacity, num_slots,
    in_ptr, in_words,          # int64 [capacity, in_words]: entry i's rows, table t at columns 4t..4t+3
    b0, w0, b1, w1, b2, w2, b3, w3,
    NBUF: tl.constexpr, HAS_SRC: tl.constexpr, HAS_NUM_VALID: tl.constexpr, BLOCK: tl.constexpr,
):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live, dst = _live_entries(src_ptr, dst_ptr, num_valid_ptr, idx, capacity, num_slots, HAS_SRC, HAS_NUM_VALID)
    win = live & (tl.load(winner_ptr + dst, mask=live, other=-1) == idx)
    rows = in_ptr + idx.to(tl.int64)[:, None] * in_words
    _scatter_one(b0, w0, dst, win, rows)
    if NBUF > 1:
        _scatter_one(b1, w1, dst, win, rows + FIELDS)
    if NBUF > 2:
        _scatter_one(b2, w2, dst, win, rows + 2 * FIELDS)
    if NBUF > 3:
        _scatter_one(b3, w3, dst, win, rows + 3 * FIELDS)


# ----------------------------------------------------------------------------- host side


def _table_args(fields: Sequence[torch.Tensor]) -> tuple[tuple, int]:
    """(b0, w0, ..., b3, w3) for up to four int64 tables (unused pairs repeat the first), NBUF."""
    args: list = []
    for t in range(TABLES_PER_LAUNCH):
        f = fields[t] if t < len(fields) else fields[0]
        args += [f, f.stride(0)]
    return tuple(args), len(fields)


def _chunks(fields: Sequence[torch.Tensor]) -> list[Sequence[torch.Tensor]]:
    return [fields[i : i + TABLES_PER_LAUNCH] for i in range(0, len(fields), TABLES_PER_LAUNCH)]


def _grid(capacity: int) -> tuple[int]:
    return (max(1, triton.cdiv(capacity, BLOCK)),)


def _elect(*, src, dst, num_valid, slot_run_counter, kernel_run_counter, num_slots: int) -> torch.Tensor:
    """Launch claim + elect; returns the winner scratch."""
    capacity = dst.shape[0]
    has_src = src is not None
    src_arg = src if has_src else dst
    nv_arg = num_valid if num_valid is not None else dst
    winner = torch.empty(max(num_slots, 1), dtype=torch.int32, device=dst.device)
    grid = _grid(capacity)
    _claim_kernel[grid](
        src_arg, dst, nv_arg, winner,
        slot_run_counter if slot_run_counter is not None else winner,
        kernel_run_counter if kernel_run_counter is not None else winner,
        capacity, num_slots,
        HAS_SRC=has_src, HAS_NUM_VALID=num_valid is not None,
        COUNT_SLOTS=slot_run_counter is not None, COUNT_KERNEL=kernel_run_counter is not None,
        BLOCK=BLOCK, num_warps=4,
    )
    if capacity:
        _elect_kernel[grid](
            src_arg, dst, nv_arg, winner, capacity, num_slots,
            HAS_SRC=has_src, HAS_NUM_VALID=num_valid is not None, BLOCK=BLOCK, num_warps=4,
        )
    return winner


def launch_copy_slots(
    *,
    canary_bufs: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    num_valid: Optional[torch.Tensor] = None,
    slot_run_counter: Optional[torch.Tensor] = None,
    kernel_run_counter: Optional[torch.Tensor] = None,
) -> None:
    """Triton twin of ``canary_copy_slots_torch_reference`` (arguments already checked: contiguous
    slot lists of equal length, tables on one device with equal slot counts, no overlap)."""
    fields = [record_fields(t, name=f"canary_bufs[{i}]") for i, t in enumerate(canary_bufs)]
    num_slots = int(fields[0].shape[0])
    capacity = int(dst_slots.shape[0])
    winner = _elect(src=src_slots, dst=dst_slots, num_valid=num_valid, slot_run_counter=slot_run_counter,
                    kernel_run_counter=kernel_run_counter, num_slots=num_slots)
    if capacity == 0:
        return
    grid = _grid(capacity)
    nv_arg = num_valid if num_valid is not None else dst_slots
    width = _F * min(len(fields), TABLES_PER_LAUNCH)
    scratch = torch.empty(capacity, width, dtype=torch.int64, device=dst_slots.device)
    for chunk in _chunks(fields):
        tables, nbuf = _table_args(chunk)
        _gather_kernel[grid](
            src_slots, nv_arg, capacity, num_slots, scratch, width, *tables,
            NBUF=nbuf, HAS_NUM_VALID=num_valid is not None, BLOCK=BLOCK, num_warps=4,
        )
        _scatter_kernel[grid](
            src_slots, dst_slots, nv_arg, winner, capacity, num_slots, scratch, width, *tables,
            NBUF=nbuf, HAS_SRC=True, HAS_NUM_VALID=num_valid is not None, BLOCK=BLOCK, num_warps=4,
        )


def launch_export_records(
    *, canary_bufs: Sequence[torch.Tensor], slots: torch.Tensor, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Triton twin of ``export_canary_records_torch_reference`` (arguments already checked;
    ``out``, when given, is a contiguous int64 tensor of the export's shape on the device)."""
    fields = [record_fields(t, name=f"canary_bufs[{i}]") for i, t in enumerate(canary_bufs)]
    num_slots = int(fields[0].shape[0])
    n = int(slots.shape[0])
    records = out if out is not None else torch.empty(
        canary_records_shape(n, len(fields)), dtype=torch.int64, device=slots.device
    )
    write_canary_records_header(records, num_records=n, num_buffers=len(fields))
    if n == 0:
        return records
    payload = records[CANARY_RECORDS_HEADER_ROWS:]
    for c, chunk in enumerate(_chunks(fields)):
        tables, nbuf = _table_args(chunk)
        _gather_kernel[_grid(n)](
            slots, slots, n, num_slots, payload[:, _F * TABLES_PER_LAUNCH * c :], payload.stride(0), *tables,
            NBUF=nbuf, HAS_NUM_VALID=False, BLOCK=BLOCK, num_warps=4,
        )
    return records


def launch_import_records(
    *,
    canary_bufs: Sequence[torch.Tensor],
    slots: torch.Tensor,
    records: torch.Tensor,
    slot_run_counter: Optional[torch.Tensor] = None,
    kernel_run_counter: Optional[torch.Tensor] = None,
) -> None:
    """Triton twin of ``import_canary_records_torch_reference`` (records' header already checked,
    records already on the tables' device and contiguous)."""
    fields = [record_fields(t, name=f"canary_bufs[{i}]") for i, t in enumerate(canary_bufs)]
    num_slots = int(fields[0].shape[0])
    n = int(slots.shape[0])
    winner = _elect(src=None, dst=slots, num_valid=None, slot_run_counter=slot_run_counter,
                    kernel_run_counter=kernel_run_counter, num_slots=num_slots)
    if n == 0:
        return
    payload = records[CANARY_RECORDS_HEADER_ROWS:]
    for c, chunk in enumerate(_chunks(fields)):
        tables, nbuf = _table_args(chunk)
        _scatter_kernel[_grid(n)](
            slots, slots, slots, winner, n, num_slots, payload[:, _F * TABLES_PER_LAUNCH * c :], payload.stride(0),
            *tables, NBUF=nbuf, HAS_SRC=False, HAS_NUM_VALID=False, BLOCK=BLOCK, num_warps=4,
        )
