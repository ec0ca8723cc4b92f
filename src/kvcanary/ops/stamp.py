"""Stamp op: after a step's launches under one launch tag, say beside each new ring row which
forward step, batch row and expected position it belongs to — so rows can be drained a step or
more later, when the plans that would tell have been overwritten (no host sync on the hot path).

``launch_stamp_violation_rows(*, violation_ring, violation_write_index, rows_from, stamps, step,
verify_plan=None, write_plan=None, out_cache_loc=None, positions=None, req_pool_indices=None,
prefix_lens=None, swa_window_size=0)``; twin ``stamp_violation_rows_torch_reference`` (same
arguments, lenient). Contract:

* ``violation_ring`` int64 [cap, 8], ``violation_write_index`` int32 [1]: one tag's ring and index
  as the step's launches left them. ``rows_from`` int32 [1]: that index before the step's first
  launch under the tag. ``stamps`` int64 [cap, 3] (output). ``step`` int64 [1].
* Stacked form: ``violation_ring`` int64 [k, cap, 8] (k >= 1), ``violation_write_index`` and
  ``rows_from`` int32 with k elements (contiguous), ``stamps`` int64 [k, cap, 3]; the plans and batch
  tensors are shared. Same as k single-ring calls, ring t with ``violation_ring[t]``,
  ``violation_write_index[t:t+1]``, ``rows_from[t:t+1]``, ``stamps[t]``.
* Rows stamped: ``j`` in ``[lo, hi)``, ``lo = clamp(rows_from, 0, cap)``, ``hi = clamp(write_index,
  0, cap)``: ``stamps[j] = (step[0], batch_row, expected_position)``. Every other stamp row and every
  other tensor keeps its bytes; nothing is read past ``hi``.
* A row is a *write row* iff its FAIL_REASON_BITS has WRITE_TOKEN_MISMATCH or
  WRITE_POSITION_MISMATCH, else a *verify row*. Rows are taken in ring order with two cursors
  (verify, write), both starting at -1.
* Verify row (needs ``verify_plan``, ``req_pool_indices``, ``prefix_lens``, else ``(step, -1, -1)``):
  entries ``[0, n)``, ``n = clamp(verify_num_valid, 0, capacity)`` (none if ``enable == 0``).
  ``fits(i)``: (the row's EXPECTED_TOKEN is -1 or ``verify_expected_tokens[i]`` equals it) and
  (``verify_expected_positions[i] != row.POSITION``) equals (the row has VERIFY_POSITION_MISMATCH) and
  (``verify_prev_slot_indices[i] == 0`` — unreachable, any expected chain — or (the predecessor is the
  chain head, ``< 0``) equals (the row's EXPECTED_AUX is H0)): among readers of one slot, a row that
  expected another chain than H0 is not charged to a reader whose predecessor is the chain head.
  Entry: the first ``i > cursor`` with ``verify_slot_indices[i] == row.SLOT_IDX`` and fits(i); else
  the first ``i > cursor`` with the slot; else the first ``i`` with the slot that fits; else the
  first with the slot. Found: cursor = i, ``batch_row`` = the row r whose verify range holds i
  (ranges in plan entry order, docs/design.md §3.5: row r < len(req_pool_indices) has
  ``0`` entries if ``req_pool_indices[r] == 0``, else ``max(P_r - lo_r, 0)`` with ``P_r = prefix_lens[r]``
  and ``lo_r = max(P_r - W, 0)`` if ``W = swa_window_size > 0``, else 0; -1 when no range holds i),
  ``expected_position = verify_expected_positions[i]``. Not found: ``(step, -1, -1)``.
* Write row (needs ``write_plan``, ``out_cache_loc``, ``positions``, flattened as the write launch saw
  them, else ``(step, -1, -1)``): entries ``[0, m)``, ``m = write_offsets[a]`` clamped to
  ``[0, min(len(out_cache_loc), len(positions))]``, ``a = clamp(write_num_valid_reqs, 0,
  len(write_seed_slot_indices))``. Entry: the first ``i > cursor`` with ``out_cache_loc[i] ==
  row.SLOT_IDX`` and ``positions[i] == row.POSITION``, else the first such ``i``. Found: cursor = i,
  ``batch_row`` = the largest ``r < a`` with ``write_offsets[r] <= i`` (-1 if none),
  ``expected_position = -1``. Not found: ``(step, -1, -1)``.
* Index and position arrays may be int32 or int64 (widened).

The launcher checks dtypes, shapes and devices first (``kv-canary:`` TypeError / ValueError,
nothing touched), then runs the Triton kernel on CUDA (one launch, one program per ring, grid from
shapes, no host reads: capturable) or the twin.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.checks import INDEX_DTYPES, check_tensor, check_verify_plan, check_write_plan
from kvcanary.ops.constants import STAMP_FIELDS, VIOLATION_FIELDS
from kvcanary.ops.dispatch import triton_backend
from kvcanary.ops.records import VerifyPlan, WritePlan
from kvcanary.ops.reference.stamp import stamp_violation_rows_torch_reference

_OP = "launch_stamp_violation_rows"


def _check_stamp_args(
    *, violation_ring, violation_write_index, rows_from, stamps, step, verify_plan, write_plan, out_cache_loc,
    positions, req_pool_indices, prefix_lens, swa_window_size,
) -> None:
    ring = check_tensor(_OP, "violation_ring", violation_ring, dtypes=(torch.int64,), contiguous=True)
    dev = ring.device
    if ring.dim() not in (2, 3) or ring.shape[-1] != VIOLATION_FIELDS or (ring.dim() == 3 and ring.shape[0] < 1):
        raise KvCanaryValueError(
            f"kv-canary: {_OP} violation_ring must be int64 [cap, 8] or [k, cap, 8] with k >= 1, "
            f"got shape {tuple(ring.shape)}"
        )
    k = ring.shape[0] if ring.dim() == 3 else None
    for name, t in (("violation_write_index", violation_write_index), ("rows_from", rows_from)):
        if k is None:
            check_tensor(_OP, name, t, dtypes=(torch.int32,), numel=1, device=dev)
            continue
        check_tensor(_OP, name, t, dtypes=(torch.int32,), device=dev, contiguous=True)
        if t.numel() != k:
            raise KvCanaryValueError(
                f"kv-canary: {_OP} {name} must hold exactly k={k} elements (one per ring of violation_ring "
                f"{tuple(ring.shape)}), got shape {tuple(t.shape)}"
            )
    check_tensor(_OP, "step", step, dtypes=(torch.int64,), numel=1, device=dev)
    cap = ring.shape[-2]
    if k is None:
        out = check_tensor(_OP, "stamps", stamps, dtypes=(torch.int64,), ndim=2, device=dev, contiguous=True)
        if tuple(out.shape) != (cap, STAMP_FIELDS):
            raise KvCanaryValueError(
                f"kv-canary: {_OP} stamps must be int64 [cap, {STAMP_FIELDS}] with the ring's cap={cap}, "
                f"got shape {tuple(out.shape)}"
            )
    else:
        out = check_tensor(_OP, "stamps", stamps, dtypes=(torch.int64,), device=dev, contiguous=True)
        if tuple(out.shape) != (k, cap, STAMP_FIELDS):
            raise KvCanaryValueError(
                f"kv-canary: {_OP} stamps must be int64 [k, cap, {STAMP_FIELDS}] = [{k}, {cap}, {STAMP_FIELDS}] "
                f"for violation_ring {tuple(ring.shape)}, got shape {tuple(out.shape)}"
            )
    if isinstance(swa_window_size, bool) or not isinstance(swa_window_size, int):
        raise KvCanaryTypeError(f"kv-canary: {_OP} swa_window_size must be an int, got {type(swa_window_size).__name__}")
    if verify_plan is not None:
        check_verify_plan(_OP, verify_plan, dev)
        if req_pool_indices is None or prefix_lens is None:
            raise KvCanaryValueError(f"kv-canary: {_OP} needs req_pool_indices and prefix_lens with verify_plan")
    if write_plan is not None:
        check_write_plan(_OP, write_plan, dev)
        if out_cache_loc is None or positions is None:
            raise KvCanaryValueError(f"kv-canary: {_OP} needs out_cache_loc and positions with write_plan")
    lengths = {}
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("out_cache_loc", out_cache_loc), ("positions", positions)):
        if t is not None:
            lengths[name] = check_tensor(_OP, name, t, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True).shape[0]
    for a, b in (("req_pool_indices", "prefix_lens"), ("out_cache_loc", "positions")):
        if a in lengths and b in lengths and lengths[a] != lengths[b]:
            raise KvCanaryValueError(f"kv-canary: {_OP} {b} has {lengths[b]} entries, {a} has {lengths[a]}")


def launch_stamp_violation_rows(
    *,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    rows_from: torch.Tensor,
    stamps: torch.Tensor,
    step: torch.Tensor,
    verify_plan: Optional[VerifyPlan] = None,
    write_plan: Optional[WritePlan] = None,
    out_cache_loc: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    req_pool_indices: Optional[torch.Tensor] = None,
    prefix_lens: Optional[torch.Tensor] = None,
    swa_window_size: int = 0,
) -> None:
    """Stamp one tag's new ring rows, or those of k stacked rings (contract in the module docstring).
    Mutates only ``stamps[lo:hi]`` of each ring. The stamp op has no counters; every error
    (``kv-canary:`` TypeError / ValueError) is raised before anything changes."""
    kwargs = dict(
        violation_ring=violation_ring, violation_write_index=violation_write_index, rows_from=rows_from,
        stamps=stamps, step=step, verify_plan=verify_plan, write_plan=write_plan, out_cache_loc=out_cache_loc,
        positions=positions, req_pool_indices=req_pool_indices, prefix_lens=prefix_lens,
        swa_window_size=swa_window_size,
    )
    _check_stamp_args(**kwargs)
    backend = triton_backend(violation_ring.device)
    impl = backend.launch_stamp if backend else stamp_violation_rows_torch_reference
    impl(**kwargs)
