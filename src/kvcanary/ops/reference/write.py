"""Vectorised torch twin of the write op (docs/design.md §3.6).

The contract is sequential: requests in batch order, entries in order, on a live buffer. This
twin gets the same bytes in bulk: fingerprints, asserts and stores are whole-tensor ops, the
chain recurrence is one serial scan (`chain_scan`), and a slot stored twice keeps its last
write. A request whose seed was stored by an earlier request of the same launch starts a new
segment, applied after the earlier ones have landed in the buffer.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

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


class _Entries(NamedTuple):
    """The launch's stored entries (slot >= 0, before ``offsets[num_reqs]``), request by request, with
    what the chain and the rows need of each; ``inside``: the slot is inside the buffer (else only reported)."""

    req: torch.Tensor
    slot: torch.Tensor
    inside: torch.Tensor
    token: torch.Tensor
    position: torch.Tensor
    fingerprint: torch.Tensor
    exp_token: Optional[torch.Tensor]      # input asserts on: the expected token / position of each entry
    exp_position: Optional[torch.Tensor]


class _Rules(NamedTuple):
    """What a launch checks: its launch tag (int64 [1]), the input asserts, the chain-position assert."""

    kind: torch.Tensor
    input_assert: bool
    chain_assert: bool


class _Rows:
    """Violation rows collected segment by segment, each with its entry's index; appended in entry order."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor, keys: torch.Tensor) -> None:
        self.rows.append(rows)
        self.keys.append(keys)

    def append_to(self, ctx: VerifyOrWriteContext) -> None:
        if not self.rows:
            return
        all_rows = torch.cat(self.rows)
        if len(self.rows) > 1:
            all_rows = all_rows[torch.sort(torch.cat(self.keys), stable=True).indices]
        append_violations(ctx.violation_ring, ctx.violation_write_index, all_rows)


def _work(plan: WritePlan) -> Optional[tuple[int, torch.Tensor, int]]:
    """(requests, their offsets [num_reqs + 1], end of the work) of a launch with work, else None."""
    seeds_all = plan.write_seed_slot_indices
    num_reqs = min(max(int(plan.write_num_valid_reqs[0]), 0), int(seeds_all.shape[0]))
    if num_reqs == 0:
        return None
    offsets = plan.write_offsets[: num_reqs + 1].to(torch.int64)
    end_of_work = int(offsets[num_reqs])
    return (num_reqs, offsets, end_of_work) if end_of_work > 0 else None


def _gather_entries(
    ctx: VerifyOrWriteContext, fields: torch.Tensor, offsets: torch.Tensor, end_of_work: int, input_ids: torch.Tensor,
    positions: torch.Tensor, out_cache_loc: torch.Tensor, expected: Optional[tuple[torch.Tensor, torch.Tensor]],
) -> _Entries:
    """Entries of requests [0, num_reqs), request by request; never past ``offsets[num_reqs]``. ``expected``:
    the input asserts' (tokens, positions), or None."""
    starts = offsets[:-1]
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
    fingerprint = fingerprint_slots(
        ctx.real_kv_sources, ctx.real_kv_hash_mode, torch.where(inside, slot, torch.zeros_like(slot)), fields.device
    )
    exp_token = exp_position = None
    if expected is not None:
        exp_token, exp_position = expected[0][flat].to(torch.int64), expected[1][flat].to(torch.int64)
    return _Entries(req, slot, inside, token, position, fingerprint, exp_token, exp_position)


