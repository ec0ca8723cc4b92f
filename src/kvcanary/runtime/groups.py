"""`CanaryGroup`: one attention group's canary state — buffers, write-time slot records, KV sources.

Per group (full attention, or sliding window with its window size):

* HEAD buffer — written before the forward from the batch alone (no real-KV sources); verified
  before the forward against the engine's position -> slot table.
* TAIL buffers — one per hashed side (``k`` and ``v``; only ``k`` when hashing is off): verified
  after the forward with the real K/V re-hashed, then written with fingerprints of the KV the
  forward just stored. The sweep verifies these too (SWEEP_K / SWEEP_V).
* Slot records — what the runtime wrote into each slot and when (position, predecessor slot, step,
  owner), so the sweep can check slots no forward touches.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops import (
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_TOKEN,
    CANARY_FIELDS_PER_SLOT,
    MAX_REAL_KV_SOURCES,
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
)
from kvcanary.ops.hashing import CHAIN_HEAD_HASH, to_signed64
from kvcanary.runtime.batch import GroupSpec
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.deep_store import DEEP_HASH_MODE, prepare_deep_store

RECORD_BYTES = CANARY_FIELDS_PER_SLOT * 8
CHAIN_HEAD = to_signed64(CHAIN_HEAD_HASH)  # H0 as the int64 the buffers store
NEVER_WRITTEN = -1

KvLayers = Union[Mapping[int, tuple[torch.Tensor, torch.Tensor]], Callable[[int], tuple[torch.Tensor, torch.Tensor]]]


class SlotRecords:
    """What the runtime last wrote into each slot: int64 [num_slots + 1] each (the extra last
    element is a trash row: reads clamped past the slot space land there, and it always reads as
    never written — so a link to it, e.g. from a context anchor, is never checkable).

    position / prev_slot: the written position and the slot the write chained from (-1 = chain
    head); step: the forward that wrote it (-1 = never); owner: ``step * owner_span + batch row``
    of the write (-1 = unknown), resolved to a request through the step log.
    """

    def __init__(self, num_slots: int, device: torch.device) -> None:
        def arr() -> torch.Tensor:
            return torch.full((num_slots + 1,), NEVER_WRITTEN, dtype=torch.int64, device=device)

        self.num_slots = num_slots
        self.position = arr()
        self.prev_slot = arr()
        self.step = arr()
        self.owner = arr()
        # Scratch of the last-write-wins reduction: the torch twin's last entry per slot, or the fused kernels'
        # claim keys (runtime.kernels; ``epoch << 20 | token``, epoch int64 [2] advanced once per write).
        self.claims = arr()
        self.epoch = torch.zeros(2, dtype=torch.int64, device=device)

    def record(self, *, slots: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, prev_slots: torch.Tensor,
               owners: torch.Tensor, step: torch.Tensor) -> None:
        """Record one write launch's entries (int64 [n], in write order; ``valid`` bool [n] marks the
        entries the write stored). A slot written twice keeps its last entry, as the canary buffer
        does. The trash row stays ``NEVER_WRITTEN`` (skipped entries are dumped there, then it is reset), so
        a link to it is never checkable. Device ops only, no host reads (capturable); ``step`` is an int64 [1]
        device tensor."""
        trash = self.num_slots
        idx = torch.where(valid & (slots >= 0) & (slots < trash), slots, trash)
        order = torch.arange(idx.shape[0], dtype=torch.int64, device=idx.device)
        self.claims.index_fill_(0, idx, -1)
        self.claims.scatter_reduce_(0, idx, order, reduce="amax")
        idx = torch.where(self.claims.gather(0, idx) == order, idx, trash)  # index_put_ order is unspecified on CUDA
        self.position.index_put_((idx,), positions)
        self.prev_slot.index_put_((idx,), prev_slots)
        self.owner.index_put_((idx,), owners)
        self.step.index_put_((idx,), step.expand_as(idx))
        for field in (self.position, self.prev_slot, self.owner, self.step):
            field[trash:].fill_(NEVER_WRITTEN)

    def memory_bytes(self) -> int:
        return 5 * self.position.numel() * 8 + self.epoch.numel() * 8


class CanaryGroup:
    """The canary state of one attention group (see the module docstring)."""

    def __init__(self, spec: GroupSpec, *, config: CanaryConfig, device: torch.device, anchor_rows: int = 0) -> None:
        self.spec = spec
        self.anchor_rows = anchor_rows  # context anchors: buffer rows past the slot space, one per batch row
        self.name = spec.name
        self.kind = spec.kind  # "full" / "swa": selects the launch tags (the name keys the group's rings)
        self.num_slots = spec.num_slots
        self.window = spec.sliding_window
        self.hash_mode: RealKvHashMode = config.real_kv_hash_mode
        self._layer_picks = config.real_kv_layers
        self.device = device
        self.head_buf = self._new_buffer()
        self.tail_sides: tuple[str, ...] = ("k", "v") if self.hash_mode != RealKvHashMode.NONE else ("k",)
        self.tail_bufs = {side: self._new_buffer() for side in self.tail_sides}
        self.records = SlotRecords(spec.num_slots, device)
        self.sources: dict[str, tuple[RealKvSource, ...]] = {side: () for side in self.tail_sides}
        # Deep fingerprints: every byte of every layer, MAX_REAL_KV_SOURCES layers per buffer and side, written
        # at TAIL, verified by the sweep (key: (chunk, side)).
        self.deep = config.deep_fingerprints and self.hash_mode != RealKvHashMode.NONE
        self.deep_bufs: dict[tuple[int, str], torch.Tensor] = {}
        self.deep_sources: dict[tuple[int, str], tuple[RealKvSource, ...]] = {}
        self.hashed_layers: tuple[int, ...] = ()
        self.deep_layers: dict[int, tuple[int, ...]] = {}  # deep chunk -> the layers its records fingerprint
        self._contexts: dict[tuple, VerifyOrWriteContext] = {}

    def _new_buffer(self) -> torch.Tensor:
        buf = torch.zeros(self.num_slots + self.anchor_rows, RECORD_BYTES, dtype=torch.uint8, device=self.device)
        anchors = buf.view(torch.int64)[self.num_slots :]
        anchors[:, CANARY_FIELD_POSITION] = -1  # an anchor is "position -1" of its row's context
        anchors[:, CANARY_FIELD_PREV_HASH] = CHAIN_HEAD
        return buf

    def buffers(self) -> list[torch.Tensor]:
        """Every canary buffer of the group (HEAD, TAIL sides, deep)."""
        return [self.head_buf, *self.tail_bufs.values(), *self.deep_bufs.values()]

    def set_anchor_keys(self, keys: torch.Tensor) -> None:
        """Store ``keys`` (int64 [anchor_rows], 0 = none) as the token of every buffer's anchor rows: a row's
        first token then chains from ``mix3(H0, key, -1)`` instead of H0. Device copies (capturable)."""
        for buf in self.buffers():
            buf.view(torch.int64)[self.num_slots :, CANARY_FIELD_TOKEN].copy_(keys[: self.anchor_rows])

    # ---- tags ------------------------------------------------------------------------------
    def tag(self, phase: str, side: str = "k") -> CanaryLaunchTag:
        """The launch tag of ``phase`` / ``side`` for this group's kind (groups of one kind share it)."""
        return CanaryLaunchTag.of(phase=phase, side=side, group=self.kind)

    def tags(self) -> list[CanaryLaunchTag]:
        """Every tag this group launches under (HEAD_K, TAIL_*, SWEEP_*)."""
        return [self.tag("head")] + [self.tag(p, s) for p in ("tail", "sweep") for s in self.tail_sides]

    def ring_keys(self) -> list[tuple[str, CanaryLaunchTag]]:
        """The (group name, tag) keys of this group's rings (`tags`; MOVE rings: `runtime.moves.move_tags`)."""
        return [(self.name, tag) for tag in self.tags()]

    def buffer(self, phase: str, side: str = "k") -> torch.Tensor:
        return self.head_buf if phase == "head" else self.tail_bufs[side]

    # ---- real KV ---------------------------------------------------------------------------
    @property
    def hashing(self) -> bool:
        return self.hash_mode != RealKvHashMode.NONE and any(self.sources.values())

    def set_kv_cache(self, layers: KvLayers, *, page_size: int = 1, deep_layers: Optional[KvLayers] = None,
                     deep_page_size: Optional[int] = None) -> None:
        """Pick the configured layers from ``layers`` and build one RealKvSource per layer and side.

        Deep fingerprints read every byte of every layer from ``deep_layers`` (paged by
        ``deep_page_size``) when given, else from ``layers``: an adapter whose ``layers`` are partial
        copies (e.g. the first bytes of each slot) hands the full KV storage there."""
        layer_ids = self.spec.layer_ids or (tuple(sorted(layers)) if isinstance(layers, Mapping) else ())
        if not layer_ids:
            raise KvCanaryValueError(
                f"kv-canary: group {self.name!r} has no layer_ids; give GroupSpec.layer_ids or a mapping of layers"
            )
        picked: list[int] = []
        for pick in self._layer_picks:
            if not -len(layer_ids) <= pick < len(layer_ids):
                raise KvCanaryValueError(
                    f"kv-canary: real_kv_layers index {pick} is out of range for group {self.name!r} "
                    f"with {len(layer_ids)} layer(s) {layer_ids}"
                )
            if layer_ids[pick] not in picked:
                picked.append(layer_ids[pick])
        sources: dict[str, list[RealKvSource]] = {"k": [], "v": []}
        for layer in picked:
            try:
                pair = layers(layer) if callable(layers) else layers[layer]
            except KeyError:
                raise KvCanaryValueError(f"kv-canary: set_kv_cache for group {self.name!r} has no tensors for layer {layer}") from None
            for side, tensor in zip("kv", pair):
                sources[side].append(self._source(tensor, page_size, layer, side))
        if self.hash_mode == RealKvHashMode.NONE:
            sources = {"k": []}
        self.sources = {side: tuple(sources[side]) for side in self.tail_sides}
        self.hashed_layers = tuple(picked)
        if self.deep:
            if deep_layers is None:
                self._set_deep_sources(layers, layer_ids, page_size)
            else:
                self._set_deep_sources(deep_layers, layer_ids, page_size if deep_page_size is None else deep_page_size)
            prepare_deep_store(self.deep_targets())  # device tables now, not under a CUDA graph capture
        self._contexts.clear()

    def _set_deep_sources(self, layers: KvLayers, layer_ids: tuple[int, ...], page_size: int) -> None:
        """One source per layer (every byte of its strip, hashed in LANES mode), grouped MAX_REAL_KV_SOURCES layers to
        a buffer per side."""
        deep_sources: dict[tuple[int, str], tuple[RealKvSource, ...]] = {}
        for chunk, start in enumerate(range(0, len(layer_ids), MAX_REAL_KV_SOURCES)):
            pairs = {}
            for layer in layer_ids[start : start + MAX_REAL_KV_SOURCES]:
                try:
                    pairs[layer] = layers(layer) if callable(layers) else layers[layer]
                except KeyError:
                    raise KvCanaryValueError(
                        f"kv-canary: set_kv_cache for group {self.name!r} has no tensors for layer {layer} "
                        "(deep_fingerprints hash every layer of the group)"
                    ) from None
            self.deep_layers[chunk] = tuple(pairs)
            for i, side in enumerate("kv"):
                deep_sources[(chunk, side)] = tuple(self._source(p[i], page_size, l, side) for l, p in pairs.items())
                if (chunk, side) not in self.deep_bufs:
                    self.deep_bufs[(chunk, side)] = self._new_buffer()
        self.deep_sources = deep_sources

    def deep_targets(self) -> list[tuple[torch.Tensor, torch.Tensor, tuple[RealKvSource, ...]]]:
        """(TAIL buffer, deep buffer, its sources) per chunk and side, chunks in order, K before V
        (`store_deep_fingerprints`)."""
        return [(self.tail_bufs[key[1]], self.deep_bufs[key], self.deep_sources[key]) for key in sorted(self.deep_sources)]

    def deep_chunks(self) -> list[int]:
        """Chunk indices of the deep buffers that have sources (empty when deep fingerprints are off)."""
        return sorted({c for c, _ in self.deep_sources})

    def _source(self, tensor: torch.Tensor, page_size: int, layer: int, side: str) -> RealKvSource:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            raise KvCanaryValueError(
                f"kv-canary: group {self.name!r} layer {layer} {side.upper()} must be a tensor of >= 2 dims "
                f"(slot or page rows), got {getattr(tensor, 'shape', type(tensor).__name__)}"
            )
        if tensor.device != self.device:
            raise KvCanaryValueError(
                f"kv-canary: group {self.name!r} layer {layer} {side.upper()} is on {tensor.device}, canary on {self.device}"
            )
        row_bytes = tensor[0].numel() * tensor.element_size()
        if row_bytes % page_size:
            raise KvCanaryValueError(
                f"kv-canary: group {self.name!r} layer {layer} {side.upper()} row of {row_bytes} bytes "
                f"does not split into page_size={page_size} slots"
            )
        per_token = row_bytes // page_size
        return RealKvSource(tensor=tensor, page_size=page_size, num_bytes_per_token=per_token, read_bytes=per_token)

    # ---- launch contexts -------------------------------------------------------------------
    def context(self, phase: str, side: str, op: str, *, rings, counters, chain_assert: torch.Tensor,
                deep: Optional[int] = None) -> VerifyOrWriteContext:
        """The (cached) context for ``op`` (verify/write) on the ``phase``/``side`` buffer, or on deep
        buffer ``deep`` of that side (its layers' sources in LANES mode, `DEEP_HASH_MODE`; TAIL writes, SWEEP
        verifies)."""
        key = (phase, side, op, id(chain_assert), deep)
        ctx = self._contexts.get(key)
        if ctx is None:
            tag = self.tag(phase, side)
            ring, write_index = rings.ring_for(self.name, tag)
            slot_counter, kernel_counter = counters.views(op, tag)
            if deep is None:
                buf, sources, mode = self.buffer(phase, side), () if phase == "head" else self.sources[side], self.hash_mode
            else:
                buf, sources, mode = self.deep_bufs[(deep, side)], self.deep_sources[(deep, side)], DEEP_HASH_MODE
            ctx = VerifyOrWriteContext(
                canary_buf=buf,
                kernel_kind=tag,
                violation_ring=ring,
                violation_write_index=write_index,
                slot_run_counter=slot_counter,
                kernel_run_counter=kernel_counter,
                real_kv_sources=sources,
                real_kv_hash_mode=mode,
                enable_chain_position_assert=chain_assert,
            )
            self._contexts[key] = ctx
        return ctx

    def kv_bytes_per_slot(self) -> int:
        """K/V bytes a sweep reads per slot: every deep source's strip (deep fingerprints on), else the TAIL
        sources' hashed bytes (16 per source in PARTIAL mode); at least 1."""
        if self.deep and self.deep_sources:
            return max(1, sum(src.read_bytes for srcs in self.deep_sources.values() for src in srcs))
        per = (lambda src: 16) if self.hash_mode == RealKvHashMode.PARTIAL else (lambda src: src.read_bytes)
        return max(1, sum(per(src) for srcs in getattr(self, "sources", {}).values() for src in srcs))

    def bytes_per_slot(self) -> int:
        """Canary bytes per slot: one 32-byte record per buffer plus the slot records."""
        return len(self.buffers()) * RECORD_BYTES + 5 * 8

    def memory_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers()) + self.records.memory_bytes()

    def describe_sources(self) -> Optional[str]:
        if not self.hashing:
            return None
        return f"layers {self.hashed_layers} x {'/'.join(s.upper() for s in self.tail_sides)}"
