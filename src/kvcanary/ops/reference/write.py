"""Vectorised torch twin of the write op (docs/design.md §3.6).

The contract is sequential: requests in batch order, entries in order, on a live buffer. This
twin gets the same bytes in bulk: fingerprints, asserts and stores are whole-tensor ops, the
chain recurrence is one serial scan (`chain_scan`), and a slot stored twice keeps its last
write. A request whose seed was stored by an earlier request of the same launch starts a new
segment, applied after the earlier ones have landed in the buffer.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.constants import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    FailReason,
)
from kvcanary.ops.jitter import KernelJitter
from kvcanary.ops.records import VerifyOrWriteContext, WritePlan
from kvcanary.ops.reference.chain_scan import chain_scan
from kvcanary.ops.reference.common import (
    append_violations,
    canary_fields,
    last_occurrence_mask,
    read_records,
    segment_ids,
    slot_hash,
    violation_rows,
)
from kvcanary.ops.reference.jitter import apply_jitter_torch_reference
from kvcanary.ops.reference.real_kv import check_row_widths, fingerprint_slots


def _check_input_assert_args(flag: bool, tokens: Optional[torch.Tensor], positions: Optional[torch.Tensor]) -> None:
    if flag and (tokens is None or positions is None):
        raise KvCanaryValueError("kv-canary: expected input tensors are required when enable_write_input_assert=True")
    if not flag and (tokens is not None or positions is not None):
        raise KvCanaryValueError("kv-canary: expected input tensors must be None when enable_write_input_assert=False")


def _first_dependent_request(
    req: torch.Tensor, uniq: torch.Tensor, inverse: torch.Tensor, seeds: torch.Tensor, first_req: int
) -> int:
    """First request r > first_req whose seed is stored by an entry of a request in [first_req, r);
    -1 if none. ``req`` are the requests of the entries (>= first_req, in order) storing the
    slots ``uniq[inverse]``."""
    if req.numel() == 0:
        return -1
    big = torch.iinfo(torch.int64).max
    first_writer = torch.full_like(uniq, big).scatter_reduce(0, inverse, req, reduce="amin")
    cand = seeds[first_req:]
    at = torch.clamp(torch.searchsorted(uniq, cand), max=uniq.numel() - 1)
    writer = torch.where(uniq[at] == cand, first_writer[at], torch.full_like(cand, big))
    reqs = torch.arange(first_req, first_req + cand.numel(), device=cand.device)
    dependent = (cand >= 0) & (writer < reqs)
    if not bool(dependent.any()):
        return -1
    return first_req + int(dependent.nonzero()[0, 0])


def _last_writes(inverse: torch.Tensor, num_unique: int) -> Optional[torch.Tensor]:
    """Bool mask of the entries that are their slot's last store; None when no slot repeats."""
    n = inverse.numel()
    if num_unique == n:
        return None
    order = torch.arange(n, device=inverse.device)
    last = torch.full((num_unique,), -1, dtype=torch.int64, device=inverse.device)
    last = last.scatter_reduce(0, inverse, order, reduce="amax")
    return last[inverse] == order


