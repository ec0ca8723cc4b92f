"""Fused device glue of the runtime: the per-forward bookkeeping around the ops, one Triton kernel or two
per block instead of a few dozen small torch ops.

Three blocks, each a torch twin (the reference; what the CPU runs) and a Triton launcher bit-identical to it:

* ``token_rows`` — per staged token: its batch row in the write plan (a search over the plan's offsets),
  its offset within the row, and whether it lies inside the write range. With a `StepPrologue` the same
  launch also opens the step: marks the rings (``rows_from = write_index``), keeps the step's request rows
  (``row_history[step % rows] = rows``) and counts a disabled first plan (``disabled += 1 - enable``).
* ``record_write`` — the slot records of one HEAD write (`SlotRecords`): position, predecessor slot (the
  row's seed for a row's first token, else the previous token's slot, or 0 — unknown, never checked — when that
  token was not stored; a context anchor becomes the trash row), owner ``step * owner_span + row`` and step,
  last write wins when a slot repeats. Triton: kernel 1 claims each slot with ``atomic_max`` of the key
  ``epoch * 2**20 + token``, kernel 2 stores the fields of
  the token whose key won. The epoch is a device counter of the records advanced once per launch pair, so
  keys grow across launches and the scratch never needs a reset (a step number would not do: a step can
  be replayed with another batch, e.g. by an engine warming up its own graphs). Skipped tokens (invalid,
  negative or out-of-range slots) touch nothing — no atomics piling onto one dump row — and the records'
  trash row stays never written (the twin resets it after dumping there).
* ``expected_tokens`` — the write-input assert's expectation per staged token: its position
  ``prefix[row] + local`` and, from the engine's token history, ``table[rows[row], position]`` where the
  history knows it (``position < lens[row]`` and inside the table), else the staged input id itself. On CUDA
  it is computed by the ``token_rows`` launch itself (a `TokenOracle`), from the row it has just found.
* ``sweep_slice`` — one rotating sweep slice's verify plan from the slot records (`Sweeper`): slots from
  the device cursor (clamped to the trash row), live = in the pass's live set and written, the chain link
  kept only while the predecessor still holds the previous position (an older, unwritten or moved
  predecessor becomes 0, unreachable), the owners remembered per step, ``verified`` counted, the cursor
  advanced. Triton: one grid kernel (``verified`` by atomic add); the last program to finish (a ticket counter
  ``done``, back to 0 after each launch) advances the cursor, after every program has read it. Without a
  ``done`` counter a slice of more than one program takes a second, one-program kernel for the advance.

Every launcher is device-only (no host reads; grids from host-known sizes), so it can be captured in a CUDA
graph. ``use_kernels(t)``: Triton imports and ``t`` is on CUDA; otherwise callers use the twins. Triton
rules (docs/design.md §3.9): int64 index math, large blocks; under ``TRITON_INTERPRET=1`` the launchers also run on
CPU tensors (tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops import TOKEN_TO_KV_SLOT_PADDING, VerifyPlan
from kvcanary.ops import dispatch
from kvcanary.runtime.groups import NEVER_WRITTEN, SlotRecords

try:  # Triton is optional: CPU-only installs use the twins.
    import triton
    import triton.language as tl

    from kvcanary.ops.triton.launch import jit_batch_sized
except Exception:  # pragma: no cover - depends on the environment
    AVAILABLE = False
else:
    AVAILABLE = True

KEY_TOKEN_BITS = 20  # a record_write key is ``epoch << 20 | token``: launches of up to 2**20 tokens
MAX_RECORD_TOKENS = 1 << KEY_TOKEN_BITS
_BLOCK = 1024
_WARPS = 4


def use_kernels(t: torch.Tensor) -> bool:
    """True when the Triton launchers serve ``t``'s device (CUDA with Triton installed and not turned off,
    `kvcanary.ops.dispatch.disable_triton`; or any device where `kvcanary.ops.dispatch.selected_backend` chose
    Triton)."""
    forced = dispatch.selected()
    if forced is not None:
        return AVAILABLE and forced == "triton"
    return AVAILABLE and t.is_cuda and dispatch.triton_disabled() is None


@dataclass(frozen=True, kw_only=True)
class StepPrologue:
    """Per-step bookkeeping folded into the `token_rows` launch: ``rows_from`` / ``write_index`` int32 [T]
    (the rings' marks and indices), ``row_history`` int64 [H, max_rows], ``step`` int64 [1], ``rows`` int64
    [max_rows], ``disabled`` int64 [1] (a view) and ``enable`` int32 [1] (the first group's verify plan)."""

    rows_from: torch.Tensor
    write_index: torch.Tensor
    row_history: torch.Tensor
    step: torch.Tensor
    rows: torch.Tensor
    disabled: torch.Tensor
    enable: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class TokenOracle:
    """The write-input assert's inputs, for the `token_rows` launch to compute the expectation (`expected_tokens_twin`):
    int64 per batch row ``prefix``, ``rows`` (request rows) and ``lens`` (history lengths); ``table`` the token
    history [max_reqs, width] (int32 or int64), or None for positions only (the batch carries its own expected ids);
    ``input_ids`` int64 [>= n], the expectation where the history does not know the position."""

    prefix: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor
    table: Optional[torch.Tensor]
    input_ids: torch.Tensor


class TokenRows(NamedTuple):
    """Per staged token (all [n]): batch row, offset within it, inside the write range; with a `TokenOracle`
    also its position and (with a table) its expected token, else None."""

    row: torch.Tensor
    local: torch.Tensor
    valid: torch.Tensor
    expected: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None


# ---- torch twins -------------------------------------------------------------------------------------

def step_prologue_twin(p: StepPrologue) -> None:
    """The `StepPrologue` bookkeeping as torch ops."""
    p.rows_from.copy_(p.write_index)
    p.row_history.index_copy_(0, p.step.remainder(p.row_history.shape[0]), p.rows[None])
    p.disabled.add_(1 - p.enable)

def token_rows_twin(offsets: torch.Tensor, bs: int, n: int, token_arange: torch.Tensor):
    """(row, local, valid) of tokens ``0..n-1``: int64 [n] batch row (``searchsorted(offsets[1:bs+1], t,
    right=True)`` clamped to ``bs - 1``), int64 [n] ``t - offsets[row]``, bool [n] ``t < offsets[bs]``.
    ``offsets``: the write plan's int64 [>= bs + 1]; ``token_arange``: int64 [>= n], ``arange``."""
    offsets = offsets[: bs + 1]
    idx = token_arange[:n]
    row = torch.searchsorted(offsets[1:], idx, right=True).clamp_(max=max(bs - 1, 0))
    local = idx - offsets[row]
    valid = idx < offsets[bs]
    return row, local, valid


def record_write_twin(records: SlotRecords, *, seeds: torch.Tensor, row: torch.Tensor, local: torch.Tensor,
                      valid: torch.Tensor, out_loc: torch.Tensor, positions: torch.Tensor, step: torch.Tensor,
                      owner_span: int) -> None:
    """Record one write of ``n`` tokens (all int64 [n] but ``valid`` bool [n]; ``seeds`` int64 [>= rows],
    the write plan's seed slot per row; ``step`` int64 [1]): see the module docstring."""
    trash = records.num_slots
    before = out_loc.roll(1)
    # a previous token not stored (negative slot) is not the link: the write chained past it, from a slot this
    # launch does not name here, so the link is unknown (0, never checked), not a chain head (-1)
    prev = torch.where(local == 0, seeds[row], torch.where(before < 0, 0, before))
    prev = torch.where(prev >= trash, trash, prev)  # a context anchor: no slot to link to (trash)
    records.record(slots=out_loc, valid=valid, positions=positions, prev_slots=prev,
                   owners=step * owner_span + row, step=step)


def expected_tokens_twin(*, row: torch.Tensor, local: torch.Tensor, prefix: torch.Tensor, rows: torch.Tensor,
                         lens: torch.Tensor, table: torch.Tensor, input_ids: torch.Tensor):
    """(expected int64 [n], positions int64 [n]) of ``n`` staged tokens: ``row`` / ``local`` from
    `token_rows_twin`; ``prefix`` / ``rows`` (request rows) / ``lens`` (history lengths) int64 per batch row;
    ``table`` the token history [max_reqs, width] (int32 or int64); ``input_ids`` int64 [n]."""
    positions = prefix[row] + local
    known = (positions < lens[row]) & (positions < table.shape[1])
    col = positions.clamp(0, table.shape[1] - 1)
    expected = torch.where(known, table[rows[row], col].to(torch.int64), input_ids)
    return expected, positions


def fill_sweep_plan(plan: VerifyPlan, records: SlotRecords, slots: torch.Tensor, written_at: torch.Tensor,
                    live: torch.Tensor) -> None:
    """Slot, expected position and checkable predecessor of each entry of ``plan`` (int64 [cap] ``slots`` in
    ``[0, num_slots]``, their ``written_at`` steps, bool ``live``; a slot not live becomes padding slot 0)."""
    prev = records.prev_slot[slots]
    position = records.position[slots]
    safe_prev = prev.clamp(min=0)
    prev_at = records.step[safe_prev]
    # The link is checkable only while the predecessor still holds the previous position.
    intact = ((prev >= 0) & (prev_at <= written_at) & (prev_at != NEVER_WRITTEN)
              & (records.position[safe_prev] == position - 1))
    prev = torch.where(prev < 0, prev, torch.where(intact, prev, 0))
    plan.verify_slot_indices.copy_(torch.where(live, slots, TOKEN_TO_KV_SLOT_PADDING))
    plan.verify_expected_positions.copy_(position)
    plan.verify_prev_slot_indices.copy_(prev)


def sweep_slice_twin(*, records: SlotRecords, plan: VerifyPlan, live_mask: torch.Tensor, cursor: torch.Tensor,
                     offsets: torch.Tensor, span: int, step: torch.Tensor, owner_history: torch.Tensor,
                     verified: torch.Tensor) -> None:
    """One slice of ``size = offsets.numel()`` entries (``offsets`` int64 arange): fill ``plan`` (capacity
    ``size``), ``owner_history[step % rows] = owner`` (int64 [rows, size]), ``verified += live entries``,
    ``cursor = (cursor + size) % span`` (int64 [1] each; ``live_mask`` bool [num_slots + 1])."""
    trash = records.num_slots
    slots = offsets + cursor
    slots = torch.where(slots < trash, slots, trash)
    written_at = records.step[slots]
    live = live_mask[slots] & (written_at != NEVER_WRITTEN)
    fill_sweep_plan(plan, records, slots, written_at, live)
    owner_history.index_copy_(0, step.remainder(owner_history.shape[0]), records.owner[slots][None])
    verified += live.sum()
    cursor.add_(offsets.shape[0]).remainder_(span)


# ---- dispatch -----------------------------------------------------------------------------------------

def token_rows(offsets: torch.Tensor, bs: int, n: int, token_arange: torch.Tensor,
               prologue: Optional[StepPrologue] = None, oracle: Optional[TokenOracle] = None) -> TokenRows:
    """`token_rows_twin` (and the ``prologue``'s bookkeeping first; with an ``oracle`` also `expected_tokens_twin`),
    on one Triton kernel for CUDA tensors."""
    if use_kernels(offsets) and n > 0:
        return launch_token_rows(offsets, bs, n, prologue, oracle)
    if prologue is not None:
        step_prologue_twin(prologue)
    return _with_expectation(TokenRows(*token_rows_twin(offsets, bs, n, token_arange)), oracle, n)


def _with_expectation(found: TokenRows, oracle: Optional[TokenOracle], n: int) -> TokenRows:
    """``found`` with the oracle's positions / expected tokens from the twin (None without an oracle)."""
    if oracle is None:
        return found
    if oracle.table is None:
        return found._replace(positions=oracle.prefix[found.row] + found.local)
    expected, positions = expected_tokens_twin(row=found.row, local=found.local, prefix=oracle.prefix, rows=oracle.rows,
                                               lens=oracle.lens, table=oracle.table, input_ids=oracle.input_ids[:n])
    return found._replace(expected=expected, positions=positions)


def record_write(records: SlotRecords, **kw) -> None:
    """`record_write_twin`, on the Triton kernels for CUDA tensors of up to ``MAX_RECORD_TOKENS`` tokens."""
    n = kw["out_loc"].shape[0]
    if use_kernels(records.step) and 0 < n <= MAX_RECORD_TOKENS:
        launch_record_write(records, **kw)
    else:
        record_write_twin(records, **kw)


def sweep_slice(*, done: Optional[torch.Tensor] = None, **kw) -> None:
    """`sweep_slice_twin`, on the Triton kernels for CUDA tensors (``done``: the launch's ticket counter, int32 [1]
    of zeros; the twin needs none)."""
    if use_kernels(kw["cursor"]):
        launch_sweep_slice(done=done, **kw)
    else:
        sweep_slice_twin(**kw)


# ---- Triton -------------------------------------------------------------------------------------------

if AVAILABLE:

    @jit_batch_sized('bs', 'n')
    def _token_rows_kernel(offsets_ptr, row_ptr, local_ptr, valid_ptr, bs, n,
                           from_ptr, widx_ptr, n_rings, history_ptr, history_rows, step_ptr, rows_ptr, max_rows,
                           disabled_ptr, enable_ptr,
                           prefix_ptr, req_ptr, lens_ptr, table_ptr, table_stride, width, n_table_rows, ids_ptr,
                           expected_ptr, positions_ptr,
                           SEARCH_STEPS: tl.constexpr, PROLOGUE: tl.constexpr, ORACLE: tl.constexpr,
                           BLOCK: tl.constexpr):
        """Per token t < n: the upper-bound search of torch.searchsorted (same probes) over offsets[1 : bs+1];
        ``SEARCH_STEPS`` >= the search's depth, from the offsets' capacity (a constexpr: fixed per plan, not per batch).
        ``PROLOGUE``: also the `StepPrologue` (rows by every program, marks and the count by program 0).
        ``ORACLE``: 1 also each token's position ``prefix[row] + local``; 2 also its expected token from the
        history (`expected_tokens_twin`)."""
        pid = tl.program_id(0)
        t = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        if PROLOGUE:
            step = tl.load(step_ptr)
            hrow = ((step % history_rows) + history_rows) % history_rows  # torch.remainder: sign of the divisor
            rm = t < max_rows
            tl.store(history_ptr + hrow * max_rows + t, tl.load(rows_ptr + t, mask=rm, other=0), mask=rm)
            if pid == 0:  # n_rings <= BLOCK (the launcher checks)
                ri = tl.arange(0, BLOCK)
                mm = ri < n_rings
                tl.store(from_ptr + ri, tl.load(widx_ptr + ri, mask=mm, other=0), mask=mm)
                tl.store(disabled_ptr, tl.load(disabled_ptr) + 1 - tl.load(enable_ptr).to(tl.int64))
        m = t < n
        lo = tl.zeros([BLOCK], tl.int64)
        hi = tl.zeros([BLOCK], tl.int64) + bs
        for _ in range(SEARCH_STEPS):
            active = lo < hi
            mid = lo + ((hi - lo) >> 1)
            probe = tl.load(offsets_ptr + 1 + mid, mask=m & active, other=0)
            right = probe <= t
            lo = tl.where(active, tl.where(right, mid + 1, lo), lo)
            hi = tl.where(active, tl.where(right, hi, mid), hi)
        row = tl.minimum(lo, tl.maximum(bs - 1, 0))
        local = t - tl.load(offsets_ptr + row, mask=m, other=0)
        end = tl.load(offsets_ptr + bs)
        tl.store(row_ptr + t, row, mask=m)
        tl.store(local_ptr + t, local, mask=m)
        tl.store(valid_ptr + t, (t < end).to(tl.uint8), mask=m)
        if ORACLE > 0:
            pos = tl.load(prefix_ptr + row, mask=m, other=0) + local
            tl.store(positions_ptr + t, pos, mask=m)
            if ORACLE > 1:
                known = m & (pos < tl.load(lens_ptr + row, mask=m, other=0)) & (pos < width)
                col = tl.minimum(tl.maximum(pos, 0), width - 1)
                rp = tl.load(req_ptr + row, mask=m, other=0)
                readable = known & (rp >= 0) & (rp < n_table_rows)  # never outside the history (the twin would raise)
                tok = tl.load(table_ptr + rp * table_stride + col, mask=readable, other=0).to(tl.int64)
                ids = tl.load(ids_ptr + t, mask=m, other=0)
                tl.store(expected_ptr + t, tl.where(readable, tok, ids), mask=m)

    @jit_batch_sized('n')
    def _record_claim_kernel(out_loc_ptr, valid_ptr, scratch_ptr, epoch_ptr, n, num_slots,
                             TOKEN_BITS: tl.constexpr, BLOCK: tl.constexpr):
        """scratch[slot] = max(scratch[slot], key) per token; program 0 publishes the epoch in epoch[1]."""
        pid = tl.program_id(0)
        t = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m = t < n
        slot = tl.load(out_loc_ptr + t, mask=m, other=-1)
        keep = m & (tl.load(valid_ptr + t, mask=m, other=0) != 0) & (slot >= 0) & (slot < num_slots)
        epoch = tl.load(epoch_ptr) + 1  # epoch[0]: the last finished launch pair (read only here)
        tl.atomic_max(scratch_ptr + slot, (epoch << TOKEN_BITS) + t, mask=keep)  # skipped tokens: no atomics
        if pid == 0:
            tl.store(epoch_ptr + 1, epoch)  # epoch[1]: read only by the store kernel

    @jit_batch_sized('n')
    def _record_store_kernel(out_loc_ptr, valid_ptr, row_ptr, local_ptr, seed_ptr, positions_ptr, step_ptr,
                             scratch_ptr, epoch_ptr, rec_position_ptr, rec_prev_ptr, rec_owner_ptr, rec_step_ptr,
                             n, num_slots, owner_span, TOKEN_BITS: tl.constexpr, BLOCK: tl.constexpr):
        """The fields of each token whose key won its slot; program 0 retires the epoch into epoch[0]."""
        pid = tl.program_id(0)
        t = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m = t < n
        slot = tl.load(out_loc_ptr + t, mask=m, other=-1)
        keep = m & (tl.load(valid_ptr + t, mask=m, other=0) != 0) & (slot >= 0) & (slot < num_slots)
        epoch = tl.load(epoch_ptr + 1)
        won = keep & (tl.load(scratch_ptr + slot, mask=keep, other=-1) == (epoch << TOKEN_BITS) + t)
        row = tl.load(row_ptr + t, mask=won, other=0)
        local = tl.load(local_ptr + t, mask=won, other=0)
        seed = tl.load(seed_ptr + row, mask=won, other=0)
        before = tl.where(t == 0, n - 1, t - 1)  # roll(1) over the n tokens
        earlier = tl.load(out_loc_ptr + before, mask=won, other=0)
        prev = tl.where(local == 0, seed, tl.where(earlier < 0, 0, earlier))  # unstored predecessor: unknown (0)
        prev = tl.where(prev >= num_slots, num_slots, prev)
        step = tl.load(step_ptr)
        tl.store(rec_position_ptr + slot, tl.load(positions_ptr + t, mask=won, other=0), mask=won)
        tl.store(rec_prev_ptr + slot, prev, mask=won)
        tl.store(rec_owner_ptr + slot, step * owner_span + row, mask=won)
        tl.store(rec_step_ptr + slot, step + tl.zeros([BLOCK], tl.int64), mask=won)
        if pid == 0:
            tl.store(epoch_ptr, epoch)

    @triton.jit
    def _sweep_slice_kernel(cursor_ptr, step_ptr, live_ptr, rec_step_ptr, rec_position_ptr, rec_prev_ptr,
                            rec_owner_ptr, slot_out_ptr, position_out_ptr, prev_out_ptr, history_ptr,
                            history_rows, verified_ptr, done_ptr, size, span, num_slots, NEVER: tl.constexpr,
                            PADDING: tl.constexpr, ADVANCE: tl.constexpr, BLOCK: tl.constexpr):
        """Entries [pid * BLOCK, ...) of the slice starting at the cursor. ``ADVANCE`` 1: one program, which
        moves the cursor; 2: the last program to take a ``done`` ticket moves it and resets ``done``; 0: not moved."""
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m = e < size
        cursor = tl.load(cursor_ptr)
        slot = e + cursor
        slot = tl.where(slot < num_slots, slot, num_slots)
        written_at = tl.load(rec_step_ptr + slot, mask=m, other=NEVER)
        live = m & (tl.load(live_ptr + slot, mask=m, other=0) != 0) & (written_at != NEVER)
        prev = tl.load(rec_prev_ptr + slot, mask=m, other=0)
        position = tl.load(rec_position_ptr + slot, mask=m, other=0)
        safe_prev = tl.minimum(tl.maximum(prev, 0), num_slots)  # records hold slots <= num_slots (trash)
        prev_at = tl.load(rec_step_ptr + safe_prev, mask=m, other=NEVER)
        prev_position = tl.load(rec_position_ptr + safe_prev, mask=m, other=0)
        intact = (prev >= 0) & (prev_at <= written_at) & (prev_at != NEVER) & (prev_position == position - 1)
        prev = tl.where(prev < 0, prev, tl.where(intact, prev, 0))
        tl.store(slot_out_ptr + e, tl.where(live, slot, PADDING), mask=m)
        tl.store(position_out_ptr + e, position, mask=m)
        tl.store(prev_out_ptr + e, prev, mask=m)
        step = tl.load(step_ptr)
        hrow = ((step % history_rows) + history_rows) % history_rows  # torch.remainder: sign of the divisor
        tl.store(history_ptr + hrow * size + e, tl.load(rec_owner_ptr + slot, mask=m, other=0), mask=m)
        tl.atomic_add(verified_ptr, tl.sum(live.to(tl.int64), 0), sem="relaxed")
        moved = (((cursor + size) % span) + span) % span
        if ADVANCE == 1:
            tl.store(cursor_ptr, moved)
        elif ADVANCE == 2:  # acq_rel: every other program read the cursor before its ticket
            if tl.atomic_add(done_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
                tl.store(cursor_ptr, moved)
                tl.store(done_ptr, 0)

    @triton.jit
    def _advance_cursor_kernel(cursor_ptr, size, span):
        c = tl.load(cursor_ptr) + size
        tl.store(cursor_ptr, ((c % span) + span) % span)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def launch_token_rows(offsets: torch.Tensor, bs: int, n: int, prologue: Optional[StepPrologue] = None,
                      oracle: Optional[TokenOracle] = None) -> TokenRows:
    """Triton `token_rows_twin` (``n >= 1``; with ``prologue`` its bookkeeping too, contiguous tensors; with
    ``oracle`` the expectation too — a table whose rows are not contiguous, or that has no columns, takes the twin
    for the expected tokens): new tensors of ``n`` tokens."""
    dev = offsets.device
    row = torch.empty(n, dtype=torch.int64, device=dev)
    local = torch.empty(n, dtype=torch.int64, device=dev)
    valid = torch.empty(n, dtype=torch.uint8, device=dev)
    table = oracle.table if oracle is not None else None
    fused = table is not None and table.shape[1] > 0 and table.stride(1) == 1
    mode = 0 if oracle is None else 2 if fused else 1
    positions = torch.empty(n, dtype=torch.int64, device=dev) if mode else row
    expected = torch.empty(n, dtype=torch.int64, device=dev) if mode == 2 else row
    if mode == 2:
        o = oracle
        tail = (o.prefix, o.rows, o.lens, table, table.stride(0), table.shape[1], table.shape[0], o.input_ids,
                expected, positions)
    elif mode == 1:
        tail = (oracle.prefix, row, row, row, 0, 0, 0, row, row, positions)
    else:
        tail = (row, row, row, row, 0, 0, 0, row, row, row)
    if prologue is not None:
        p = prologue
        if p.rows_from.shape[0] > _BLOCK:
            raise KvCanaryValueError(f"kv-canary: at most {_BLOCK} rings per step prologue, got {p.rows_from.shape[0]}")
        if p.row_history.shape[1] != p.rows.shape[0] or not p.row_history.is_contiguous():
            raise KvCanaryValueError(f"kv-canary: row_history {tuple(p.row_history.shape)} must be contiguous [H, {p.rows.shape[0]}]")
        extra = (p.rows_from, p.write_index, p.rows_from.shape[0], p.row_history, p.row_history.shape[0], p.step,
                 p.rows, p.rows.shape[0], p.disabled, p.enable)
        grid = _grid(max(n, p.rows.shape[0]))
    else:
        extra = (row, row, 0, row, 1, row, row, 0, row, row)
        grid = _grid(n)
    _token_rows_kernel[grid](offsets, row, local, valid, bs, n, *extra, *tail,
                             SEARCH_STEPS=max(bs, offsets.shape[0] - 1, 0).bit_length() + 1,
                             PROLOGUE=prologue is not None, ORACLE=mode, BLOCK=_BLOCK, num_warps=_WARPS)
    found = TokenRows(row, local, valid.view(torch.bool))
    if mode == 2:
        return found._replace(expected=expected, positions=positions)
    if mode == 1 and table is not None:  # a table the kernel cannot read: the expected tokens from the twin
        return _with_expectation(found, oracle, n)
    return found._replace(positions=positions) if mode == 1 else found


def launch_record_write(records: SlotRecords, *, seeds: torch.Tensor, row: torch.Tensor, local: torch.Tensor,
                        valid: torch.Tensor, out_loc: torch.Tensor, positions: torch.Tensor, step: torch.Tensor,
                        owner_span: int) -> None:
    """Triton `record_write_twin` (``1 <= n <= MAX_RECORD_TOKENS``; int64 inputs, contiguous)."""
    n = out_loc.shape[0]
    grid = _grid(n)
    valid = valid.view(torch.uint8)
    _record_claim_kernel[grid](out_loc, valid, records.claims, records.epoch, n, records.num_slots,
                               TOKEN_BITS=KEY_TOKEN_BITS, BLOCK=_BLOCK, num_warps=_WARPS)
    _record_store_kernel[grid](out_loc, valid, row, local, seeds, positions, step, records.claims, records.epoch,
                               records.position, records.prev_slot, records.owner, records.step,
                               n, records.num_slots, owner_span, TOKEN_BITS=KEY_TOKEN_BITS, BLOCK=_BLOCK,
                               num_warps=_WARPS)


def launch_sweep_slice(*, records: SlotRecords, plan: VerifyPlan, live_mask: torch.Tensor, cursor: torch.Tensor,
                       offsets: torch.Tensor, span: int, step: torch.Tensor, owner_history: torch.Tensor,
                       verified: torch.Tensor, done: Optional[torch.Tensor] = None) -> None:
    """Triton `sweep_slice_twin` (``offsets`` only gives the size: entry e is ``cursor + e``). ``done``: int32 [1]
    of zeros, left at zero; with it the slice kernel moves the cursor itself (one launch, not two)."""
    size = offsets.shape[0]
    grid = _grid(size)
    advance = 1 if grid[0] == 1 else 2 if done is not None else 0
    _sweep_slice_kernel[grid](
        cursor, step, live_mask.view(torch.uint8), records.step, records.position, records.prev_slot, records.owner,
        plan.verify_slot_indices, plan.verify_expected_positions, plan.verify_prev_slot_indices,
        owner_history, owner_history.shape[0], verified, done if done is not None else verified, size, span,
        records.num_slots, NEVER=NEVER_WRITTEN, PADDING=TOKEN_TO_KV_SLOT_PADDING, ADVANCE=advance, BLOCK=_BLOCK,
        num_warps=_WARPS,
    )
    if advance == 0:
        _advance_cursor_kernel[(1,)](cursor, size, span, num_warps=1)
