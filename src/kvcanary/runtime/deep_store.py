"""`store_deep_fingerprints`: the deep buffers' records of one TAIL write, without a chain walk of their own.

A deep buffer (`CanaryGroup.deep_bufs`: LANES-mode fingerprints of up to four layers of one side) holds the same
token, position and prev_hash as its side's TAIL buffer — every write gives both the same plan, inputs and
(in lockstep) seed records, and the chain hash does not read the REAL_KV field. So after the TAIL write, each
written slot's deep record is the TAIL record's first three fields plus the deep sources' fingerprint: the
bytes a full write into the deep buffer stores, without its per-request serial walk (which dominated the
deep writes of long prefills: docs/lab/NOTES.md run 37). Out-of-range slots are reported by the TAIL write.

Entries stored: ``i`` in the write plan's range ``[offsets[0], offsets[a])`` (``a`` = its valid requests,
clamped to its capacity; none when ``a == 0`` or ``offsets[a] <= 0``) whose slot ``out_loc[i]`` lies in
``[0, rows of the buffer)`` — the entries the write op stores. A slot written twice stores the same bytes.

`store_deep_fingerprints` runs on CUDA one Triton launch per kind of deep buffer (buffers whose sources have the same
row widths: a grid axis over the buffers, whose addresses come from a small device table built on the first eager
call or by `prepare_deep_store`), so the buffers' serial folds run side by side instead of one launch after another;
the twin `store_deep_fingerprints_twin` elsewhere, bit-identical. Device reads only: capturable (a table missing
while capturing falls back to one launch per buffer, so build the tables with `prepare_deep_store` before a CUDA
graph is captured). Tables are never freed: a captured graph holds their addresses.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvcanary.ops import WritePlan, dispatch
from kvcanary.ops.constants import (
    CANARY_FIELD_POSITION, CANARY_FIELD_PREV_HASH, CANARY_FIELD_REAL_KV_HASH, CANARY_FIELD_TOKEN, RealKvHashMode,
)
from kvcanary.ops.records import RealKvSource
from kvcanary.ops.reference.real_kv import fingerprint_slots

try:  # Triton is optional: CPU-only installs use the twin.
    import triton
    import triton.language as tl

    from kvcanary.ops.triton.constants import F_POSITION, F_PREV_HASH, F_REAL_KV, F_TOKEN
    from kvcanary.ops.triton.hashing import as_i64, fingerprint, source_args
    from kvcanary.ops.triton.launch import jit_batch_sized
except Exception:  # pragma: no cover - depends on the environment
    AVAILABLE = False
else:
    AVAILABLE = True

DeepTarget = tuple[torch.Tensor, torch.Tensor, tuple[RealKvSource, ...]]  # (TAIL buffer, deep buffer, its sources)
DEEP_HASH_MODE = RealKvHashMode.LANES
"""How deep records fingerprint their sources: every byte, words hashed in parallel (docs/design.md §3.2)."""
_CHAIN_FIELDS = (CANARY_FIELD_TOKEN, CANARY_FIELD_POSITION, CANARY_FIELD_PREV_HASH)
_TILE_WORDS = 1024  # words per program and step of the LANES fold: tokens x columns (8 per thread at 4 warps)
_MIN_BLOCK = 4  # tokens per program at the least (a decode step's 64 tokens: 16 programs per deep buffer)
_MAX_COLS = 256  # the widest column tile: a 2 KiB strip (e.g. 8 heads x 128 x bf16) in one step
_WARPS = 4


def _launch_shape(consts: dict) -> tuple[dict, int]:
    """The deep store's compile-time shape: the sources' consts with ``LANES_CH`` widened to the whole strip (up to
    `_MAX_COLS` words) and BLOCK tokens per program such that BLOCK x LANES_CH = `_TILE_WORDS` (4 tokens of 2 KiB
    strips), so a decode step's few tokens still spread over many programs and each source is one wide load."""
    widest = max(consts[f"W{i}"] for i in range(consts["NSRC"])) if consts["NSRC"] else 2
    cols = min(triton.next_power_of_2(widest), _MAX_COLS)
    return dict(consts, LANES_CH=cols), max(_MIN_BLOCK, min(256, _TILE_WORDS // cols))


def stored_entries(plan: WritePlan, out_loc: torch.Tensor, num_slots: int) -> torch.Tensor:
    """bool [n]: the entries of ``out_loc`` (int [n]) that the write op stores (see the module docstring)."""
    cap = plan.write_seed_slot_indices.shape[0]
    a = plan.write_num_valid_reqs.to(torch.int64).clamp(0, cap)
    offsets = plan.write_offsets
    end = torch.where(a > 0, offsets[a], 0)
    i = torch.arange(out_loc.shape[0], device=out_loc.device)
    slot = out_loc.to(torch.int64)
    return (i >= offsets[0]) & (i < end) & (slot >= 0) & (slot < num_slots)


def store_deep_fingerprints_twin(*, targets: Sequence[DeepTarget], out_loc: torch.Tensor, plan: WritePlan) -> None:
    """Torch twin: every buffer uint8 [rows, stride_bytes] (a deep buffer as many rows as its TAIL buffer);
    ``out_loc`` int [n]."""
    fields = list(_CHAIN_FIELDS)
    for tail_buf, buf, sources in targets:
        tail, words = tail_buf.view(torch.int64), buf.view(torch.int64)
        slots = out_loc.to(torch.int64)[stored_entries(plan, out_loc, tail.shape[0])]
        words[slots[:, None], torch.tensor(fields, device=words.device)[None, :]] = tail[slots][:, fields]
        words[slots, CANARY_FIELD_REAL_KV_HASH] = fingerprint_slots(sources, DEEP_HASH_MODE, slots, words.device)


def store_deep_fingerprints(*, targets: Sequence[DeepTarget], out_loc: torch.Tensor, plan: WritePlan) -> None:
    """For each ``(tail_buf, deep_buf, sources)`` of ``targets``, the deep records of the entries just written
    into ``tail_buf`` (module docstring): one Triton launch per kind of target on CUDA when the kernel can address
    every source (one per target where a kind has no table), else the twin."""
    if not targets or out_loc.shape[0] == 0:
        return
    groups = _kernel_groups(targets)
    if groups is None:
        store_deep_fingerprints_twin(targets=targets, out_loc=out_loc, plan=plan)
        return
    for group in groups:
        if len(group) == 1 or not _launch_kind(group, out_loc, plan):
            for tail, buf, srcs in group:
                _launch(tail, buf, srcs, out_loc, plan)


def prepare_deep_store(targets: Sequence[DeepTarget]) -> None:
    """Build the device tables `store_deep_fingerprints` uses for ``targets`` now (eager, before a CUDA graph that
    stores into them is captured); nothing where the twin runs, or while capturing."""
    for group in _kernel_groups(targets) or ():
        if len(group) > 1:
            _table(group)


def _kernel_groups(targets: Sequence[DeepTarget]) -> Optional[list[list]]:
    """``targets`` as Triton launches grouped by kind (`_by_kind`), or None where the twin runs (no targets, not
    CUDA, no Triton, Triton not serving the device — `kvcanary.ops.dispatch.triton_backend`: turned off, or
    ``selected_backend("torch")`` —, or a source the kernel cannot address)."""
    if not targets or not AVAILABLE or not targets[0][0].is_cuda:
        return None
    if dispatch.triton_backend(targets[0][0].device) is None:
        return None
    launches = [(tail, buf, source_args(sources, DEEP_HASH_MODE, tail)) for tail, buf, sources in targets]
    return _by_kind(launches) if all(srcs is not None for *_, srcs in launches) else None


def _by_kind(launches: list) -> list[list]:
    """``(tail, deep, SourceArgs)`` launches grouped by their sources' compile-time shape (NSRC, W0..W3, LANES_CH), in
    order."""
    kinds: dict[tuple, list] = {}
    for launch in launches:
        kinds.setdefault(tuple(sorted(launch[2].consts.items())), []).append(launch)
    return list(kinds.values())


# a kind's buffers -> (addresses, integers) on device. Never cleared (a captured graph reads them); a few hundred
# bytes per set of buffers, and buffers at the same addresses with the same shapes reuse their entry.
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_ADDR_COLS, _INT_COLS = 6, 15  # tail, deep, 4 sources | tail stride, deep stride, rows, (page, words, row words) x 4


def _table(group: list) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Device tables of ``group``'s buffers: int64 [T, 6] addresses and [T, 15] integers (built once, not while a
    CUDA graph is captured: None then)."""
    addrs, ints = [], []
    for tail, buf, srcs in group:
        a = srcs.args
        addrs.append([tail.data_ptr(), buf.data_ptr(), *(a[4 * j].data_ptr() for j in range(4))])
        words = buf.view(torch.int64)
        ints.append([tail.view(torch.int64).shape[1], words.shape[1], words.shape[0],
                     *(int(a[4 * j + c]) for j in range(4) for c in (1, 2, 3))])
    key = tuple(map(tuple, addrs)) + tuple(map(tuple, ints))
    table = _TABLES.get(key)
    if table is None:
        if group[0][0].is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        dev = group[0][0].device
        table = _TABLES[key] = (torch.tensor(addrs, dtype=torch.int64, device=dev),
                                torch.tensor(ints, dtype=torch.int64, device=dev))
    return table


def _launch_kind(group: list, out_loc: torch.Tensor, plan: WritePlan) -> bool:
    """One launch for every buffer of ``group`` (one kind); False when its table cannot be built now."""
    table = _table(group)
    if table is None:
        return False
    n = out_loc.shape[0]
    consts, block = _launch_shape(group[0][2].consts)
    _deep_store_kinds_kernel[(triton.cdiv(n, block), len(group))](
        table[0], table[1], out_loc, n, plan.write_offsets, plan.write_num_valid_reqs,
        plan.write_seed_slot_indices.shape[0], **consts, BLOCK=block, num_warps=_WARPS,
    )
    return True


def _launch(tail_buf: torch.Tensor, buf: torch.Tensor, srcs, out_loc: torch.Tensor, plan: WritePlan) -> None:
    tail, words = tail_buf.view(torch.int64), buf.view(torch.int64)
    n = out_loc.shape[0]
    consts, block = _launch_shape(srcs.consts)
    _deep_store_kernel[(triton.cdiv(n, block),)](
        tail, tail.shape[1], words, words.shape[1], words.shape[0], out_loc, n,
        plan.write_offsets, plan.write_num_valid_reqs, plan.write_seed_slot_indices.shape[0],
        *srcs.args, **consts, BLOCK=block, num_warps=_WARPS,
    )


if AVAILABLE:

    @jit_batch_sized('n', 'seed_cap', scalar_ptrs=('num_reqs_ptr',))
    def _deep_store_kernel(
        tail_ptr, tail_stride, deep_ptr, deep_stride, num_slots, slot_ptr, n, off_ptr, num_reqs_ptr, seed_cap,
        s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
        NSRC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
        LANES_CH: tl.constexpr, BLOCK: tl.constexpr,
    ):
        _store_block(tail_ptr, tail_stride, deep_ptr, deep_stride, num_slots, slot_ptr, n, off_ptr, num_reqs_ptr,
                     seed_cap, s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
                     NSRC, W0, W1, W2, W3, LANES_CH, BLOCK)

    @jit_batch_sized('n', 'seed_cap', scalar_ptrs=('num_reqs_ptr',))
    def _deep_store_kinds_kernel(
        addr_ptr, int_ptr, slot_ptr, n, off_ptr, num_reqs_ptr, seed_cap,
        NSRC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
        LANES_CH: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """`_deep_store_kernel` for buffer ``program_id(1)`` of a table (`_table`)."""
        a = addr_ptr + tl.program_id(1).to(tl.int64) * 6
        v = int_ptr + tl.program_id(1).to(tl.int64) * 15
        _store_block(_address(a, 0), tl.load(v), _address(a, 1), tl.load(v + 1), tl.load(v + 2), slot_ptr, n, off_ptr,
                     num_reqs_ptr, seed_cap,
                     _address(a, 2), tl.load(v + 3), tl.load(v + 4), tl.load(v + 5),
                     _address(a, 3), tl.load(v + 6), tl.load(v + 7), tl.load(v + 8),
                     _address(a, 4), tl.load(v + 9), tl.load(v + 10), tl.load(v + 11),
                     _address(a, 5), tl.load(v + 12), tl.load(v + 13), tl.load(v + 14),
                     NSRC, W0, W1, W2, W3, LANES_CH, BLOCK)

    @triton.jit
    def _address(row, k):
        """Entry ``k`` of an address row as an int64 pointer."""
        return tl.load(row + k).to(tl.pointer_type(tl.int64))

    @triton.jit
    def _store_block(
        tail_ptr, tail_stride, deep_ptr, deep_stride, num_slots, slot_ptr, n, off_ptr, num_reqs_ptr, seed_cap,
        s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
        NSRC: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
        LANES_CH: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Deep records of the program's BLOCK entries of one buffer (the module docstring's entries)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        a = tl.minimum(tl.maximum(tl.load(num_reqs_ptr).to(tl.int64), 0), seed_cap)
        end = tl.where(a > 0, tl.load(off_ptr + a), 0)
        begin = tl.load(off_ptr)
        s = tl.load(slot_ptr + i, mask=i < n, other=-1).to(tl.int64)
        inside = (i < n) & (i >= begin) & (i < end) & (s >= 0) & (s < num_slots)
        row = tl.where(inside, s, 0)
        src = tail_ptr + row * tail_stride
        tok = tl.load(src + F_TOKEN, mask=inside, other=0)
        pos = tl.load(src + F_POSITION, mask=inside, other=0)
        prev = tl.load(src + F_PREV_HASH, mask=inside, other=0)
        fp = fingerprint(s, inside, s0, p0, n0, r0, s1, p1, n1, r1, s2, p2, n2, r2, s3, p3, n3, r3,
                         NSRC, W0, W1, W2, W3, LANES_CH)
        dst = deep_ptr + row * deep_stride
        tl.store(dst + F_TOKEN, tok, mask=inside)
        tl.store(dst + F_POSITION, pos, mask=inside)
        tl.store(dst + F_PREV_HASH, prev, mask=inside)
        tl.store(dst + F_REAL_KV, as_i64(fp), mask=inside)
