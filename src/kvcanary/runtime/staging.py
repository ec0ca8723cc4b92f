"""`StaticBatch`: the canary's fixed device buffers for one forward's inputs.

Every per-forward launch reads these buffers and nothing else that changes shape, so the launches
can be captured once in a CUDA graph and replayed for any batch that fits:

* ``rows`` / ``prefix`` / ``extend`` / ``token_lens``: int64 ``[max_rows]`` — the batch rows, padded with
  request row 0 (the padding row: inactive whatever its lengths say) and zero lengths;
* ``input_ids`` / ``positions`` / ``expected_ids``: int64 ``[max_tokens]``;
* ``out_loc[group]``: int64 ``[max_tokens]`` — slots written, padded with -1 (not stored);
* per group, the engine's position -> slot table, LUT and token history are held *by reference*
  (the engine owns them; keep the same tensor objects while a graph is captured).

`stage` is device copies only (no host reads): O(1) Python per forward whatever the batch size.
Buffers grow between steps when a batch exceeds them (logged, counted in ``growths``); a graph
captured before a growth is stale, so growing while graphs are held is an error.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.runtime.batch import BatchDescription

logger = logging.getLogger("kvcanary")

NOT_STORED = -1  # out_loc padding: the write op skips negative slots


@dataclass(frozen=True, kw_only=True)
class GroupInputs:
    """One group's by-reference inputs: req_to_token int32 [max_reqs, max_len]; lut int64 or None."""

    req_to_token: torch.Tensor
    lut: Optional[torch.Tensor]


class StaticBatch:
    """Static per-forward input buffers (see the module docstring)."""

    def __init__(self, *, groups: tuple[str, ...], max_rows: int, max_tokens: int, device: torch.device) -> None:
        self.groups = groups
        self.device = device
        self.growths = 0
        self.frozen = False  # True while a captured graph reads these buffers
        self.inputs: dict[str, GroupInputs] = {}
        self.token_table: Optional[torch.Tensor] = None
        self.has_oracle = False
        self.has_context = False  # a batch carried context keys (from then on they are staged every step)
        self._allocate(max_rows, max_tokens)

    def _allocate(self, max_rows: int, max_tokens: int) -> None:
        dev = self.device

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=dev)

        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.rows, self.prefix, self.extend, self.token_lens, self.context_keys = (zeros(max_rows) for _ in range(5))
        self.input_ids, self.positions, self.expected_ids = (zeros(max_tokens) for _ in range(3))
        self.out_loc = {g: torch.full((max_tokens,), NOT_STORED, dtype=torch.int64, device=dev) for g in self.groups}
        self.token_arange = torch.arange(max_tokens, dtype=torch.int64, device=dev)
        self.row_arange = torch.arange(max_rows, dtype=torch.int64, device=dev)
        self._entry_aranges: dict[int, torch.Tensor] = {}
        self._bs = max_rows  # rows / tokens filled by the last stage (everything, initially)
        self._n = max_tokens

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
        """Copy ``batch`` into the buffers and pad the rest. Device copies only, issued as one
        multi-tensor copy (plus pads when the batch shrank): a handful of host calls per forward."""
        bs, n = batch.batch_size, batch.num_tokens
        if bs > self.max_rows or n > self.max_tokens:
            self._grow(bs, n)
        cap = capturing()
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        zero: list[torch.Tensor] = []
        not_stored: list[torch.Tensor] = []
        stale_rows = self.max_rows if cap else self._bs  # a graph may replay after any other batch
        stale_tokens = self.max_tokens if cap else self._n

        def rows(buf: torch.Tensor, values: torch.Tensor) -> None:
            dst.append(buf[:bs])
            src.append(values)
            if stale_rows > bs:
                zero.append(buf[bs:stale_rows])

        def tokens(buf: torch.Tensor, values: torch.Tensor, m: int, pads: list) -> None:
            dst.append(buf[:m])
            src.append(values[:m])
            stale = max(stale_tokens, n)  # out_loc may hold fewer entries than tokens: pad up to n too
            if stale > m:
                pads.append(buf[m:stale])

        rows(self.rows, batch.req_pool_indices)
        rows(self.prefix, batch.prefix_lens)
        rows(self.extend, batch.extend_lens)
        tokens(self.input_ids, batch.input_ids, n, zero)
        tokens(self.positions, batch.positions, n, zero)
        if not self.frozen:
            self.has_oracle = batch.expected_input_ids is not None
        if batch.expected_input_ids is not None:
            tokens(self.expected_ids, batch.expected_input_ids, n, zero)
        for name in self.groups:
            gb = batch.groups[name]
            tokens(self.out_loc[name], gb.out_cache_loc, min(n, int(gb.out_cache_loc.shape[0])), not_stored)
            table = gb.req_to_token
            if table.dtype != torch.int32:
                table = table.to(torch.int32)  # a copy per forward: give int32 tables to avoid it
            inputs = GroupInputs(req_to_token=table, lut=gb.full_to_group_lut)
            if self.frozen and name in self.inputs and not _same_inputs(self.inputs[name], inputs):
                raise KvCanaryValueError(
                    f"kv-canary: group {name!r} req_to_token / full_to_group_lut are not the tensors the canary's graphs "
                    "were captured with; keep the same (int32) tensor objects while graphs are held"
                )
            self.inputs[name] = inputs
        if self.frozen and (batch.token_table is not self.token_table or
                            (batch.expected_input_ids is not None) != self.has_oracle):
            raise KvCanaryValueError(
                "kv-canary: token_table / expected_input_ids changed since the canary's graphs were captured; "
                "keep the same token_table object and oracle setting while graphs are held"
            )
        self.token_table = batch.token_table
        if batch.context_keys is not None:
            if self.frozen and not self.has_context:
                raise KvCanaryValueError("kv-canary: context_keys appeared after the canary's graphs were captured; "
                                 "stage a batch with context_keys before capturing")
            self.has_context = True
            rows(self.context_keys, batch.context_keys)
        elif self.has_context:
            zero.append(self.context_keys)
        if batch.token_table_lens is not None:
            rows(self.token_lens, batch.token_table_lens)
        torch._foreach_copy_(dst, src, non_blocking=True)
        if zero:
            torch._foreach_zero_(zero)
        for buf in not_stored:
            buf.fill_(NOT_STORED)
        self._bs, self._n = bs, n

    def clear(self) -> None:
        """Pad everything (an empty batch: no active row, no stored token). Keeps the by-reference inputs."""
        for buf in (self.rows, self.prefix, self.extend, self.token_lens, self.context_keys):
            buf.zero_()
        for buf in self.out_loc.values():
            buf.fill_(NOT_STORED)
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
        return 8 * (5 * self.max_rows + (4 + len(self.groups)) * self.max_tokens)


def _same_inputs(a: GroupInputs, b: GroupInputs) -> bool:
    return a.req_to_token is b.req_to_token and a.lut is b.lut


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
