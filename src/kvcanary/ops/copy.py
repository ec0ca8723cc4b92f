"""Moving canary records with the KV they describe: copy between slots, export, import.

Engines copy KV (fork and copy-on-write, offload and restore, prefill -> decode transfer); the
records must move with it or the next verify reports the copy as corruption. A record is
slot-independent (its chain link hashes the predecessor's *record*, its fingerprint the KV
*bytes*), so moving the four fields verbatim keeps a chain valid once every slot of the chain
has moved with its KV.

Contract (the twins in ``ops/reference/copy.py`` implement exactly this; the Triton kernels in
``ops/triton/copy.py`` give the same bytes):

* **Record tables.** ``canary_bufs`` is a tuple of one group's tables: canary buffers (uint8
  ``[num_slots, stride_bytes]``, docs/design.md §3.3) and, if the caller likes, any other slot-indexed
  int64 ``[num_slots, >= 4]`` table (e.g. runtime slot records kept as one table; words that
  name slots, such as a predecessor slot, move unchanged: remapping them is the caller's job).
  Only the first four int64 words (32 bytes) of a row are read or written; bytes past them are
  never touched. All tables of a launch have the same ``num_slots``, live on one device and do
  not overlap (column slices of one row-strided allocation are fine).
* **Padding.** An entry whose slot (either slot, for a copy) is ``<= 0`` is skipped: neither read,
  written nor counted. Slot 0 is the padding slot (``TOKEN_TO_KV_SLOT_PADDING``) and is never
  written. An export row for a padding slot is all zeros; the import judges padding by its own
  ``slots`` only, so a live receiver slot takes the row as sent (zeros included).
* **Aliasing.** Gather all, then scatter: every source row is read as it stood before the launch,
  so in one launch ``a -> b, b -> c`` moves a's record to b and b's *old* record to c, and
  ``a -> b, b -> a`` swaps.
* **Duplicate destinations.** The last entry naming a destination wins (also on the GPU).
* **Out of range.** A slot ``>= num_slots`` among the entries read raises
  ``ValueError("kv-canary: {op} {name}[{i}]={slot} is out of range for tables of {num_slots} slots")``
  from the public launcher before anything changes (a host read of the slot lists, which on CUDA
  waits for the stream; skipped while the current stream is capturing a graph, where the kernels
  treat such entries as padding and never store out of bounds). The twins may raise IndexError.
* **Counts on the device.** ``num_valid`` (int32 [1], optional) caps the entries read at
  ``clamp(num_valid[0], 0, len)`` (CUDA-graph padding); entries past it are never read. Optional
  counters (int64 [1], may be views of larger arrays): ``kernel_run_counter += 1`` first,
  ``slot_run_counter +=`` the entries copied (live entries; a destination named twice counts
  twice). The import takes the same counters.
* **Capture.** The copy and the export run inside CUDA-graph capture (no host reads on the Triton
  path; the export's result is allocated from the capture's pool). The import reads the records'
  header on the host, so it is not capturable.

The export layout (a header with magic, version, slot and table counts, then one row per slot)
is documented in ``ops/copy_format.py``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.checks import INDEX_DTYPES, check_tensor
from kvcanary.ops.copy_format import canary_records_shape, check_canary_records
from kvcanary.ops.dispatch import triton_backend
from kvcanary.ops.reference.copy import (
    canary_copy_slots_torch_reference,
    entry_count,
    export_canary_records_torch_reference,
    import_canary_records_torch_reference,
    record_fields,
)

_COPY = "launch_canary_copy_slots_kernel"
_EXPORT = "export_canary_records"
_IMPORT = "import_canary_records"
_MAX_ENTRIES = 2**31 - 1  # entry indices are elected as int32 on the GPU


def launch_canary_copy_slots_kernel(
    *,
    canary_bufs: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    num_valid: Optional[torch.Tensor] = None,
    slot_run_counter: Optional[torch.Tensor] = None,
    kernel_run_counter: Optional[torch.Tensor] = None,
) -> None:
    """Copy the record of ``src_slots[i]`` to ``dst_slots[i]`` in every table of ``canary_bufs``.

    src_slots, dst_slots: int32 or int64 [N], contiguous, same length. num_valid: int32 [1] or
    None (all N). Mutates: the first 32 bytes of destination rows; the counters. Semantics,
    padding, aliasing and errors: see the module docstring. Every error of this launcher
    (arguments, out-of-range slots) is raised before anything changes: when it raises, no counter
    has moved. (The twin alone, called directly, may raise IndexError after
    ``kernel_run_counter`` moved.)
    """
    dev, num_slots = _check_tables(_COPY, canary_bufs)
    src = check_tensor(_COPY, "src_slots", src_slots, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
    dst = check_tensor(_COPY, "dst_slots", dst_slots, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
    if src.shape[0] != dst.shape[0]:
        raise KvCanaryValueError(f"kv-canary: {_COPY} src_slots has {src.shape[0]} entries, dst_slots has {dst.shape[0]}")
    _check_entries(_COPY, dst.shape[0])
    if num_valid is not None:
        check_tensor(_COPY, "num_valid", num_valid, dtypes=(torch.int32,), numel=1, device=dev)
    _check_counters(_COPY, dev, slot_run_counter, kernel_run_counter)
    if not _capturing(dev):
        n = entry_count(num_valid, int(dst.shape[0]))
        _check_range(_COPY, "src_slots", src[:n], num_slots)
        _check_range(_COPY, "dst_slots", dst[:n], num_slots)
    impl = canary_copy_slots_torch_reference
    if triton_backend(dev) is not None:
        from kvcanary.ops.triton.copy import launch_copy_slots as impl
    impl(canary_bufs=tuple(canary_bufs), src_slots=src, dst_slots=dst, num_valid=num_valid,
         slot_run_counter=slot_run_counter, kernel_run_counter=kernel_run_counter)


def export_canary_records(
    *, canary_bufs: Sequence[torch.Tensor], slots: torch.Tensor, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The records of ``slots`` from every table, as int64 [1 + N, 4 * len(canary_bufs)] on the
    tables' device (layout: ``ops/copy_format.py``; padding slots give zero rows).

    slots: int32 or int64 [N], contiguous. out: optional caller-owned int64 tensor of exactly
    that shape, contiguous, on the tables' device (reusing one saves the page faults of a fresh
    allocation, and keeps a captured graph's output in place); returned when given. Reads the
    tables only; move the result to the host with ``.to("cpu", non_blocking=True)`` or
    ``canary_records_to_bytes``.
    """
    dev, num_slots = _check_tables(_EXPORT, canary_bufs)
    s = check_tensor(_EXPORT, "slots", slots, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
    _check_entries(_EXPORT, s.shape[0])
    if out is not None:
        check_tensor(_EXPORT, "out", out, dtypes=(torch.int64,), ndim=2, device=dev, contiguous=True)
        want = canary_records_shape(int(s.shape[0]), len(canary_bufs))
        if tuple(out.shape) != want:
            raise KvCanaryValueError(f"kv-canary: {_EXPORT} out must have shape {want}, got {tuple(out.shape)}")
    if not _capturing(dev):
        _check_range(_EXPORT, "slots", s, num_slots)
    impl = export_canary_records_torch_reference
    if triton_backend(dev) is not None:
        from kvcanary.ops.triton.copy import launch_export_records as impl
    return impl(canary_bufs=tuple(canary_bufs), slots=s, out=out)


def import_canary_records(
    *,
    canary_bufs: Sequence[torch.Tensor],
    slots: torch.Tensor,
    records: torch.Tensor,
    slot_run_counter: Optional[torch.Tensor] = None,
    kernel_run_counter: Optional[torch.Tensor] = None,
) -> None:
    """Install an export: row ``1 + i`` of ``records`` into slot ``slots[i]`` of every table.

    slots: int32 or int64 [N], contiguous, in the receiver's slot space (need not equal the
    sender's). records: as ``export_canary_records`` returns, on the host or the tables' device;
    its header must match (magic, version, N, number of tables) or it is rejected (ValueError)
    before anything changes. Padding and duplicate rules as the copy; mutates the first 32
    bytes of the imported rows and the counters. Reads the header on the host: not capturable.
    Every error is raised before anything changes: when it raises, no counter has moved.
    Afterwards, verify the imported slots against the destination's real KV (a TAIL verify).
    """
    dev, num_slots = _check_tables(_IMPORT, canary_bufs)
    s = check_tensor(_IMPORT, "slots", slots, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
    _check_entries(_IMPORT, s.shape[0])
    if isinstance(records, torch.Tensor) and records.device not in (dev, torch.device("cpu")):
        raise KvCanaryValueError(f"kv-canary: {_IMPORT} records is on {records.device}, expected cpu or {dev}")
    check_canary_records(_IMPORT, records, num_records=int(s.shape[0]), num_buffers=len(canary_bufs))
    _check_counters(_IMPORT, dev, slot_run_counter, kernel_run_counter)
    _check_range(_IMPORT, "slots", s, num_slots)
    records = records.to(dev, non_blocking=records.is_pinned()).contiguous()
    impl = import_canary_records_torch_reference
    if triton_backend(dev) is not None:
        from kvcanary.ops.triton.copy import launch_import_records as impl
    impl(canary_bufs=tuple(canary_bufs), slots=s, records=records,
         slot_run_counter=slot_run_counter, kernel_run_counter=kernel_run_counter)


# ----------------------------------------------------------------------------- checks


def _check_tables(op: str, tables: object) -> tuple[torch.device, int]:
    """Check the record tables; returns (device, num_slots)."""
    if not isinstance(tables, (tuple, list)) or not tables:
        raise KvCanaryTypeError(f"kv-canary: {op} canary_bufs must be a non-empty tuple of tensors, got {type(tables).__name__}")
    dev = num_slots = None
    spans = []
    for i, t in enumerate(tables):
        name = f"canary_bufs[{i}]"
        check_tensor(op, name, t, dtypes=(torch.uint8, torch.int64), ndim=2, device=dev)
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise KvCanaryValueError(f"kv-canary: {op} {name} rows must be contiguous, got strides {tuple(t.stride())}")
        if (t.stride(0) * t.element_size()) % 8 or t.data_ptr() % 8:
            raise KvCanaryValueError(
                f"kv-canary: {op} {name} rows must start on 8-byte boundaries, got row stride "
                f"{t.stride(0) * t.element_size()} bytes"
            )
        record_fields(t, name=f"{op} {name}")
        if dev is None:
            dev, num_slots = t.device, int(t.shape[0])
        elif t.shape[0] != num_slots:
            raise KvCanaryValueError(f"kv-canary: {op} {name} has {t.shape[0]} slots, canary_bufs[0] has {num_slots}")
        spans.append(_byte_span(t))
    for b in range(len(spans)):
        for a in range(b):
            if _overlap(spans[a], spans[b]):
                raise KvCanaryValueError(f"kv-canary: {op} canary_bufs[{a}] and canary_bufs[{b}] overlap in memory")
    return dev, num_slots


def _byte_span(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(first byte, end byte, row stride, row width) of a row-strided 2-D table, in bytes."""
    es = t.element_size()
    start = t.data_ptr()
    end = start + ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * es if t.numel() else start
    return start, end, t.stride(0) * es, t.shape[1] * es


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    """Whether two tables may share a byte. Exact for disjoint extents and for column slices of
    one row-strided allocation (same stride: rows interleave, columns decide); else conservative."""
    a0, a1, sa, wa = a
    b0, b1, sb, wb = b
    if a1 <= b0 or b1 <= a0 or a0 == a1 or b0 == b1:
        return False
    if sa != sb or wa > sa or wb > sb:
        return True
    lo = (b0 - a0) % sa  # b's columns, relative to a's row start, on a circle of one row
    return lo < wa or lo + wb > sa


def _check_entries(op: str, n: int) -> None:
    if n > _MAX_ENTRIES:
        raise KvCanaryValueError(f"kv-canary: {op} supports at most {_MAX_ENTRIES} entries per launch, got {n}")


def _check_counters(op: str, dev: torch.device, slot_run_counter, kernel_run_counter) -> None:
    for name, c in (("slot_run_counter", slot_run_counter), ("kernel_run_counter", kernel_run_counter)):
        if c is not None:
            check_tensor(op, name, c, dtypes=(torch.int64,), numel=1, device=dev)


def _check_range(op: str, name: str, slots: torch.Tensor, num_slots: int) -> None:
    """ValueError naming the first entry whose slot is >= num_slots (a host read)."""
    bad = slots >= num_slots
    if slots.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise KvCanaryValueError(
            f"kv-canary: {op} {name}[{i}]={int(slots[i])} is out of range for tables of {num_slots} slots"
        )


def _capturing(dev: torch.device) -> bool:
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