def _segment_end(
    entries: _Entries, seeds: torch.Tensor, first_req: int, first_entry: int, num_reqs: int
) -> tuple[int, int, Optional[tuple[torch.Tensor, int]]]:
    """(end request, end entry) of the segment starting at (``first_req``, ``first_entry``): up to the first
    request whose seed an earlier request of the tail stores. Third: when the segment is the whole tail, its
    stores' slot inverse and unique count (to find last writes without a second ``unique``), else None."""
    tail_req = entries.req[first_entry:]
    tail_in = entries.inside[first_entry:]
    uniq, inverse = torch.unique(entries.slot[first_entry:][tail_in], return_inverse=True)
    dependent = _first_dependent_request(tail_req[tail_in], uniq, inverse, seeds, first_req)
    end_req = num_reqs if dependent < 0 else dependent
    end_entry = first_entry + int((tail_req < end_req).sum())
    return end_req, end_entry, ((inverse, uniq.numel()) if dependent < 0 else None)


def _out_of_range_rows(
    entries: _Entries, e: slice, running_all: torch.Tensor, rules: _Rules, rows: _Rows
) -> None:
    """One WRITE_SLOT_OUT_OF_RANGE row per entry of the segment ``e`` whose slot is past the buffer."""
    seg_in = entries.inside[e]
    if bool(seg_in.all()):
        return
    out_idx = (~seg_in).nonzero().squeeze(1)
    o_slot, o_pos, o_tok = entries.slot[e][out_idx], entries.position[e][out_idx], entries.token[e][out_idx]
    bits = torch.full_like(o_pos, int(FailReason.WRITE_SLOT_OUT_OF_RANGE))
    rows.add(violation_rows(rules.kind, o_slot, o_pos, o_tok, o_tok, running_all[out_idx], o_pos, bits),
             e.start + out_idx)


def _last_positions(fields: torch.Tensor, seg_req: torch.Tensor, seg_pos: torch.Tensor,
                    seed_of_entry: torch.Tensor) -> torch.Tensor:
    """The chain's ``last_pos`` before each stored entry: its seed's stored position for a request's first
    entry, else the previous entry's position."""
    is_first = torch.ones_like(seg_req, dtype=torch.bool)
    is_first[1:] = seg_req[1:] != seg_req[:-1]
    seed_pos = read_records(fields, seed_of_entry)[:, CANARY_FIELD_POSITION]
    prev_pos = torch.empty_like(seg_pos)
    prev_pos[1:] = seg_pos[:-1]
    return torch.where(is_first, seed_pos, prev_pos)


def _assert_rows(
    entries: _Entries, e: slice, in_idx: torch.Tensor, running: torch.Tensor, last_pos: torch.Tensor,
    seed_of_entry: torch.Tensor, rules: _Rules, rows: _Rows,
) -> None:
    """The input-assert and chain-position rows of the segment's stored entries, interleaved per entry
    (input-assert row first)."""
    slot, token, pos = entries.slot[e][in_idx], entries.token[e][in_idx], entries.position[e][in_idx]
    entry_rows = []
    if rules.input_assert:
        et, ep = entries.exp_token[e][in_idx], entries.exp_position[e][in_idx]
        bits = (token != et).to(torch.int64) * int(FailReason.WRITE_TOKEN_MISMATCH) + (
            pos != ep
        ).to(torch.int64) * int(FailReason.WRITE_POSITION_MISMATCH)
        entry_rows.append((bits != 0, violation_rows(rules.kind, slot, pos, token, et, running, ep, bits)))
    if rules.chain_assert:
        bad = (seed_of_entry >= 0) & (pos != last_pos + 1)
        bits = torch.full_like(pos, int(FailReason.WRITE_POSITION_MISMATCH))
        entry_rows.append((bad, violation_rows(rules.kind, slot, pos, token, token, running, last_pos + 1, bits)))
    if entry_rows:
        flags = torch.stack([m for m, _ in entry_rows], dim=1).flatten()
        stacked = torch.stack([r for _, r in entry_rows], dim=1).reshape(-1, 8)
        entry_key = e.start + in_idx
        rows.add(stacked[flags], entry_key[:, None].expand(-1, len(entry_rows)).flatten()[flags])