def launch_canary_write_kernel_torch_reference(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: Optional[torch.Tensor],
    expected_input_positions: Optional[torch.Tensor],
    jitter: Optional[KernelJitter] = None,
) -> None:
    """Store (token, position, prev_hash, fingerprint) for every entry with a slot >= 0.

    Mutates: ``kernel_run_counter`` (+1, first), the canary buffer, ``slot_run_counter``
    (+entries written), the ring and its write index. A slot or seed past the buffer is never
    indexed: see ``FailReason.WRITE_SLOT_OUT_OF_RANGE``. ``jitter`` (*extension*, `kvcanary.ops.jitter`):
    once the lazy checks passed, count the stalls of the flat entries in ``[offsets[0], offsets[a])`` whose slot is
    inside the buffer.
    """
    ctx = context
    ctx.kernel_run_counter.add_(1)
    seeds_all = plan.write_seed_slot_indices
    num_reqs = min(max(int(plan.write_num_valid_reqs[0]), 0), int(seeds_all.shape[0]))
    if num_reqs == 0:
        return
    offsets = plan.write_offsets[: num_reqs + 1].to(torch.int64)
    end_of_work = int(offsets[num_reqs])
    if end_of_work <= 0:
        return
    fields = canary_fields(ctx.canary_buf)
    _check_input_assert_args(bool(enable_write_input_assert), expected_input_tokens, expected_input_positions)
    if ctx.hashing_on:
        check_row_widths(ctx.real_kv_sources)
    if jitter is not None:
        span = out_cache_loc[max(int(offsets[0]), 0) : end_of_work].to(torch.int64)
        apply_jitter_torch_reference(jitter, int(ctx.kernel_kind), span[(span >= 0) & (span < fields.shape[0])])

    # Entries of requests [0, num_reqs), request by request; never past offsets[num_reqs].
    starts = offsets[:num_reqs]
    lengths = torch.clamp(offsets[1:] - starts, min=0)
    req, local = segment_ids(lengths)
    flat = starts[req] + local
    in_range = flat < end_of_work
    req, flat = req[in_range], flat[in_range]
    slot = out_cache_loc[flat].to(torch.int64)
    stored = slot >= 0
    req, flat, slot = req[stored], flat[stored], slot[stored]
    # A slot past the buffer is reported, not stored (FailReason.WRITE_SLOT_OUT_OF_RANGE).
    inside = slot < fields.shape[0]
    token = input_ids[flat].to(torch.int64)
    position = positions[flat].to(torch.int64)
    seeds = seeds_all[:num_reqs].to(torch.int64)
    fingerprint = fingerprint_slots(
        ctx.real_kv_sources, ctx.real_kv_hash_mode, torch.where(inside, slot, torch.zeros_like(slot)), fields.device
    )
    chain_assert_on = int(ctx.enable_chain_position_assert[0]) != 0
    if enable_write_input_assert:
        exp_token = expected_input_tokens[flat].to(torch.int64)
        exp_position = expected_input_positions[flat].to(torch.int64)

    kind = torch.tensor([int(ctx.kernel_kind)], dtype=torch.int64, device=fields.device)
    rows: list[torch.Tensor] = []
    row_keys: list[torch.Tensor] = []  # entry index of each row: rows are put in entry order at the end
    seg_first_req, seg_first_entry = 0, 0
    while seg_first_req < num_reqs:
        tail_req = req[seg_first_entry:]
        tail_in = inside[seg_first_entry:]
        uniq, inverse = torch.unique(slot[seg_first_entry:][tail_in], return_inverse=True)
        dependent = _first_dependent_request(tail_req[tail_in], uniq, inverse, seeds, seg_first_req)
        seg_end_req = num_reqs if dependent < 0 else dependent
        seg_end_entry = seg_first_entry + int((tail_req < seg_end_req).sum())
        e = slice(seg_first_entry, seg_end_entry)
        seg_req, seg_token, seg_pos, seg_in = req[e], token[e], position[e], inside[e]
        seg_seeds = seeds[seg_first_req:seg_end_req]

        # Seeds are read from the live buffer: earlier segments have landed.
        start_hash = slot_hash(fields, seg_seeds)
        running_all = chain_scan(
            start_hash, torch.bincount(seg_req - seg_first_req, minlength=seg_seeds.numel()), seg_token, seg_pos,
            advance=seg_in,
        )
        if not bool(seg_in.all()):
            out_idx = (~seg_in).nonzero().squeeze(1)
            o_slot, o_pos, o_tok = slot[e][out_idx], seg_pos[out_idx], seg_token[out_idx]
            bits = torch.full_like(o_pos, int(FailReason.WRITE_SLOT_OUT_OF_RANGE))
            rows.append(violation_rows(kind, o_slot, o_pos, o_tok, o_tok, running_all[out_idx], o_pos, bits))
            row_keys.append(seg_first_entry + out_idx)
        in_idx = seg_in.nonzero().squeeze(1)
        seg_req, seg_slot, seg_token, seg_pos = seg_req[in_idx], slot[e][in_idx], seg_token[in_idx], seg_pos[in_idx]
        running = running_all[in_idx]
        entry_key = seg_first_entry + in_idx

        is_first = torch.ones_like(seg_req, dtype=torch.bool)
        is_first[1:] = seg_req[1:] != seg_req[:-1]
        seed_of_entry = seg_seeds[seg_req - seg_first_req]
        seed_pos = read_records(fields, seed_of_entry)[:, CANARY_FIELD_POSITION]
        prev_pos = torch.empty_like(seg_pos)
        prev_pos[1:] = seg_pos[:-1]
        last_pos = torch.where(is_first, seed_pos, prev_pos)

        entry_rows = []
        if enable_write_input_assert:
            et, ep = exp_token[e][in_idx], exp_position[e][in_idx]
            bits = (seg_token != et).to(torch.int64) * int(FailReason.WRITE_TOKEN_MISMATCH) + (
                seg_pos != ep
            ).to(torch.int64) * int(FailReason.WRITE_POSITION_MISMATCH)
            bad = bits != 0
            entry_rows.append(
                (bad, violation_rows(kind, seg_slot, seg_pos, seg_token, et, running, ep, bits))
            )
        if chain_assert_on:
            bad = (seed_of_entry >= 0) & (seg_pos != last_pos + 1)
            bits = torch.full_like(seg_pos, int(FailReason.WRITE_POSITION_MISMATCH))
            entry_rows.append(
                (bad, violation_rows(kind, seg_slot, seg_pos, seg_token, seg_token, running, last_pos + 1, bits))
            )
        if entry_rows:
            # Interleave per entry: input-assert row before chain row.
            flags = torch.stack([m for m, _ in entry_rows], dim=1).flatten()
            stacked = torch.stack([r for _, r in entry_rows], dim=1).reshape(-1, 8)
            rows.append(stacked[flags])
            row_keys.append(entry_key[:, None].expand(-1, len(entry_rows)).flatten()[flags])

        if dependent < 0:  # the segment is the whole tail: reuse its unique slots
            last = _last_writes(inverse, uniq.numel())
        else:
            last = last_occurrence_mask(seg_slot)
        record = torch.stack([seg_token, seg_pos, running, fingerprint[e][in_idx]], dim=1)
        target = seg_slot
        if last is not None:
            record, target = record[last], target[last]
        fields[target, CANARY_FIELD_TOKEN : CANARY_FIELD_REAL_KV_HASH + 1] = record

        seg_first_req, seg_first_entry = seg_end_req, seg_end_entry

    ctx.slot_run_counter.add_(int(inside.sum()))
    if rows:
        all_rows = torch.cat(rows)
        if len(rows) > 1:
            all_rows = all_rows[torch.sort(torch.cat(row_keys), stable=True).indices]
        append_violations(ctx.violation_ring, ctx.violation_write_index, all_rows)
