"""Slot layout of one transformers ``PagedAttentionCache``: physical row index <-> canary slot.

transformers keeps every group's K/V in one flat byte tensor. A group (one cache allocator) cuts it
into *blocks* of ``L`` pages (``L`` = layers in the group); a page holds ``page_size`` tokens of K
then ``page_size`` tokens of V for one layer. The engine addresses a token by a *physical row*
``p = block * block_physical_stride + offset`` (``offset < page_size``, stride ``= 2 * page_size * L``)
into per-layer shifted views. Only the first ``page_size`` rows of every stride are addressable, so
the canary uses a compact slot space instead::

    slot = block * page_size + offset            (num_slots = total_blocks * page_size)

Blocks of the two leading *trash sectors* are never allocated: physical row 0 (the read trash,
padding tokens read it) is canary slot 0, the padding slot; the sentinel row 1 and the write-trash
rows map to "not a slot" (-1 for writes, 0 for reads). ``RealKvSource`` addressing (row = slot //
page_size, column = (slot % page_size) * bytes_per_token) is the same compact layout, so a layer's K
(or V) is a row-strided view ``[total_blocks, page_size * H * D]`` of the cache tensor — no copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary.engines.transformers_cb import compat
from kvcanary.errors import KvCanaryValueError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# transformers layer type -> runtime group name (GroupSpec.name)
GROUP_NAMES = {FULL_ATTENTION: "full", SLIDING_ATTENTION: "swa"}

PADDING_SLOT = 0  # canary slot 0 == the engine's read-trash row
NOT_STORED = -1  # write entries the canary skips


@dataclass(frozen=True, kw_only=True)
class GroupLayout:
    """One cache allocator seen as a canary group.

    index: the allocator's row in ``write_index`` / ``read_index`` / ``block_table``. layer_type: the key
    in ``cu_seq_lens_k``. first_data_block: blocks below it belong to the trash sectors.
    """

    name: str
    layer_type: str
    index: int
    layer_ids: tuple[int, ...]
    page_size: int
    block_stride: int
    first_data_block: int
    total_blocks: int
    sliding_window: int
    pages_stride: int  # block_table entries are block_id * pages_stride

    @property
    def num_slots(self) -> int:
        return self.total_blocks * self.page_size

    def physical_to_slot(self, phys: torch.Tensor, *, for_write: bool) -> torch.Tensor:
        """Map physical rows (any int dtype) to canary slots (int64); trash rows -> -1 (write) or 0 (read)."""
        phys = phys.to(torch.int64)
        block = torch.div(phys, self.block_stride, rounding_mode="floor")
        offset = phys - block * self.block_stride
        valid = (block >= self.first_data_block) & (offset < self.page_size) & (block < self.total_blocks)
        slot = block * self.page_size + offset
        fill = NOT_STORED if for_write else PADDING_SLOT
        return torch.where(valid, slot, torch.full_like(slot, fill))

    def block_entries_to_slots(self, entries: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Decode fast path: block-table entries (``block_id * pages_stride``, -1 = none) and in-page offsets
        (broadcastable) -> slots (int64); entries outside the data blocks -> 0 (the padding slot)."""
        block = torch.div(entries.to(torch.int64), self.pages_stride, rounding_mode="floor")
        valid = (entries >= 0) & (block >= self.first_data_block) & (block < self.total_blocks)
        return torch.where(valid, block * self.page_size + offsets, torch.zeros_like(block))


def build_layouts(cache) -> list[GroupLayout]:
    """The canary groups of a ``PagedAttentionCache`` (read only), ordered by allocator index."""
    layouts = []
    total_bytes = int(cache.cache_tensor.numel())  # uint8 storage
    for layer_type, alloc in compat.allocators(cache).items():
        if layer_type not in GROUP_NAMES:
            raise KvCanaryValueError(f"kv-canary: unsupported transformers attention type {layer_type!r}")
        geo = compat.allocator_geometry(alloc)
        if total_bytes % geo["bytes_per_block"]:
            raise KvCanaryValueError(
                f"kv-canary: cache of {total_bytes} bytes is not a whole number of {layer_type} blocks "
                f"({geo['bytes_per_block']} bytes); unexpected transformers cache layout"
            )
        page, stride = geo["tokens_per_page"], geo["block_physical_stride"]
        layouts.append(
            GroupLayout(
                name=GROUP_NAMES[layer_type],
                layer_type=layer_type,
                index=geo["index"],
                layer_ids=geo["layer_indices"],
                page_size=page,
                block_stride=stride,
                first_data_block=2 * geo["blocks_per_sector"],
                total_blocks=total_bytes // geo["bytes_per_block"],
                sliding_window=geo["sliding_window"] if layer_type == SLIDING_ATTENTION else 0,
                pages_stride=stride // page,
            )
        )
    layouts.sort(key=lambda g: g.index)
    names = [g.name for g in layouts]
    if len(set(names)) != len(names):
        raise KvCanaryValueError(f"kv-canary: two cache allocators map to one canary group: {names}")
    return layouts


def layer_kv_views(cache, layout: GroupLayout, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row-strided K and V views ``[total_blocks, page_size * H * D]`` of one layer, and bytes per token.

    Row ``b`` of the K view is page ``2 * i`` of block ``b`` (``i`` = the layer's rank in its group), so
    ``RealKvSource(view, page_size, bytes_per_token, ...)`` addresses compact slot ``b * page_size + o``.
    """
    kv, rank = compat.layer_cache_tensor(cache, layer_id)  # [total_tokens, 2, H, D] in the cache dtype
    per_token = int(kv.shape[-2]) * int(kv.shape[-1])
    per_page = layout.page_size * per_token
    blocks = kv.reshape(-1).view(layout.total_blocks, -1)
    k_view = blocks[:, (2 * rank) * per_page : (2 * rank + 1) * per_page]
    v_view = blocks[:, (2 * rank + 1) * per_page : (2 * rank + 2) * per_page]
    return k_view, v_view, per_token * kv.element_size()
