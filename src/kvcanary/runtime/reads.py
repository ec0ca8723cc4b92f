"""Read-table checks: what attention reads against what each request owns.

The HEAD verify checks the slots the position -> slot table maps to a row's cached positions ``[0, P)``
(or its window). An engine's attention may read more, or other, entries than that table says: a surplus
page past the row's tokens (a block allocated eagerly for the next token, still holding a previous
occupant's KV), a page missing, a new token read from another slot than the one it was written to. Those
reads are invisible to the verify, so the adapter compares the engine's own read description (read index,
key lengths) with what each row owns and hands the disagreements over as a `ReadCheck` per group
(`GroupBatch.read_check`); `append_read_rows` turns them into violation rows.

Reason: ``read_table_mismatch`` (bit `READ_TABLE_MISMATCH`, a runtime-level bit above every op
`FailReason` bit; the op contract's bits are unchanged). One row per batch row and group whose reads
disagree, recorded in the group's HEAD ring (tag ``HEAD_K_*``) and counted like any other row (per tag from
the write index, per reason from the rows kept). Ring row fields::

    KERNEL_KIND     HEAD tag of the group
    SLOT_IDX        the first disagreeing slot attention reads (0: none, e.g. a page missing from the reads)
    POSITION        the position that slot's HEAD record holds (what the slot really is)
    STORED_TOKEN    the token that slot's HEAD record holds
    EXPECTED_TOKEN  entries attention reads for the row
    STORED_HASH     entries the row owns (cached positions it may read + its new tokens)
    EXPECTED_AUX    the slot the row owns at the claimed position (-1: the row owns no such position)
    FAIL_REASON     READ_TABLE_MISMATCH

and the stamp ``(step, batch row, claimed position)``, written here (the rows are appended before the step's
HEAD launches mark the rings, so the step's stamp launches never restamp them). Device ops only, no host
reads, fixed shapes ``[bs]``: capturable in a CUDA graph with the rest of staging.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.ops import CANARY_FIELD_POSITION, CANARY_FIELD_TOKEN, CanaryLaunchTag, FailReason
from kvcanary.runtime.identity import IDENTITY_REASONS

READ_TABLE_MISMATCH = 1 << 16
# runtime-level reasons: read_table_mismatch (a device row), then the host-side identity classifications
# (`kvcanary.runtime.identity`, added at drain time)
RUNTIME_REASONS = {READ_TABLE_MISMATCH: "read_table_mismatch", **IDENTITY_REASONS}


def reason_labels(bits: int) -> list[str]:
    """Labels of every bit set, op `FailReason` bits (lowest first) then runtime-level bits."""
    bits = int(bits)
    runtime = sum(RUNTIME_REASONS)
    op_bits = bits & ~runtime
    labels = FailReason(op_bits).label.split("+") if op_bits else []
    return labels + [label for bit, label in RUNTIME_REASONS.items() if bits & bit]


def reason_label(bits: int) -> str:
    """Report label of a bit set (``verify_chain_hash+verify_position``, ``read_table_mismatch``)."""
    labels = reason_labels(bits)
    return "+".join(labels) if labels else "none"


def append_read_rows(*, ring: torch.Tensor, write_index: torch.Tensor, stamps: torch.Tensor, tag: CanaryLaunchTag,
                     head_buf: torch.Tensor, num_slots: int, check, step: torch.Tensor,
                     row_arange: Optional[torch.Tensor] = None) -> None:
    """Append one ``read_table_mismatch`` row per batch row of ``check`` (a `ReadCheck`, [bs]) that disagrees, in
    batch order, to ``ring`` (int64 [cap, 8]) with its stamp in ``stamps`` (int64 [cap, 3]); ``write_index``
    (int32 [1]) grows by the full count (fill-once, as the ops do). ``head_buf``: the group's HEAD canary buffer
    (the slot's record is read from it); ``step``: int64 [1]. Device ops only."""
    mask = check.mismatch.to(torch.bool)
    bs = int(mask.shape[0])
    if bs == 0:
        return
    dev = mask.device
    cap = int(ring.shape[0])
    ar = row_arange[:bs] if row_arange is not None else torch.arange(bs, dtype=torch.int64, device=dev)
    ranks = mask.to(torch.int64).cumsum(0)  # disagreeing rows before and at each row
    count = ranks[-1]
    base = write_index.to(torch.int64)
    dest = (base + ar).clamp_(max=cap - 1)  # ring rows this launch may fill; past the end: the last row, rewritten as is
    rank = dest - base
    fill = (rank >= 0) & (rank < count)
    src = torch.searchsorted(ranks, rank.clamp(0, bs - 1) + 1).clamp_(max=bs - 1)  # the row of that rank
    slot = check.slot.to(torch.int64)[src]
    record = head_buf.view(torch.int64)[slot.clamp(0, num_slots - 1)]
    row = torch.stack([
        torch.full_like(slot, int(tag)), slot, record[:, CANARY_FIELD_POSITION], record[:, CANARY_FIELD_TOKEN],
        check.reads.to(torch.int64)[src], check.owned.to(torch.int64)[src], check.expected_slot.to(torch.int64)[src],
        torch.full_like(slot, READ_TABLE_MISMATCH),
    ], dim=1)
    stamp = torch.stack([step.to(torch.int64).expand(bs), src, check.position.to(torch.int64)[src]], dim=1)
    ring.index_copy_(0, dest, torch.where(fill[:, None], row, ring[dest]))
    stamps.index_copy_(0, dest, torch.where(fill[:, None], stamp, stamps[dest]))
    write_index.add_(count.to(torch.int32))


__all__ = ["READ_TABLE_MISMATCH", "RUNTIME_REASONS", "append_read_rows", "reason_label", "reason_labels"]