def _store_records(fields: torch.Tensor, entries: _Entries, e: slice, in_idx: torch.Tensor, running: torch.Tensor,
                   whole_tail: Optional[tuple[torch.Tensor, int]]) -> None:
    """Store (token, position, prev_hash, fingerprint) of the segment's stored entries; a slot stored twice
    keeps its last write."""
    slot = entries.slot[e][in_idx]
    last = _last_writes(*whole_tail) if whole_tail is not None else last_occurrence_mask(slot)
    record = torch.stack([entries.token[e][in_idx], entries.position[e][in_idx], running,
                          entries.fingerprint[e][in_idx]], dim=1)
    if last is not None:
        record, slot = record[last], slot[last]
    fields[slot, CANARY_FIELD_TOKEN : CANARY_FIELD_REAL_KV_HASH + 1] = record


def _write_segment(fields: torch.Tensor, entries: _Entries, e: slice, seg_seeds: torch.Tensor, first_req: int,
                   whole_tail: Optional[tuple[torch.Tensor, int]], rules: _Rules, rows: _Rows) -> None:
    """One segment: chain it from its seeds as the live buffer holds them now (earlier segments have landed),
    collect its rows, store its records."""
    seg_req = entries.req[e]
    running_all = chain_scan(
        slot_hash(fields, seg_seeds), torch.bincount(seg_req - first_req, minlength=seg_seeds.numel()),
        entries.token[e], entries.position[e], advance=entries.inside[e],
    )
    _out_of_range_rows(entries, e, running_all, rules, rows)
    in_idx = entries.inside[e].nonzero().squeeze(1)
    seg_req, running = seg_req[in_idx], running_all[in_idx]
    seed_of_entry = seg_seeds[seg_req - first_req]
    last_pos = _last_positions(fields, seg_req, entries.position[e][in_idx], seed_of_entry)
    _assert_rows(entries, e, in_idx, running, last_pos, seed_of_entry, rules, rows)
    _store_records(fields, entries, e, in_idx, running, whole_tail)


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
    once the lazy checks passed and before any record or KV read, count the stalls of the flat entries in
    ``[offsets[0], offsets[a])`` whose slot is inside the buffer; on the CPU also wait them out
    (`apply_jitter_torch_reference`).
    """
    ctx = context
    ctx.kernel_run_counter.add_(1)
    work = _work(plan)
    if work is None:
        return
    num_reqs, offsets, end_of_work = work
    fields = canary_fields(ctx.canary_buf)
    _check_input_assert_args(bool(enable_write_input_assert), expected_input_tokens, expected_input_positions)
    if ctx.hashing_on:
        check_row_widths(ctx.real_kv_sources)
    if jitter is not None:
        span = out_cache_loc[max(int(offsets[0]), 0) : end_of_work].to(torch.int64)
        apply_jitter_torch_reference(jitter, int(ctx.kernel_kind), span[(span >= 0) & (span < fields.shape[0])])
    expected = (expected_input_tokens, expected_input_positions) if enable_write_input_assert else None
    entries = _gather_entries(ctx, fields, offsets, end_of_work, input_ids, positions, out_cache_loc, expected)
    seeds = plan.write_seed_slot_indices[:num_reqs].to(torch.int64)
    rules = _Rules(kind=torch.tensor([int(ctx.kernel_kind)], dtype=torch.int64, device=fields.device),
                   input_assert=bool(enable_write_input_assert),
                   chain_assert=int(ctx.enable_chain_position_assert[0]) != 0)
    rows = _Rows()
    first_req, first_entry = 0, 0
    while first_req < num_reqs:
        end_req, end_entry, whole_tail = _segment_end(entries, seeds, first_req, first_entry, num_reqs)
        _write_segment(fields, entries, slice(first_entry, end_entry), seeds[first_req:end_req], first_req,
                       whole_tail, rules, rows)
        first_req, first_entry = end_req, end_entry
    ctx.slot_run_counter.add_(int(entries.inside.sum()))
    rows.append_to(ctx)
