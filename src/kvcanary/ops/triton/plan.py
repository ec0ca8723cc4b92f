"""Triton plan (docs/design.md §3.5): verify entries and write metadata in one, two or three launches.

Batches of at most ``PlanLaunchConfig.tile_rows`` rows (no LUT check pending) take one launch,
``_tile_plan_kernel``: every program computes the row starts itself (exclusive sums over at most
256 rows, in registers) and writes whole tiles of one row (a block of positions), so nothing is
searched and the request-table reads are contiguous. (Finding each entry's row by comparing it
with every start, tried first, took 37 µs for 64 x 4k entries on the H200: docs/lab/NOTES.md, run 9.)
Larger batches:

1. ``_row_block_sums_kernel`` (only when the batch spans several row blocks): per row block, the
   number of verify entries and of extend tokens.
2. ``_row_scan_kernel``: exclusive running sums per batch row into a scratch array (entry start
   and write offset of every row; the last element is the total).
3. ``_gather_kernel``: a persistent kernel, sized from the device, that writes the outputs: write
   offsets, seeds, counts, and, unless the entries overflow the capacity, every verify entry
   (each finds its row by binary search over the scratch starts, so one 100k-token row and
   thousands of one-token rows balance alike).

There is no batch-size ceiling. LUT range errors (ValueError, outputs untouched) need a host
read: outside CUDA-graph capture a check kernel finds the first offending lookup in gather order
before anything is written; under capture the check is skipped and an out-of-range lookup
stores -1 instead of reading past the LUT. No load leaves its table row: request-table reads are
masked to positions below the width (a prefix past it is planned up to the width only, seed -1)
and expected-token reads to columns below the table's width (token -1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.records import VerifyPlan, WritePlan
from kvcanary.ops.triton.constants import REQ_PADDING
from kvcanary.ops.dispatch import capturing
from kvcanary.ops.triton.launch import jit_batch_sized, num_sms, pdl_enabled, pdl_release, pdl_wait

_ROW_BLOCK = 4096
_MAX_TILE_ROWS = 256
_NO_ERROR = 2**62
_NO_ERROR_K = tl.constexpr(_NO_ERROR)


@dataclass(frozen=True, kw_only=True)
class PlanLaunchConfig:
    """entry_block / programs_per_sm / num_warps: the gather's launch shape; tile_rows: largest
    batch planned in one launch (0: never; at most 256); tile_block: positions per tile there;
    check_lut: run the host-read LUT range check (always skipped under graph capture, where an
    out-of-range lookup stores -1); pdl: programmatic dependent launch."""

    entry_block: int = 1024
    programs_per_sm: int = 4
    num_warps: int = 4
    tile_rows: int = 256
    tile_block: int = 1024
    check_lut: bool = True
    pdl: bool = True


DEFAULT_PLAN_CONFIG = PlanLaunchConfig()


@triton.jit
def _row_counts(rp_ptr, prefix_ptr, extend_ptr, rows, bs, window, n_rows, width):
    """Per batch row: (verify entries, write tokens, window start), int64. A request row outside
    ``[0, n_rows)`` counts as padding, and verify entries stop at the table width ``width``
    (both only reachable under graph capture: see ``launch_plan``)."""
    m = rows < bs
    rp = tl.load(rp_ptr + rows, mask=m, other=0).to(tl.int64)
    p = tl.load(prefix_ptr + rows, mask=m, other=0).to(tl.int64)
    e = tl.load(extend_ptr + rows, mask=m, other=0).to(tl.int64)
    active = m & (rp != REQ_PADDING) & (rp >= 0) & (rp < n_rows)
    if window > 0:
        lo = tl.maximum(p - window, 0)
    else:
        lo = p * 0
    n_verify = tl.where(active, tl.maximum(tl.minimum(p, width) - lo, 0), 0)
    n_write = tl.where(active & (e > 0), e, 0)
    return n_verify, n_write, lo


@jit_batch_sized('bs', 'nblocks')
def _row_block_sums_kernel(
    rp_ptr, prefix_ptr, extend_ptr, sums_ptr, bs, window, nblocks, n_rows, width,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    nv, nw, _lo = _row_counts(rp_ptr, prefix_ptr, extend_ptr, rows, bs, window, n_rows, width)
    tl.store(sums_ptr + pid, tl.sum(nv, 0))
    tl.store(sums_ptr + nblocks + pid, tl.sum(nw, 0))


@jit_batch_sized('bs', 'nblocks')
def _row_scan_kernel(
    rp_ptr, prefix_ptr, extend_ptr, sums_ptr, starts_ptr, bs, window, nblocks, n_rows, width,
    MULTI: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """starts[0:bs+1] = exclusive sums of verify entries; starts[bs+1:2bs+2] = of write tokens."""
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    base_v = tl.zeros([], tl.int64)
    base_w = tl.zeros([], tl.int64)
    if MULTI:
        for b in range(0, pid, BLOCK):
            blk = b + tl.arange(0, BLOCK)
            bm = blk < pid
            base_v += tl.sum(tl.load(sums_ptr + blk, mask=bm, other=0), 0)
            base_w += tl.sum(tl.load(sums_ptr + nblocks + blk, mask=bm, other=0), 0)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    nv, nw, _lo = _row_counts(rp_ptr, prefix_ptr, extend_ptr, rows, bs, window, n_rows, width)
    cv = tl.cumsum(nv, 0)
    cw = tl.cumsum(nw, 0)
    m = rows < bs
    tl.store(starts_ptr + rows, base_v + cv - nv, mask=m)
    tl.store(starts_ptr + bs + 1 + rows, base_w + cw - nw, mask=m)
    last = rows == bs - 1
    tl.store(starts_ptr + bs + rows * 0, base_v + cv, mask=last)
    tl.store(starts_ptr + 2 * bs + 1 + rows * 0, base_w + cw, mask=last)


@triton.jit
def _entry_rows(starts_ptr, e, bs, NSTEPS: tl.constexpr):
    """Batch row holding each global entry index: the last row r with starts[r] <= e."""
    lo = tl.zeros(e.shape, tl.int64)
    hi = tl.zeros(e.shape, tl.int64) + bs - 1
    for _ in tl.static_range(NSTEPS):
        mid = (lo + hi + 1) // 2
        ok = tl.load(starts_ptr + mid) <= e
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _fields_in_row(e, m, row, row_start, rp_ptr, prefix_ptr, rtt_ptr, rtt_stride, width, window):
    """(request row, position, raw slot, raw predecessor or -1, has predecessor) of entries e
    (mask m) of batch rows ``row`` whose first entry is ``row_start``. Loads stay below ``width``
    (a position at or past it reads as slot 0, predecessor -1: not reachable through the counts)."""
    row = tl.where(m, row, 0)
    rp = tl.load(rp_ptr + row, mask=m, other=0).to(tl.int64)
    p = tl.load(prefix_ptr + row, mask=m, other=0).to(tl.int64)
    if window > 0:
        lo = tl.maximum(p - window, 0)
    else:
        lo = p * 0
    pos = lo + e - row_start
    line = rtt_ptr + rp * rtt_stride
    slot_raw = tl.load(line + pos, mask=m & (pos < width), other=0).to(tl.int64)
    has_prev = m & (pos > 0)
    prev_raw = tl.load(line + pos - 1, mask=has_prev & (pos - 1 < width), other=-1).to(tl.int64)
    return rp, pos, slot_raw, prev_raw, has_prev


@triton.jit
def _entry_fields(
    e, m, starts_ptr, rp_ptr, prefix_ptr, rtt_ptr, rtt_stride, width, bs, window, NSTEPS: tl.constexpr,
):
    """(row, request row, position, raw slot, raw predecessor or -1) of entries e (mask m)."""
    row = _entry_rows(starts_ptr, e, bs, NSTEPS)
    row = tl.where(m, row, 0)
    row_start = tl.load(starts_ptr + row, mask=m, other=0)
    rp, pos, slot_raw, prev_raw, has_prev = _fields_in_row(
        e, m, row, row_start, rp_ptr, prefix_ptr, rtt_ptr, rtt_stride, width, window)
    return row, rp, pos, slot_raw, prev_raw, has_prev


@jit_batch_sized('bs')
def _lut_check_kernel(
    starts_ptr, rp_ptr, prefix_ptr, rtt_ptr, rtt_stride, width, lut_len, first_bad_ptr, bs, window,
    NSTEPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """first_bad = min over offending lookups of (2 * entry + (0 slot | 1 predecessor))."""
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(starts_ptr + bs)
    for start in range(pid * BLOCK, total, nprog * BLOCK):
        e = start + tl.arange(0, BLOCK).to(tl.int64)
        m = e < total
        _row, _rp, _pos, slot_raw, prev_raw, has_prev = _entry_fields(
            e, m, starts_ptr, rp_ptr, prefix_ptr, rtt_ptr, rtt_stride, width, bs, window, NSTEPS)
        key = tl.where(m & (slot_raw >= lut_len), 2 * e, _NO_ERROR_K)
        key = tl.minimum(key, tl.where(has_prev & (prev_raw >= lut_len), 2 * e + 1, _NO_ERROR_K))
        worst = tl.min(key, 0)
        if worst < _NO_ERROR_K:
            tl.atomic_min(first_bad_ptr, worst)


@triton.jit
def _translate(raw, lut_ptr, lut_len, HAS_LUT: tl.constexpr):
    """T(x): negative values pass through, others are looked up (-1 past the LUT's end)."""
    if HAS_LUT:
        inside = (raw >= 0) & (raw < lut_len)
        looked = tl.load(lut_ptr + raw, mask=inside, other=-1)
        return tl.where(raw < 0, raw, looked)
    else:
        return raw


@triton.jit
def _store_entries(
    e, m, row, rp, pos, slot_raw, prev_raw, lut_ptr, lut_len, table_ptr, table_stride, table_cols, valid_ptr,
    token_offset, v_slot_ptr, v_tok_ptr, v_pos_ptr, v_prev_ptr, HAS_LUT: tl.constexpr, HAS_TABLE: tl.constexpr,
):
    """Write verify entries e (mask m): translated slot and predecessor, position, token (read only
    from columns below the valid length and the table's width ``table_cols``, else -1)."""
    tl.store(v_slot_ptr + e, _translate(slot_raw, lut_ptr, lut_len, HAS_LUT), mask=m)
    tl.store(v_prev_ptr + e, _translate(prev_raw, lut_ptr, lut_len, HAS_LUT), mask=m)
    tl.store(v_pos_ptr + e, pos, mask=m)
    if HAS_TABLE:
        col = pos + token_offset
        valid = tl.load(valid_ptr + row, mask=m, other=0).to(tl.int64)
        readable = m & (col >= 0) & (col < valid) & (col < table_cols)
        tok = tl.load(table_ptr + rp * table_stride + col, mask=readable, other=-1).to(tl.int64)
    else:
        tok = tl.zeros(e.shape, tl.int64) - 1
    tl.store(v_tok_ptr + e, tok, mask=m)


@triton.jit
def _store_seeds(i, sm, rp_ptr, prefix_ptr, extend_ptr, rtt_ptr, rtt_stride, width, lut_ptr, lut_len, w_seed_ptr,
                 n_rows, HAS_LUT: tl.constexpr):
    """Seeds of batch rows i (mask sm): T(req_to_token[rp, P - 1]) or -1 (also when P - 1 is at or
    past the table width ``width``)."""
    rp = tl.load(rp_ptr + i, mask=sm, other=0).to(tl.int64)
    p = tl.load(prefix_ptr + i, mask=sm, other=0).to(tl.int64)
    e = tl.load(extend_ptr + i, mask=sm, other=0).to(tl.int64)
    seeded = sm & (rp != REQ_PADDING) & (rp >= 0) & (rp < n_rows) & (e > 0) & (p > 0) & (p - 1 < width)
    raw = tl.load(rtt_ptr + rp * rtt_stride + p - 1, mask=seeded, other=-1).to(tl.int64)
    tl.store(w_seed_ptr + i, _translate(raw, lut_ptr, lut_len, HAS_LUT), mask=sm)


@jit_batch_sized('bs', 'v_cap', 'w_cap')
def _gather_kernel(
    starts_ptr, rp_ptr, prefix_ptr, extend_ptr, rtt_ptr, rtt_stride, width, bs, window,
    lut_ptr, lut_len,
    table_ptr, table_stride, table_cols, valid_ptr, token_offset,
    v_slot_ptr, v_tok_ptr, v_pos_ptr, v_prev_ptr, v_num_ptr, v_enable_ptr, v_cap,
    w_off_ptr, w_seed_ptr, w_num_ptr, w_cap, n_rows,
    HAS_LUT: tl.constexpr, HAS_TABLE: tl.constexpr, NSTEPS: tl.constexpr,
    BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(starts_ptr + bs)
    overflow = total > v_cap
    if pid == 0:
        tl.store(v_num_ptr, tl.where(overflow, v_cap, total).to(tl.int32))
        tl.store(v_enable_ptr, tl.where(overflow, 0, 1).to(tl.int32))
        tl.store(w_num_ptr, (total * 0 + bs).to(tl.int32))
    # Write offsets (w_cap + 1 elements: the running sums, then zeros) and seeds.
    for start in range(pid * ROW_BLOCK, w_cap + 1, nprog * ROW_BLOCK):
        i = start + tl.arange(0, ROW_BLOCK)
        off = tl.load(starts_ptr + bs + 1 + i, mask=i <= bs, other=0)
        tl.store(w_off_ptr + i, off, mask=i <= w_cap)
        _store_seeds(i, (i < bs) & (i < w_cap), rp_ptr, prefix_ptr, extend_ptr, rtt_ptr, rtt_stride, width,
                     lut_ptr, lut_len, w_seed_ptr, n_rows, HAS_LUT)
    # Verify entries, unless they overflow the capacity.
    n = tl.where(overflow, 0, total)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        e = start + tl.arange(0, BLOCK).to(tl.int64)
        m = e < n
        row, rp, pos, slot_raw, prev_raw, _hp = _entry_fields(
            e, m, starts_ptr, rp_ptr, prefix_ptr, rtt_ptr, rtt_stride, width, bs, window, NSTEPS)
        _store_entries(e, m, row, rp, pos, slot_raw, prev_raw, lut_ptr, lut_len, table_ptr, table_stride, table_cols,
                       valid_ptr, token_offset, v_slot_ptr, v_tok_ptr, v_pos_ptr, v_prev_ptr, HAS_LUT, HAS_TABLE)


@jit_batch_sized('bs', 'v_cap', 'w_cap', 'tiles_per_row')
def _tile_plan_kernel(
    rp_ptr, prefix_ptr, extend_ptr, rtt_ptr, rtt_stride, width, bs, window,
    lut_ptr, lut_len,
    table_ptr, table_stride, table_cols, valid_ptr, token_offset,
    v_slot_ptr, v_tok_ptr, v_pos_ptr, v_prev_ptr, v_num_ptr, v_enable_ptr, v_cap,
    w_off_ptr, w_seed_ptr, w_num_ptr, w_cap, tiles_per_row, n_rows,
    HAS_LUT: tl.constexpr, HAS_TABLE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ZBLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """The whole plan of a batch of at most ROWS rows in one launch. Tile t = (row t // tiles_per_row,
    positions block t % tiles_per_row of that row's window); each program takes every nprog-th tile
    and finds its row's first entry and window start with masked sums over the row vector."""
    pdl_wait(PDL)
    pdl_release(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, ROWS)
    nv, nw, lo = _row_counts(rp_ptr, prefix_ptr, extend_ptr, rows, bs, window, n_rows, width)
    starts = tl.cumsum(nv, 0) - nv
    total = tl.sum(nv, 0)
    overflow = total > v_cap
    if pid == 0:
        tl.store(v_num_ptr, tl.where(overflow, v_cap, total).to(tl.int32))
        tl.store(v_enable_ptr, tl.where(overflow, 0, 1).to(tl.int32))
        tl.store(w_num_ptr, (total * 0 + bs).to(tl.int32))
        w_starts = tl.cumsum(nw, 0) - nw
        tl.store(w_off_ptr + rows, w_starts, mask=(rows < bs) & (rows <= w_cap))
        tl.store(w_off_ptr + bs + rows * 0, tl.zeros([ROWS], tl.int64) + tl.sum(nw, 0), mask=(rows == 0) & (bs <= w_cap))
        _store_seeds(rows, (rows < bs) & (rows < w_cap), rp_ptr, prefix_ptr, extend_ptr, rtt_ptr, rtt_stride, width,
                     lut_ptr, lut_len, w_seed_ptr, n_rows, HAS_LUT)
    for start in range(bs + 1 + pid * ZBLOCK, w_cap + 1, nprog * ZBLOCK):  # offsets past the batch
        i = start + tl.arange(0, ZBLOCK)
        tl.store(w_off_ptr + i, tl.zeros([ZBLOCK], tl.int64), mask=i <= w_cap)
    n_tiles = tl.where(overflow, 0, bs * tiles_per_row)
    k = tl.arange(0, BLOCK).to(tl.int64)
    for t in range(pid, n_tiles, nprog):
        r = t // tiles_per_row
        first = (t % tiles_per_row) * BLOCK
        mine = rows == r
        count = tl.sum(tl.where(mine, nv, 0), 0)
        if first < count:
            e0 = tl.sum(tl.where(mine, starts, 0), 0) + first
            pos0 = tl.sum(tl.where(mine, lo, 0), 0) + first
            rp = tl.load(rp_ptr + r).to(tl.int64)
            m = first + k < count
            pos = pos0 + k
            line = rtt_ptr + rp * rtt_stride
            slot_raw = tl.load(line + pos, mask=m & (pos < width), other=0).to(tl.int64)
            prev_raw = tl.load(line + pos - 1, mask=m & (pos > 0) & (pos - 1 < width), other=-1).to(tl.int64)
            _store_entries(e0 + k, m, r + k * 0, rp + k * 0, pos, slot_raw, prev_raw, lut_ptr, lut_len, table_ptr,
                           table_stride, table_cols, valid_ptr, token_offset, v_slot_ptr, v_tok_ptr, v_pos_ptr,
                           v_prev_ptr, HAS_LUT, HAS_TABLE)


def _nsteps(bs: int) -> int:
    """Binary-search steps to find a row among ``bs``: ceil(log2(bs)), rounded up to a multiple
    of 4 so batches of similar size share one compiled kernel."""
    steps = max(1, (bs - 1).bit_length())
    return (steps + 3) // 4 * 4


@dataclass(frozen=True)
class _Launch:
    """What every kernel of one plan launch is given: the batch rows, the request table and its bounds, the
    LUT and expected-token table arguments (stand-ins where absent), the outputs and the launch shape."""

    rows: tuple                   # req_pool_indices, prefix_lens, extend_seq_lens
    rtt: torch.Tensor             # req_to_token
    rtt_stride: int
    width: int                    # request-table columns: loads stay below them
    bs: int
    window: int
    n_rows: int                   # request rows a batch row may name (others are planned as padding)
    lut: Optional[torch.Tensor]
    lut_args: tuple
    has_table: bool
    table_args: tuple
    outputs: tuple
    v_cap: int
    w_cap: int
    sms: int
    pdl: bool
    lut_check: bool               # run the host-read LUT range check first
    config: PlanLaunchConfig


def _prepare(vp: VerifyPlan, wp: WritePlan, rows: tuple, req_to_token: torch.Tensor, swa_window_size: int,
             lut: Optional[torch.Tensor], table: Optional[torch.Tensor], valid: Optional[torch.Tensor],
             token_offset: int, config: PlanLaunchConfig) -> _Launch:
    dev = req_to_token.device
    bs = int(rows[0].shape[0])
    if table is not None and table.shape[1] == 0:
        table = None
    # Request rows outside [0, n_rows) are refused by the public launcher outside capture; under
    # capture the kernels plan such a row as padding (no entries, no writes, seed untouched as -1).
    n_rows = min(int(req_to_token.shape[0]), int(table.shape[0]) if table is not None else 2**62)
    # Prefixes past the width are refused by the public launcher likewise; under capture every
    # request-table load is masked to positions below the width (entries stop there, seed -1).
    v_cap = int(vp.verify_slot_indices.shape[0])
    w_cap = int(wp.write_seed_slot_indices.shape[0])
    outputs = (
        vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
        vp.verify_prev_slot_indices, vp.verify_num_valid, vp.enable, v_cap,
        wp.write_offsets, wp.write_seed_slot_indices, wp.write_num_valid_reqs, w_cap,
    )
    table_args = (
        table if table is not None else req_to_token, table.stride(0) if table is not None else 0,
        int(table.shape[1]) if table is not None else 0,
        valid if valid is not None else rows[0], int(token_offset),
    )
    return _Launch(
        rows=rows, rtt=req_to_token, rtt_stride=req_to_token.stride(0), width=int(req_to_token.shape[1]), bs=bs,
        window=int(swa_window_size), n_rows=n_rows, lut=lut,
        lut_args=(lut, lut.shape[0]) if lut is not None else (req_to_token, 0),
        has_table=table is not None, table_args=table_args, outputs=outputs, v_cap=v_cap, w_cap=w_cap,
        sms=num_sms(dev), pdl=pdl_enabled(dev, config.pdl),
        lut_check=config.check_lut and lut is not None and bs > 0 and not capturing(dev), config=config,
    )


def launch_plan(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
    full_to_swa_index_mapping: Optional[torch.Tensor],
    verify_capacity: int,
    req_to_verify_expected_tokens: Optional[torch.Tensor],
    req_to_verify_expected_tokens_valid_lens: Optional[torch.Tensor],
    kv_token_id_vs_position_offset: int,
    config: PlanLaunchConfig = DEFAULT_PLAN_CONFIG,
) -> None:
    """Triton twin of ``launch_canary_plan_kernels_torch_reference`` (arguments already checked
    by the public launcher). With a LUT and outside graph capture, reads one int64 back to raise
    the first LUT range error before any output is written."""
    table, valid = req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens
    if table is not None and valid is None:  # the public launcher raised already; twin message here
        raise KvCanaryValueError(
            "kv-canary: launch_canary_plan_kernels_torch_reference requires "
            "req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set"
        )
    p = _prepare(verify_plan_out, write_plan_out, (req_pool_indices, prefix_lens, extend_seq_lens), req_to_token,
                 swa_window_size, full_to_swa_index_mapping, table, valid, kv_token_id_vs_position_offset, config)
    if 0 < p.bs <= min(config.tile_rows, _MAX_TILE_ROWS) and not p.lut_check:
        _launch_tiles(p)
        return
    starts = _row_starts(p)
    nsteps = _nsteps(p.bs)
    if p.lut_check:
        _check_lut(p, starts, nsteps)
    _launch_gather(p, starts, nsteps)


def _launch_tiles(p: _Launch) -> None:
    """The whole plan in one launch (`_tile_plan_kernel`)."""
    rows = max(16, triton.next_power_of_2(p.bs))
    block = p.config.tile_block
    tiles_per_row = max(1, triton.cdiv(min(p.width, p.window) if p.window > 0 else p.width, block))
    grid = (max(1, min(p.bs * tiles_per_row, p.sms * p.config.programs_per_sm)),)
    _tile_plan_kernel[grid](
        *p.rows, p.rtt, p.rtt_stride, p.width, p.bs, p.window,
        *p.lut_args, *p.table_args, *p.outputs, tiles_per_row, p.n_rows,
        HAS_LUT=p.lut is not None, HAS_TABLE=p.has_table, ROWS=rows, BLOCK=block, ZBLOCK=1024,
        PDL=p.pdl, num_warps=p.config.num_warps, launch_pdl=p.pdl,
    )


def _row_starts(p: _Launch) -> torch.Tensor:
    """Scratch int64 [2 * bs + 2 + 2 * blocks]: each row's entry start and write offset (the last: the
    totals), then the per-block sums (`_row_block_sums_kernel`, `_row_scan_kernel`)."""
    bs, pdl = p.bs, p.pdl
    nblocks = max(1, triton.cdiv(bs, _ROW_BLOCK))
    starts = torch.empty(2 * bs + 2 + 2 * nblocks, dtype=torch.int64, device=p.rtt.device)
    sums = starts[2 * bs + 2:]
    if bs == 0:
        starts[:2].zero_()
        return starts
    if nblocks > 1:
        _row_block_sums_kernel[(nblocks,)](
            *p.rows, sums, bs, p.window, nblocks, p.n_rows, p.width,
            BLOCK=_ROW_BLOCK, PDL=pdl, num_warps=8, launch_pdl=pdl)
    _row_scan_kernel[(nblocks,)](
        *p.rows, sums, starts, bs, p.window, nblocks, p.n_rows, p.width,
        MULTI=nblocks > 1, BLOCK=_ROW_BLOCK, PDL=pdl, num_warps=8, launch_pdl=pdl)
    return starts


def _check_lut(p: _Launch, starts: torch.Tensor, nsteps: int) -> None:
    """Raise the first LUT range error in gather order (one int64 read back), before anything is written."""
    entry_block = p.config.entry_block
    first_bad = torch.full((1,), _NO_ERROR, dtype=torch.int64, device=p.rtt.device)
    grid = (max(1, min(triton.cdiv(max(p.v_cap, 1), entry_block), p.sms * p.config.programs_per_sm)),)
    req_pool_indices, prefix_lens, _ = p.rows
    _lut_check_kernel[grid](
        starts, req_pool_indices, prefix_lens, p.rtt, p.rtt_stride, p.width, p.lut.shape[0], first_bad,
        p.bs, p.window, NSTEPS=nsteps, BLOCK=entry_block, PDL=p.pdl, num_warps=4, launch_pdl=p.pdl)
    key = int(first_bad.item())
    if key != _NO_ERROR:
        _raise_lut_error(key, starts, req_pool_indices, prefix_lens, p.rtt, p.bs, p.window, int(p.lut.shape[0]))


def _launch_gather(p: _Launch, starts: torch.Tensor, nsteps: int) -> None:
    """Every output from the row starts (`_gather_kernel`)."""
    entry_block = p.config.entry_block
    grid = (max(1, min(triton.cdiv(max(p.v_cap, p.w_cap + 1), entry_block), p.sms * p.config.programs_per_sm)),)
    _gather_kernel[grid](
        starts, *p.rows, p.rtt, p.rtt_stride, p.width, p.bs, p.window,
        *p.lut_args, *p.table_args, *p.outputs, p.n_rows,
        HAS_LUT=p.lut is not None, HAS_TABLE=p.has_table, NSTEPS=nsteps,
        BLOCK=entry_block, ROW_BLOCK=entry_block, PDL=p.pdl, num_warps=p.config.num_warps, launch_pdl=p.pdl,
    )


def _raise_lut_error(key, starts, rp, prefix, rtt, bs, window, lut_len) -> None:
    """Recompute the raw value of lookup ``key`` (2 * entry + is_predecessor) on the host."""
    entry, is_prev = divmod(key, 2)
    row_starts = starts[:bs + 1].cpu()
    row = int(torch.searchsorted(row_starts, torch.tensor([entry]), right=True)[0]) - 1
    p = int(prefix[row])
    lo = max(p - window, 0) if window > 0 else 0
    pos = lo + entry - int(row_starts[row]) - is_prev
    value = int(rtt[int(rp[row]), pos])
    raise KvCanaryValueError(f"kv-canary: SWA slot {value} is outside full_to_swa_index_mapping length {lut_len}")
