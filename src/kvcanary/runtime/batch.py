"""The engine-neutral description of one forward (adapter -> runtime boundary).

An engine adapter translates its own structures into these frozen dataclasses; the runtime
never sees an engine type. All index tensors may be int32 or int64 and live on the device
the canary runs on.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np
import torch
from kvcanary.errors import KvCanaryValueError

FORWARD_KINDS = ("prefill", "decode", "verify", "mixed", "idle")


def classify_forward(prefix_lens: Sequence[int], extend_lens: Sequence[int],
                 verify_rows: Optional[Sequence[bool]] = None) -> str:
    """The one rule every adapter names a forward by (host ints, one per batch row):

    ``idle`` no rows; ``verify`` every row is a speculative verify (its last committed token and its drafts, flagged in
    ``verify_rows``) or a plain decode, and at least one is a verify; ``decode`` every row computes one token after a
    cached context; ``prefill`` every row computes prompt tokens — from position 0 or continuing a chunked prefill
    (``extend > 1``; the one-token tail chunk of a prompt cannot be told from a decode); ``mixed`` anything else.
    """
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    extend = np.asarray(extend_lens, dtype=np.int64)
    if prefix.size == 0:
        return "idle"
    verify = np.asarray(verify_rows, dtype=bool) if verify_rows is not None else np.zeros(prefix.shape, dtype=bool)
    decode = (prefix > 0) & (extend == 1)
    if verify.any() and (verify | decode).all():
        return "verify"
    if decode.all():
        return "decode"
    if not verify.any() and ((prefix == 0) | (extend > 1)).all():
        return "prefill"
    return "mixed"


GROUP_KINDS = ("full", "swa")
_GROUP_NAME = re.compile(r"^(full|swa)(?:\.([1-9][0-9]*))?$")


def group_kind(name: str) -> str:
    """The kind (``"full"`` or ``"swa"``) of a canary group name: ``"full"`` / ``"swa"``, or ``"full.<n>"`` /
    ``"swa.<n>"`` (``n`` a positive integer without leading zeros) for a further group of that kind; refuses
    anything else with a `KvCanaryValueError`."""
    m = _GROUP_NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise KvCanaryValueError(
            f"kv-canary: a group name must be 'full' or 'swa', or 'full.<n>' / 'swa.<n>' (n >= 1) for a further "
            f"group of that kind, got {name!r}"
        )
    return m.group(1)


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One attention group's slot space.

    name: ``"full"`` or ``"swa"``, or ``"full.<n>"`` / ``"swa.<n>"`` for a further group of that kind (an engine
    whose KV cache has several groups of one kind, e.g. vLLM's hybrid allocator). The name identifies the group
    everywhere (buffers, `Canary.set_kv_cache`, live slots, `Canary.release_slots`, `Violation.group`, reports);
    its `kind` selects the launch tags (the op contract knows one full and one swa group: groups of one kind share
    their tags, each keeps rings of its own) and the sliding-window rules. num_slots: size of the group's
    slot space, slot 0 being the padding slot. sliding_window: tokens a sliding-window group
    keeps (0 for full attention). layer_ids: the model layers in the group (for real-KV sources).
    ring_window: the sliding-window KV is a ring — a forward stores position ``p + W`` into the slot of ``p``
    while it computes (so positions ``[P - W, P + E - W)`` of a row lose their KV *during* the forward
    that writes ``[P, P + E)``). The HEAD verify checks them before the forward; the TAIL verify skips them.
    """

    name: str
    num_slots: int
    sliding_window: int = 0
    layer_ids: tuple[int, ...] = ()
    ring_window: bool = False

    @property
    def kind(self) -> str:
        """``"full"`` or ``"swa"`` (`group_kind` of the name)."""
        return group_kind(self.name)

    def __post_init__(self) -> None:
        kind = group_kind(self.name)
        if self.num_slots < 2:
            raise KvCanaryValueError(f"kv-canary: GroupSpec.num_slots must be >= 2 (slot 0 is padding), got {self.num_slots}")
        if self.sliding_window < 0 or (kind == "swa") != (self.sliding_window > 0):
            raise KvCanaryValueError(
                f"kv-canary: GroupSpec {self.name!r} needs sliding_window > 0 exactly when its kind is 'swa', "
                f"got {self.sliding_window}"
            )
        if self.ring_window and not self.sliding_window:
            raise KvCanaryValueError(f"kv-canary: GroupSpec {self.name!r}: ring_window needs a sliding window")


