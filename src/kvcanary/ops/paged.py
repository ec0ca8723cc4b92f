"""Paged-KV bookkeeping ops (docs/design.md §3.10): launchers with checks.

An adapter of a paged engine turns the block table attention reads into the canary's position -> slot table
(`launch_block_table_slots_kernel`) and counts slots written again after their block was freed
(`launch_mark_written_slots_kernel`). Neither reads a device value on the host (no check of row ranges: a row
outside the table writes nothing), so both run inside a CUDA-graph capture and never wait for the engine's stream.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.dispatch import triton_backend
from kvcanary.ops.reference.paged import block_table_slots_torch_reference, mark_written_slots_torch_reference

_INTS = (torch.int32, torch.int64)


def _check(op: str, device: torch.device, **tensors) -> None:
    for name, (t, ndim, dtypes) in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise KvCanaryTypeError(f"kv-canary: {op} {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise KvCanaryValueError(f"kv-canary: {op} {name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise KvCanaryTypeError(f"kv-canary: {op} {name} must be {' or '.join(str(d)[6:] for d in dtypes)}, "
                                    f"got {t.dtype}")
        if t.device != device:
            raise KvCanaryValueError(f"kv-canary: {op} {name} is on {t.device}, expected {device}")
        if t.dim() == 2 and t.stride(1) != 1:
            raise KvCanaryValueError(f"kv-canary: {op} {name} must have unit column stride, got {t.stride()}")


def launch_block_table_slots_kernel(*, block_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                                    block_size: int, width: Optional[int], table_out: torch.Tensor,
                                    drop_null: bool = False) -> None:
    """``table_out[rows[r], p] = block_table[r, p // block_size] * block_size + p % block_size`` for ``p < seq_lens[r]``,
    0 for ``seq_lens[r] <= p < width`` (and, with ``drop_null``, where the block is 0: the null block of an engine
    that drops blocks behind a sliding window). ``width=None``: only the positions ``p < seq_lens[r]`` are written
    (the columns past a row's length keep what they hold), with no host-known width: one program per row on CUDA,
    so a CUDA graph captured once serves any lengths (rows of length 0, e.g. padding rows, and rows past
    ``block_table``'s own read nothing: its row count may then be below ``rows``').

    block_table int32/int64 [>= bs, nblk] (kernel block ids; positions past ``nblk * block_size`` give 0); rows int64
    [bs] (distinct; one outside ``[0, table_out.shape[0])`` writes nothing); seq_lens int32/int64 [bs];
    table_out int32/int64 [max_reqs, >= width] (mutated, columns ``[0, width)`` of the given rows).
    """
    dev = table_out.device
    _check("block_table_slots", dev, block_table=(block_table, 2, _INTS), rows=(rows, 1, (torch.int64,)),
           seq_lens=(seq_lens, 1, _INTS), table_out=(table_out, 2, _INTS))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise KvCanaryValueError(f"kv-canary: block_table_slots block_size must be a positive int, got {block_size!r}")
    if width is not None and (isinstance(width, bool) or not isinstance(width, int)
                              or not 0 <= width <= table_out.shape[1]):
        raise KvCanaryValueError(f"kv-canary: block_table_slots width must be None or an int in "
                                 f"[0, {table_out.shape[1]}], got {width!r}")
    bs = int(rows.shape[0])
    if seq_lens.shape[0] < bs or (block_table.shape[0] < bs and width is not None):
        raise KvCanaryValueError(f"kv-canary: block_table_slots needs {bs} rows of seq_lens and block_table, got "
                                 f"{seq_lens.shape[0]} and {block_table.shape[0]}")
    backend = triton_backend(dev)
    impl = backend.launch_block_table_slots if backend else block_table_slots_torch_reference
    impl(block_table=block_table, rows=rows, seq_lens=seq_lens, block_size=block_size, width=width,
         drop_null=bool(drop_null), table_out=table_out)


def launch_mark_written_slots_kernel(*, slots: torch.Tensor, ever_written: torch.Tensor, rewritten: torch.Tensor) -> None:
    """For each slot ``s`` of ``slots`` in ``[0, len(ever_written))``: ``rewritten += ever_written[s]``, then
    ``ever_written[s] = 1`` (negative entries, not stored, are skipped).

    slots int32/int64 [n] (valid entries distinct); ever_written uint8 [num_slots] (mutated); rewritten int64 [1]
    (mutated, accumulates).
    """
    dev = ever_written.device
    _check("mark_written_slots", dev, slots=(slots, 1, _INTS), ever_written=(ever_written, 1, (torch.uint8,)),
           rewritten=(rewritten, 1, (torch.int64,)))
    if rewritten.shape[0] != 1:
        raise KvCanaryValueError(f"kv-canary: mark_written_slots rewritten must hold one counter, got {tuple(rewritten.shape)}")
    backend = triton_backend(dev)
    impl = backend.launch_mark_written if backend else mark_written_slots_torch_reference
    impl(slots=slots, ever_written=ever_written, rewritten=rewritten)
