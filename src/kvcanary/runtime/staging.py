"""`StaticBatch`: the canary's fixed device buffers for one forward's inputs.

Every per-forward launch reads these buffers and nothing else that changes shape, so the launches
can be captured once in a CUDA graph and replayed for any batch that fits:

* ``rows`` / ``prefix`` / ``extend`` / ``token_lens`` / ``context_keys`` / ``shared``: int64 ``[max_rows]`` — the
  batch rows, padded with request row 0 (the padding row: inactive whatever its lengths say) and zero lengths;
* ``input_ids`` / ``positions`` / ``expected_ids``: int64 ``[max_tokens]``;
* ``out_loc[group]``: int64 ``[max_tokens]`` — slots written, padded with -1 (not stored);
* per group, the engine's position -> slot table, LUT and token history are held *by reference*
  (the engine owns them; keep the same tensor objects while a graph is captured).

All of these per-forward buffers are views of one packed int64 device buffer. `stage` is copies only (no
host reads), O(1) Python per forward whatever the batch size, by one of two routes:

* the batch's tensors live in host memory (an engine that builds its metadata on the CPU) and the canary
  on a CUDA device: they are packed into a pinned host mirror of that buffer (one multi-tensor host copy,
  padding kept in the mirror) and uploaded with **one** non-blocking copy. A small ring of mirrors, each
  guarded by an event, lets the host fill the next while the device still reads the last (a wait only when
  the device is a whole ring behind, counted in ``upload_waits``);
* otherwise (device tensors, or while an engine captures its forward): one multi-tensor device copy.

A decode-sized second set of buffers (``max_rows`` rows, `small_tokens` tokens; made when the token capacity
exceeds it) takes every batch of at most `small_tokens` tokens staged outside a capture: its whole packed buffer is
a few KiB, so the upload that serves a decode step no longer carries every token field's full capacity (330 KB
at 8192 tokens and two groups). ``active`` names the set the views point at; graphs captured for the decode
bucket read the small set (`CanaryGraphs`), a capture of the engine's forward the full one.

Buffers grow between steps when a batch exceeds them (logged, counted in ``growths``); a graph
captured before a growth is stale, so growing while graphs are held is an error.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.runtime.batch import BatchDescription, BlockTable, RewriteCounter
from kvcanary.runtime.cuda_host import capturing, current_stream

logger = logging.getLogger("kvcanary")

NOT_STORED = -1  # out_loc padding: the write op skips negative slots
ROW_FIELDS = ("rows", "prefix", "extend", "token_lens", "context_keys", "shared")
TOKEN_FIELDS = ("input_ids", "positions", "expected_ids")
MIRRORS = 4  # pinned host mirrors in the upload ring
SMALL_TOKENS = 256  # the decode-sized buffer set's token capacity (and the canary graphs' decode bucket)


@dataclass(frozen=True, kw_only=True)
class GroupInputs:
    """One group's by-reference inputs: req_to_token int32 [max_reqs, max_len]; lut int64 or None; the block table
    HEAD fills req_to_token from and the rewrite counter it marks (`BlockTable`, `RewriteCounter`), or None."""

    req_to_token: torch.Tensor
    lut: Optional[torch.Tensor]
    block_table: Optional[BlockTable] = None
    rewrites: Optional[RewriteCounter] = None

    def paged_key(self) -> tuple:
        """What launches captured on these inputs read of the block table and the counter."""
        rw = self.rewrites
        return (self.block_table.key() if self.block_table is not None else None,
                (rw.ever_written.data_ptr(), rw.rewritten.data_ptr(), rw.ever_written.shape[0]) if rw is not None else None)


class _Layout:
    """Where each field lives in the packed buffer: ``views(buffer)`` -> {field: 1-D view}."""

    def __init__(self, groups: tuple[str, ...], max_rows: int, max_tokens: int) -> None:
        self.spans: dict[str, tuple[int, int]] = {}
        at = 0
        for name in ROW_FIELDS:
            self.spans[name] = (at, max_rows)
            at += max_rows
        for name in TOKEN_FIELDS + tuple(f"out_loc:{g}" for g in groups):
            self.spans[name] = (at, max_tokens)
            at += max_tokens
        self.size = at

    def buffer(self, device: torch.device, *, pinned: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        packed = torch.zeros(self.size, dtype=torch.int64, device=device, pin_memory=pinned)
        views = {name: packed[at : at + n] for name, (at, n) in self.spans.items()}
        for name, view in views.items():
            if name.startswith("out_loc:"):
                view.fill_(NOT_STORED)
        return packed, views


class _Mirror:
    """One pinned host copy of the packed buffer, the extents it holds data in, and its upload event."""

    def __init__(self, layout: _Layout, pinned: bool) -> None:
        self.packed, self.views = layout.buffer(torch.device("cpu"), pinned=pinned)
        self.extent = {name: 0 for name in layout.spans}  # field -> entries holding data (beyond: padding)
        self.event = torch.cuda.Event() if pinned else None  # recorded after the upload that read this mirror
        self.plans: dict[tuple, tuple] = {}  # batch signature -> (host destinations, zero pads, -1 pads)


class _BufferSet:
    """One packed device buffer, its field views, its pinned mirrors, and the extents staged into it last
    (``rows`` / ``tokens``: beyond them the device buffer holds padding)."""

    def __init__(self, layout: _Layout, device: torch.device) -> None:
        self.layout = layout
        self.packed, self.views = layout.buffer(device)
        self.mirrors: list[_Mirror] = []  # made on first use
        self.next_mirror = 0
        self.rows = layout.spans["rows"][1]  # everything, initially
        self.tokens = layout.spans["input_ids"][1]


class StaticBatch:
    """Static per-forward input buffers (see the module docstring)."""

    def __init__(self, *, groups: tuple[str, ...], max_rows: int, max_tokens: int, device: torch.device,
                 host_upload: Optional[bool] = None, small_tokens: int = SMALL_TOKENS) -> None:
        self.groups = groups
        self.device = device
        self.small_tokens = small_tokens
        self.growths = 0
        self.upload_waits = 0  # stages that waited for the device to release a host mirror
        self.frozen = False  # True while a captured graph reads these buffers
        self.inputs: dict[str, GroupInputs] = {}
        self.token_table: Optional[torch.Tensor] = None
        self.has_oracle = False
        self.has_context = False  # a batch carried context keys (from then on they are staged every step)
        self.has_shared = False  # a batch carried shared_lens (from then on staged every step, zeros when absent)
        # host-memory batches go through pinned mirrors + one upload (CUDA; a test may force it on the CPU)
        self.host_upload = device.type == "cuda" if host_upload is None else host_upload
        self._allocate(max_rows, max_tokens)

    def _allocate(self, max_rows: int, max_tokens: int) -> None:
        dev = self.device
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.sets = {"full": _BufferSet(_Layout(self.groups, max_rows, max_tokens), dev)}
        if self.has_small_set(max_rows, max_tokens):
            self.sets["small"] = _BufferSet(_Layout(self.groups, max_rows, self.small_tokens), dev)
        self.activate("full")
        self.token_arange = torch.arange(max_tokens, dtype=torch.int64, device=dev)
        self.row_arange = torch.arange(max_rows, dtype=torch.int64, device=dev)
        self._entry_aranges: dict[int, torch.Tensor] = {}
        self._bs = max_rows  # rows / tokens of the last stage (everything, initially)
        self._n = max_tokens

    def has_small_set(self, max_rows: int, max_tokens: int) -> bool:
        """Whether buffers of this capacity get the decode-sized set (rows within the decode bucket's)."""
        return max_tokens > self.small_tokens and max_rows <= self.small_tokens

    def activate(self, name: str) -> None:
        """Point the field views (``rows`` ... ``out_loc``) at buffer set ``name`` ("full" or "small")."""
        views = self.sets[name].views
        self.active = name
        self.packed = self.sets[name].packed
        self.rows, self.prefix, self.extend, self.token_lens, self.context_keys, self.shared = (views[f] for f in ROW_FIELDS)
        self.input_ids, self.positions, self.expected_ids = (views[f] for f in TOKEN_FIELDS)
        self.out_loc = {g: views[f"out_loc:{g}"] for g in self.groups}

    def entry_arange(self, n: int) -> torch.Tensor:
        """``arange(n)`` on the device, cached per length (plan capacities)."""
        t = self._entry_aranges.get(n)
        if t is None:
            t = self._entry_aranges[n] = torch.arange(n, dtype=torch.int64, device=self.device)
        return t

    @property
    def num_rows(self) -> int:
        """Rows of the last staged batch (host-known from its shape)."""
        return self._bs

    @property
    def num_tokens(self) -> int:
        return self._n

    def stage(self, batch: BatchDescription) -> None:
        """Copy ``batch`` into the buffers and pad the rest (see the module docstring for the two routes)."""
        bs, n = batch.batch_size, batch.num_tokens
        if bs > self.max_rows or n > self.max_tokens:
            self._grow(bs, n)
        self._by_reference(batch)
        fields = self._fields(batch, n)
        cap = capturing()
        self.activate("small" if not cap and "small" in self.sets and n <= self.small_tokens else "full")
        target = self.sets[self.active]
        if self.host_upload and not cap and all(t.is_cpu for t in fields.values()):
            self._upload(target, fields)
        else:
            self._copy(target, fields, n, cap)
        target.rows, target.tokens = bs, n
        self._bs, self._n = bs, n

    def _by_reference(self, batch: BatchDescription) -> None:
        """Hold the engine's tables (and check they are the captured ones while frozen)."""
        for name in self.groups:
            gb = batch.groups[name]
            held = self.inputs.get(name)
            table = gb.req_to_token
            if (held is not None and held.req_to_token is table and held.lut is gb.full_to_group_lut
                    and held.block_table is gb.block_table and held.rewrites is gb.rewrites):
                continue
            if table.dtype != torch.int32:
                if gb.block_table is not None:
                    raise KvCanaryValueError(f"kv-canary: group {name!r} has a block_table, so its req_to_token (which "
                                             f"HEAD writes) must be int32, got {table.dtype}")
                table = table.to(torch.int32)  # a copy per forward: give int32 tables to avoid it
            inputs = GroupInputs(req_to_token=table, lut=gb.full_to_group_lut, block_table=gb.block_table,
                                 rewrites=gb.rewrites)
            if self.frozen and held is not None and not _same_inputs(held, inputs):
                raise KvCanaryValueError(
                    f"kv-canary: group {name!r} req_to_token / full_to_group_lut / block_table are not the tensors the "
                    "canary's graphs were captured with; keep the same (int32) tensor objects while graphs are held"
                )
            self.inputs[name] = inputs
        if not self.frozen:
            self.has_oracle = batch.expected_input_ids is not None
        elif batch.token_table is not self.token_table or (batch.expected_input_ids is not None) != self.has_oracle:
            raise KvCanaryValueError(
                "kv-canary: token_table / expected_input_ids changed since the canary's graphs were captured; "
                "keep the same token_table object and oracle setting while graphs are held"
            )
        self.token_table = batch.token_table
        if batch.context_keys is not None and not self.has_context:
            if self.frozen:
                raise KvCanaryValueError("kv-canary: context_keys appeared after the canary's graphs were captured; "
                                         "stage a batch with context_keys before capturing")
            self.has_context = True

    def new_inputs(self, batch: BatchDescription) -> Optional[str]:
        """What ``batch`` brings that graphs captured on these buffers cannot take, or None: context keys for the first
        time; more rows or tokens than the buffers hold (e.g. positions an adapter adds for same-step prefix shares,
        on top of the engine's own token budget)."""
        if batch.context_keys is not None and not self.has_context:
            return "a batch carries context keys for the first time"
        for name in self.groups:
            held, gb = self.inputs.get(name), batch.groups[name]
            if held is not None and held.paged_key() != GroupInputs(
                    req_to_token=gb.req_to_token, lut=None, block_table=gb.block_table, rewrites=gb.rewrites).paged_key():
                return f"group {name!r}'s block table or rewrite counter is not the one the graphs were captured with"
        if batch.batch_size > self.max_rows or batch.num_tokens > self.max_tokens:
            return (f"a batch of {batch.batch_size} rows / {batch.num_tokens} tokens exceeds the static buffers "
                    f"({self.max_rows} / {self.max_tokens})")
        return None

    def _fields(self, batch: BatchDescription, n: int) -> dict[str, torch.Tensor]:
        """Field -> values this batch provides. Fields it leaves out (no oracle, no token history) are not read this
        step; context keys, once seen, are staged every step (all padding when a batch has none)."""
        fields = {"rows": batch.req_pool_indices, "prefix": batch.prefix_lens, "extend": batch.extend_lens,
                  "input_ids": _first(batch.input_ids, n), "positions": _first(batch.positions, n)}
        if batch.expected_input_ids is not None:
            fields["expected_ids"] = _first(batch.expected_input_ids, n)
        for name in self.groups:
            fields[f"out_loc:{name}"] = _first(batch.groups[name].out_cache_loc, n)
        if batch.context_keys is not None:
            fields["context_keys"] = batch.context_keys
        elif self.has_context:
            fields["context_keys"] = batch.req_pool_indices.new_zeros(0)  # no keys this step: all padding
        if batch.token_table_lens is not None:
            fields["token_lens"] = batch.token_table_lens
        if batch.shared_lens is not None:
            self.has_shared = True
            fields["shared"] = batch.shared_lens
        elif self.has_shared:
            fields["shared"] = batch.req_pool_indices.new_zeros(0)  # no shares this step: all padding (0)
        return fields

    def _copy(self, target: _BufferSet, fields: dict[str, torch.Tensor], n: int, cap: bool) -> None:
        """Device route: one multi-tensor copy into the set's device views, then the pads."""
        views = target.views
        stale_rows = self.max_rows if cap else target.rows  # a graph may replay after any other batch
        stale_tokens = self.max_tokens if cap else target.tokens
        dst, src, zero, not_stored = [], [], [], []
        for name, values in fields.items():
            view, m = views[name], int(values.shape[0])
            if m:
                dst.append(view[:m])
                src.append(values)
            stale = stale_rows if name in ROW_FIELDS else max(stale_tokens, n)  # out_loc may hold fewer than n
            if stale > m:
                (not_stored if name.startswith("out_loc:") else zero).append(view[m:stale])
        if dst:  # an empty batch (a warm-up) copies nothing
            torch._foreach_copy_(dst, src, non_blocking=True)
        if zero:
            torch._foreach_zero_(zero)
        for buf in not_stored:
            buf.fill_(NOT_STORED)

    def _upload(self, target: _BufferSet, fields: dict[str, torch.Tensor]) -> None:
        """Host route: fill the set's next pinned mirror (padding kept there), then one upload of its whole buffer."""
        mirror = self._mirror(target)
        signature = tuple((name, int(t.shape[0])) for name, t in fields.items())
        key = (signature, tuple(mirror.extent.values()))
        plan = mirror.plans.get(key)
        if plan is None:
            if len(mirror.plans) > 64:
                mirror.plans.clear()
            plan = mirror.plans[key] = self._mirror_plan(mirror, signature)
        dst, zero, not_stored = plan
        torch._foreach_copy_(dst, [t for t in fields.values() if t.shape[0]])
        if zero:
            torch._foreach_zero_(zero)
        for buf in not_stored:
            buf.fill_(NOT_STORED)
        mirror.extent.update(signature)
        target.packed.copy_(mirror.packed, non_blocking=True)
        if mirror.event is not None:
            mirror.event.record(current_stream())

    def _mirror_plan(self, mirror: _Mirror, signature: tuple) -> tuple[list, list, list]:
        """The mirror views one batch shape writes, and the pads left over from what the mirror held."""
        dst, zero, not_stored = [], [], []
        for name, m in signature:
            view = mirror.views[name]
            if m:
                dst.append(view[:m])
            held = mirror.extent[name]
            if held > m:
                (not_stored if name.startswith("out_loc:") else zero).append(view[m:held])
        return dst, zero, not_stored

    def _mirror(self, target: _BufferSet) -> _Mirror:
        """The set's next mirror of the ring, once the device has finished reading it."""
        if not target.mirrors:
            pinned = self.device.type == "cuda"
            target.mirrors = [_Mirror(target.layout, pinned) for _ in range(MIRRORS if pinned else 1)]
        mirror = target.mirrors[target.next_mirror]
        target.next_mirror = (target.next_mirror + 1) % len(target.mirrors)
        if mirror.event is not None and not mirror.event.query():
            self.upload_waits += 1
            mirror.event.synchronize()
        return mirror

    def clear(self) -> None:
        """Pad every set (an empty batch: no active row, no stored token). Keeps the by-reference inputs."""
        for target in self.sets.values():
            for name, view in target.views.items():
                if name.startswith("out_loc:"):
                    view.fill_(NOT_STORED)
                elif name in ROW_FIELDS:
                    view.zero_()
            target.rows = target.tokens = 0
        self._bs = self._n = 0

    def _grow(self, bs: int, n: int) -> None:
        if self.frozen:
            raise KvCanaryValueError(
                f"kv-canary: batch of {bs} rows / {n} tokens exceeds the captured buffers "
                f"({self.max_rows} rows / {self.max_tokens} tokens); raise max_requests / max_batch_tokens"
            )
        rows = max(self.max_rows, 1 << (bs - 1).bit_length())
        tokens = max(self.max_tokens, 1 << (max(n, 1) - 1).bit_length())
        logger.warning(
            "kv-canary: batch of %d rows / %d tokens exceeds the static buffers (%d / %d); growing to %d / %d (counted)",
            bs, n, self.max_rows, self.max_tokens, rows, tokens,
        )
        self.growths += 1
        self._allocate(rows, tokens)

    def memory_bytes(self) -> int:
        return sum(8 * t.layout.size for t in self.sets.values()) + 8 * (self.max_rows + self.max_tokens)


def _first(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:n]``, without a new view when ``t`` holds at most ``n`` entries (a decode batch's usual case)."""
    return t[:n] if t.shape[0] > n else t


def _same_inputs(a: GroupInputs, b: GroupInputs) -> bool:
    return a.req_to_token is b.req_to_token and a.lut is b.lut and a.paged_key() == b.paged_key()