@dataclass(frozen=True, kw_only=True)
class ReadCheck:
    """What one group's attention reads this forward, checked by the adapter against what each row owns
    (`kvcanary.runtime.reads`). All device tensors ``[bs]``, one entry per batch row:

    mismatch (bool): the row's reads disagree — it reads an entry it does not own (a surplus page, a new token
    from another slot than the one written), or fewer entries than it owns. slot: the first disagreeing slot
    attention reads (0: none). position: the position that read stands for (or the first owned position not
    read). expected_slot: the slot the row owns at ``position`` (-1: none). reads / owned: entries attention
    reads for the row / entries it owns (cached positions it may read + its new tokens).
    A disagreeing row becomes one ``read_table_mismatch`` violation of the group, attributed to that row.
    """

    mismatch: torch.Tensor
    slot: torch.Tensor
    position: torch.Tensor
    expected_slot: torch.Tensor
    reads: torch.Tensor
    owned: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class BlockTable:
    """A paged engine's block table for one group, from which HEAD derives the staged rows' position -> slot table
    on the device (`launch_block_table_slots_kernel` with ``width=None``: ``req_to_token[rows[r], p] = table[r, p //
    block_size] * block_size + p % block_size`` for ``p < prefix[r] + extend[r]``; columns past a row's length, and
    the padding row 0, are left as they are). table: int32/int64 [R, nblk], row ``r`` = batch row ``r`` (rows past R
    read nothing), unit column stride, on the canary's device; held by reference like ``req_to_token`` (while the
    canary's graphs are held a table at another address, stride or width releases them). drop_null: block 0 is the
    engine's null block (a sliding window drops blocks behind it): its positions get the padding slot."""

    table: torch.Tensor
    block_size: int
    drop_null: bool = False

    def __post_init__(self) -> None:
        t = self.table
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.int32, torch.int64) or (
                t.shape[1] and t.stride(1) != 1):
            raise KvCanaryValueError("kv-canary: BlockTable.table must be a 2-D int32/int64 tensor with unit column "
                                     f"stride, got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise KvCanaryValueError(f"kv-canary: BlockTable.block_size must be a positive int, got {self.block_size!r}")

    def key(self) -> tuple:
        """What a captured launch reads of it: address, row stride, width, dtype, block size, null rule."""
        t = self.table
        return (t.data_ptr(), t.stride(0), t.shape[1], t.dtype, self.block_size, self.drop_null)


@dataclass(frozen=True, kw_only=True)
class RewriteCounter:
    """Slots written again: HEAD marks each slot the forward stores into (``out_cache_loc``, negatives skipped) in
    ``ever_written`` (uint8 [num_slots]) and adds to ``rewritten`` (int64 [1]) how many were marked before
    (`launch_mark_written_slots_kernel`). Held by reference; groups may share one counter (one pool of memory)."""

    ever_written: torch.Tensor
    rewritten: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class GroupBatch:
    """One group's view of a forward.

    req_to_token: int32 [max_reqs, max_len], slot of (request row, position) — in the group's
    own slot space, or in the full space when ``full_to_group_lut`` is given (int64 [num_full_slots],
    full slot -> group slot). out_cache_loc: [num_tokens] slots written by this forward, in the
    group's own space (negative = not stored). read_check: optional `ReadCheck` — what attention reads,
    checked against what each row owns; disagreements are reported (``read_table_mismatch``) when staged.
    block_table: optional `BlockTable` — HEAD writes the rows' ``req_to_token`` entries from it on the device
    (``req_to_token`` must then be int32, the table HEAD writes into). rewrites: optional `RewriteCounter` HEAD
    marks the forward's written slots in.
    """

    req_to_token: torch.Tensor
    out_cache_loc: torch.Tensor
    full_to_group_lut: Optional[torch.Tensor] = None
    read_check: Optional[ReadCheck] = None
    block_table: Optional[BlockTable] = None
    rewrites: Optional[RewriteCounter] = None


@dataclass(frozen=True, kw_only=True)
class BatchDescription:
    """One forward, engine-neutral.

    req_pool_indices, prefix_lens, extend_lens: [bs] request rows (row 0 = padding), tokens already
    cached, tokens computed this forward. input_ids, positions: [num_tokens], flattened request by
    request in batch order (extend_lens[r] tokens each). groups: per group name, its GroupBatch.
    request_ids: one id per batch row (None for padding rows) for attribution. token_table /
    token_table_lens: optional token history per request row (int32 [max_reqs, max_ctx], token at
    position p in column p) and its valid length per batch row; enables the verify-token check.
    forward_kind: one of ``prefill | decode | verify | mixed | idle`` (`classify_forward` names it from the rows).
    expected_input_ids: optional token oracle, [num_tokens] — the tokens the engine *should* be
    writing (for the write-input assert); without it the assert reads them from token_table.
    context_keys: optional int64 [bs], who produced each row's KV (LoRA adapter, tenant, cache salt; 0 =
    no context): a keyed row's position 0 chains from ``mix3(H0, key, -1)`` instead of H0, so a prefix-cache
    hit across contexts on identical tokens is a ``verify_chain_hash`` violation at position 0 (full
    attention; a window that no longer holds position 0 does not see the key). Give them on every forward
    once given (a row without a key is context 0); the sweep does not judge position 0's link, so it never
    reports a keyed slot for its key.

    committed_lens: optional int64 [bs] (host), tokens each row has committed — what the user receives. Positions at
    or past it that this forward writes are speculative drafts (a ``verify`` forward): the token oracle has no say
    on them, and the engine rolls back the rejected ones (`Canary.release_slots`). None: every written position is
    committed (or will be, as the forward's own sample).

    shared_lens: optional int64 [bs], how many of a row's first extend tokens another row of the same forward computes
    (a prefix-cache hit on blocks scheduled in this step: the row claims those positions and only reads them). The
    row's own first query then sits at ``prefix_lens + shared_lens``, so a sliding window's read range starts that much
    later for the padding-read check (docs/design.md §3.12); None: 0 for every row.

    Host syncs: the runtime reads prefix_lens, extend_lens and req_pool_indices on the host once
    per forward (to size and attribute); pass CPU copies of those three if the engine has them.
    """

    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    groups: Mapping[str, GroupBatch]
    request_ids: Optional[tuple[Optional[str], ...]] = None
    token_table: Optional[torch.Tensor] = None
    token_table_lens: Optional[torch.Tensor] = None
    forward_kind: str = "mixed"
    expected_input_ids: Optional[torch.Tensor] = None
    context_keys: Optional[torch.Tensor] = None
    committed_lens: Optional[torch.Tensor] = None
    shared_lens: Optional[torch.Tensor] = None
    extra: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.forward_kind not in FORWARD_KINDS:
            raise KvCanaryValueError(
                f"kv-canary: BatchDescription.forward_kind must be one of {', '.join(FORWARD_KINDS)}, "
                f"got {self.forward_kind!r}"
            )
        bs = int(self.req_pool_indices.shape[0])
        for name in ("prefix_lens", "extend_lens"):
            if int(getattr(self, name).shape[0]) != bs:
                raise KvCanaryValueError(
                    f"kv-canary: BatchDescription.{name} has {getattr(self, name).shape[0]} rows, "
                    f"req_pool_indices has {bs}"
                )
        if self.input_ids.shape != self.positions.shape:
            raise KvCanaryValueError(
                f"kv-canary: BatchDescription input_ids {tuple(self.input_ids.shape)} and positions "
                f"{tuple(self.positions.shape)} differ in shape"
            )
        if self.request_ids is not None and len(self.request_ids) != bs:
            raise KvCanaryValueError(f"kv-canary: BatchDescription.request_ids has {len(self.request_ids)} ids for {bs} rows")
        if self.expected_input_ids is not None and self.expected_input_ids.shape != self.input_ids.shape:
            raise KvCanaryValueError(
                f"kv-canary: BatchDescription expected_input_ids {tuple(self.expected_input_ids.shape)} and "
                f"input_ids {tuple(self.input_ids.shape)} differ in shape"
            )
        if self.context_keys is not None and int(self.context_keys.shape[0]) != bs:
            raise KvCanaryValueError(f"kv-canary: BatchDescription.context_keys has {self.context_keys.shape[0]} rows for {bs}")
        if self.committed_lens is not None and int(self.committed_lens.shape[0]) != bs:
            raise KvCanaryValueError(f"kv-canary: BatchDescription.committed_lens has {self.committed_lens.shape[0]} rows "
                                     f"for {bs}")
        if self.shared_lens is not None and int(self.shared_lens.shape[0]) != bs:
            raise KvCanaryValueError(f"kv-canary: BatchDescription.shared_lens has {self.shared_lens.shape[0]} rows for {bs}")
        if (self.token_table is None) != (self.token_table_lens is None):
            raise KvCanaryValueError("kv-canary: BatchDescription token_table and token_table_lens go together")

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
