"""Padding-read check (docs/design.md §3.12, *extension*): no live read through the padding slot.

The verify op skips every plan entry whose slot is the padding slot 0, and the chain link of the next position with
it (SGLang's contract, pinned by its op tests and the golden vectors). So a position a live request still reads
that the engine maps to the padding / null slot (a block table nulled too eagerly, a rollback that dropped window
entries, an unfilled table entry) is never checked. This check, beside the ops, reports every such read.

``launch_padding_read_check_kernel(*, req_pool_indices, prefix_lens, req_to_token, swa_window_size,
full_to_swa_index_mapping, violation_ring, violation_write_index, stamps, step, kernel_kind, ring_window=False,
shared_lens=None)``;
twin ``padding_read_check_torch_reference`` (same arguments, lenient). Contract:

* Batch row ``r`` with ``rp = req_pool_indices[r]`` and ``P = prefix_lens[r]`` is *live* when ``rp != 0`` and
  ``0 <= rp < req_to_token.shape[0]`` (a padding row of a padded batch, request row 0, is never read; a row
  outside the table is the plan's to refuse, or to plan as padding under capture).
* Its *read range*: positions ``[lo, min(P, w))`` with ``w = req_to_token.shape[1]``; ``lo = 0`` for full attention
  (``W = swa_window_size <= 0``), ``lo = max(P - W, 0)`` for a sliding window (the plan's window, docs/design.md
  §3.5), ``lo = max(P - W + 1, 0)`` with ``ring_window`` (a ring of ``W`` slots: the forward's first token
  overwrites position ``P - W``'s slot, so no query reads it). With ``shared_lens`` (int [bs],
  `BatchDescription.shared_lens`) a window starts ``shared_lens[r]`` positions later: the row's first
  ``shared_lens[r]`` extend tokens are computed by another row of the forward, its own first query sits at
  ``P + shared_lens[r]``. Positions before ``lo`` (a window no longer reads them; an engine may null them) and at or
  past ``P`` (computed by this forward, not read from the cache) are not judged.
* ``T(x)``: ``x`` without a LUT; with ``full_to_swa_index_mapping``, negative values pass through, values in
  ``[0, len)`` are looked up and values at or past the end give -1 (the plan reports those).
* A *hole*: a read position with ``T(req_to_token[rp, pos]) == 0``. Each hole appends the ring row ``[kernel_kind,
  0, pos, 0, -1, 0, req_to_token[rp, pos], VERIFY_PADDING_SLOT_READ]`` (fields of docs/design.md §3.1; EXPECTED_AUX
  holds the raw table entry) and its stamp ``(step[0], r, pos)`` at the same ring index: rows in batch-row then
  position order (the Triton kernel may interleave rows of different position blocks), fill-once (docs/design.md
  §3.4: ``violation_write_index`` grows by the full count; rows and stamps past the capacity are not stored).
* Mutates only the ring rows and stamps it appends and ``violation_write_index``. No counters.

The launcher checks types, dtypes, shapes and devices (``kv-canary:`` TypeError / ValueError, nothing touched),
then runs the Triton kernel on CUDA (no host reads, grid from shapes: capturable) or the twin.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.checks import INDEX_DTYPES, check_tensor
from kvcanary.ops.constants import STAMP_FIELDS, VIOLATION_FIELDS
from kvcanary.ops.dispatch import triton_backend
from kvcanary.ops.reference.padding_reads import padding_read_check_torch_reference

_OP = "launch_padding_read_check_kernel"


def _check_args(*, req_pool_indices, prefix_lens, req_to_token, swa_window_size, full_to_swa_index_mapping,
                violation_ring, violation_write_index, stamps, step, kernel_kind, ring_window, shared_lens) -> None:
    dev = check_tensor(_OP, "req_to_token", req_to_token, dtypes=INDEX_DTYPES, ndim=2).device
    rows = check_tensor(_OP, "req_pool_indices", req_pool_indices, dtypes=INDEX_DTYPES, ndim=1, device=dev,
                        contiguous=True)
    prefix = check_tensor(_OP, "prefix_lens", prefix_lens, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
    if prefix.shape[0] != rows.shape[0]:
        raise KvCanaryValueError(
            f"kv-canary: {_OP} prefix_lens has {prefix.shape[0]} rows, req_pool_indices has {rows.shape[0]}")
    if shared_lens is not None:
        shared = check_tensor(_OP, "shared_lens", shared_lens, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
        if shared.shape[0] != rows.shape[0]:
            raise KvCanaryValueError(
                f"kv-canary: {_OP} shared_lens has {shared.shape[0]} rows, req_pool_indices has {rows.shape[0]}")
    if full_to_swa_index_mapping is not None:
        check_tensor(_OP, "full_to_swa_index_mapping", full_to_swa_index_mapping, dtypes=(torch.int64,), ndim=1,
                     device=dev, contiguous=True)
    ring = check_tensor(_OP, "violation_ring", violation_ring, dtypes=(torch.int64,), ndim=2, device=dev,
                        contiguous=True)
    if ring.shape[1] != VIOLATION_FIELDS:
        raise KvCanaryValueError(f"kv-canary: {_OP} violation_ring must be int64 [cap, {VIOLATION_FIELDS}], "
                                 f"got shape {tuple(ring.shape)}")
    check_tensor(_OP, "violation_write_index", violation_write_index, dtypes=(torch.int32,), numel=1, device=dev)
    out = check_tensor(_OP, "stamps", stamps, dtypes=(torch.int64,), ndim=2, device=dev, contiguous=True)
    if tuple(out.shape) != (ring.shape[0], STAMP_FIELDS):
        raise KvCanaryValueError(f"kv-canary: {_OP} stamps must be int64 [cap, {STAMP_FIELDS}] with the ring's "
                                 f"cap={ring.shape[0]}, got shape {tuple(out.shape)}")
    check_tensor(_OP, "step", step, dtypes=(torch.int64,), numel=1, device=dev)
    for name, value in (("swa_window_size", swa_window_size), ("kernel_kind", kernel_kind)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise KvCanaryTypeError(f"kv-canary: {_OP} {name} must be an int, got {type(value).__name__}")
    if not isinstance(ring_window, bool):
        raise KvCanaryTypeError(f"kv-canary: {_OP} ring_window must be a bool, got {type(ring_window).__name__}")


def launch_padding_read_check_kernel(
    *,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
    full_to_swa_index_mapping: Optional[torch.Tensor],
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    stamps: torch.Tensor,
    step: torch.Tensor,
    kernel_kind: int,
    ring_window: bool = False,
    shared_lens: Optional[torch.Tensor] = None,
) -> None:
    """Report every read of a live row through the padding slot (contract in the module docstring). Mutates only
    the appended ring rows and stamps and ``violation_write_index``; every error (``kv-canary:`` TypeError /
    ValueError) is raised before anything changes."""
    kwargs = dict(
        req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, req_to_token=req_to_token,
        swa_window_size=swa_window_size, full_to_swa_index_mapping=full_to_swa_index_mapping,
        violation_ring=violation_ring, violation_write_index=violation_write_index, stamps=stamps, step=step,
        kernel_kind=kernel_kind, ring_window=ring_window, shared_lens=shared_lens,
    )
    _check_args(**kwargs)
    kwargs["kernel_kind"] = int(kernel_kind)
    backend = triton_backend(req_to_token.device)
    impl = backend.launch_padding_read_check if backend else padding_read_check_torch_reference
    impl(**kwargs)
