"""The exported canary-record layout: what ``export_canary_records`` returns and
``import_canary_records`` accepts (a header row, then one row per slot).

Layout (version 1), an int64 tensor ``records`` of shape ``[1 + n, 4 * B]`` for ``n`` slots and
``B`` record tables (canary buffers), row-major:

* row 0, the header: ``[CANARY_RECORDS_MAGIC, CANARY_RECORDS_VERSION, n, B, 0, ...]``;
* row ``1 + i``, slot ``slots[i]``: columns ``[4 * b, 4 * b + 4)`` hold table ``b``'s four record
  fields (TOKEN, POSITION, PREV_HASH, REAL_KV_HASH, docs/design.md §3.1) in the order the caller passed
  the tables; all zero when ``slots[i]`` is padding (``<= 0``).

As bytes (a file, a socket, host memory beside the KV blocks): the same tensor as little-endian
int64, row-major, ``32 * B * (1 + n)`` bytes; the first eight bytes spell ``KVCANARY``, so a
dump is recognisable and a receiver of another byte order fails the magic check instead of
importing garbage.
"""
from __future__ import annotations

import numpy as np
import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.constants import CANARY_FIELDS_PER_SLOT, MASK64

CANARY_RECORDS_MAGIC = int.from_bytes(b"KVCANARY", "little")
"""Header word 0: the bytes ``KVCANARY`` read as a little-endian int64 (0x5952414E4143564B)."""
CANARY_RECORDS_VERSION = 1
"""Header word 1: bumped whenever the layout above changes."""
CANARY_RECORDS_HEADER_ROWS = 1

_HEADER_WORDS = 4
_LE_INT64 = np.dtype("<i8")


def canary_records_shape(num_records: int, num_buffers: int) -> tuple[int, int]:
    """Shape of an export of ``num_records`` slots from ``num_buffers`` tables."""
    return (CANARY_RECORDS_HEADER_ROWS + num_records, CANARY_FIELDS_PER_SLOT * num_buffers)


def write_canary_records_header(records: torch.Tensor, *, num_records: int, num_buffers: int) -> None:
    """Fill row 0 of ``records`` (any device) with the header; scalar fills only, so it may run
    inside CUDA-graph capture."""
    header = records[0]
    header.zero_()
    for col, value in enumerate((CANARY_RECORDS_MAGIC, CANARY_RECORDS_VERSION, num_records, num_buffers)):
        header[col].fill_(value)


def check_canary_records(op: str, records: object, *, num_records: int, num_buffers: int) -> None:
    """Reject a records tensor whose layout does not match the receiver's slots and tables.

    Reads the header (a host read when ``records`` lives on a device). TypeError for a non-int64
    tensor, ValueError otherwise; every message starts with ``kv-canary:``.
    """
    if not isinstance(records, torch.Tensor):
        raise KvCanaryTypeError(f"kv-canary: {op} records must be a torch.Tensor, got {type(records).__name__}")
    if records.dtype != torch.int64:
        raise KvCanaryTypeError(f"kv-canary: {op} records must be torch.int64, got {records.dtype}")
    if records.dim() != 2 or records.shape[0] < 1 or records.shape[1] < _HEADER_WORDS:
        raise KvCanaryValueError(
            f"kv-canary: {op} records must be int64 [1 + n, 4 * num_buffers] with a header row, "
            f"got shape {tuple(records.shape)}"
        )
    magic, version, n, b = (int(v) for v in records[0, :_HEADER_WORDS].tolist())
    if magic != CANARY_RECORDS_MAGIC:
        raise KvCanaryValueError(
            f"kv-canary: {op} records header magic is 0x{magic & MASK64:016X}, expected "
            f"0x{CANARY_RECORDS_MAGIC:016X} (not a kvcanary record export, or another byte order)"
        )
    if version != CANARY_RECORDS_VERSION:
        raise KvCanaryValueError(
            f"kv-canary: {op} records layout version {version} is not supported "
            f"(this kvcanary reads version {CANARY_RECORDS_VERSION})"
        )
    if b != num_buffers:
        raise KvCanaryValueError(f"kv-canary: {op} records hold {b} table(s) per slot, canary_bufs has {num_buffers}")
    if n != num_records:
        raise KvCanaryValueError(f"kv-canary: {op} records hold {n} slot(s), slots has {num_records}")
    if tuple(records.shape) != canary_records_shape(n, b):
        raise KvCanaryValueError(
            f"kv-canary: {op} records shape {tuple(records.shape)} does not match its header "
            f"(n={n}, tables={b} -> {canary_records_shape(n, b)})"
        )


def canary_records_to_bytes(records: torch.Tensor) -> bytes:
    """The export as little-endian bytes (copies to the host)."""
    if not isinstance(records, torch.Tensor) or records.dtype != torch.int64 or records.dim() != 2:
        raise KvCanaryTypeError("kv-canary: canary_records_to_bytes needs the int64 [1 + n, 4 * B] tensor from export_canary_records")
    return records.detach().cpu().contiguous().numpy().astype(_LE_INT64, copy=False).tobytes()


def canary_records_from_bytes(data: bytes) -> torch.Tensor:
    """Parse bytes written by ``canary_records_to_bytes`` into a CPU int64 tensor [1 + n, 4 * B].

    Checks the magic, the version and the length against the header (ValueError); the import
    checks the slot and table counts against its own arguments.
    """
    op = "canary_records_from_bytes"
    if len(data) < 8 * _HEADER_WORDS or len(data) % 8:
        raise KvCanaryValueError(f"kv-canary: {op} needs a whole number of int64 words with a header, got {len(data)} bytes")
    words = np.frombuffer(data, dtype=_LE_INT64)
    magic, version, n, b = (int(v) for v in words[:_HEADER_WORDS])
    if magic != CANARY_RECORDS_MAGIC or version != CANARY_RECORDS_VERSION:
        # The common check words the error (magic first, then version).
        header = torch.tensor([[magic, version, n, b]], dtype=torch.int64)
        check_canary_records(op, header, num_records=n, num_buffers=b)
    if n < 0 or b < 1:
        raise KvCanaryValueError(f"kv-canary: {op} header has n={n}, tables={b}; need n >= 0 and tables >= 1")
    shape = canary_records_shape(n, b)
    if words.size != shape[0] * shape[1]:
        raise KvCanaryValueError(
            f"kv-canary: {op} got {len(data)} bytes, the header (n={n}, tables={b}) needs {8 * shape[0] * shape[1]}"
        )
    return torch.from_numpy(words.astype(np.int64).reshape(shape))
