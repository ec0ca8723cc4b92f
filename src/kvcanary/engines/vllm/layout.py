"""vLLM KV cache groups as canary groups, and per-layer token-major views of the CPU KV cache.

Slot space: a canary slot is vLLM's own slot number, ``kernel_block * block_size + offset`` — the
value the engine puts in ``slot_mapping`` — so written slots need no translation. Block 0 is vLLM's
null block (never allocated to a request): its first slot is the canary's padding slot.

KV bytes: the CPU attention backend stores one layer as ``[num_blocks, num_kv_heads, block_size,
2 * head_size]``; per (block, head) the first ``block_size * head_size`` elements hold K, the rest V,
and *inside* those regions the element order depends on the ISA kernel that wrote them (``layer.isa``):

* ``vec`` / ``vec16``: K transposed (``[head_size, block_size]``), V plain (``[block_size, head_size]``);
* ``amx``: K in 16-token tiles of dimension pairs (``[block/16, head/2, 16, 2]``), V in token pairs
  per 16 dimensions (``[head/16, block/2, 16, 2]``).

`RealKvSource` reads slot ``s`` at row ``s // block_size``, byte column ``(s % block_size) *
bytes_per_token`` of a tensor read in logical order, so each layer gets a *view* (no copy) whose
logical order is token-major: ``[num_blocks, block_size, ...]`` holding exactly that token's K (or V)
elements. Which view is right is not guessed: `probe_cpu_layout` writes marker values through the
engine's own ``cpu_attn_reshape_and_cache`` into a one-block scratch cache and checks every
candidate view against where each (token, head, dim) landed. No candidate fits -> no view (the
adapter then runs without real-KV fingerprints and says so).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvcanary.errors import KvCanaryValueError

logger = logging.getLogger("kvcanary")

FULL = "full"
SWA = "swa"


@dataclass(frozen=True, kw_only=True)
class GroupLayout:
    """One vLLM KV cache group seen as a canary group.

    name: the canary group's name — ``full`` / ``swa`` for the first group of its kind, ``full.1``, ``full.2``, ...
    for further ones (vLLM's hybrid allocator splits one kind's layers into several groups of equal size when the
    kinds' layer counts differ; `kvcanary.runtime.group_kind`). index: the group's position in
    ``kv_cache_config.kv_cache_groups`` (and in the model runner's block tables). block_size: tokens per *kernel*
    block (the unit of ``block_table`` and ``slot_mapping``). manager_block_size: tokens per scheduler block (a
    multiple of it). num_blocks: kernel blocks per layer tensor. layer_ids: canary layer ids (the model's layer
    numbers), aligned with ``layer_names``. sliding_window: the model's window W (0: full attention).
    window_left: cached positions before its own a query reads in this group's attention (`window_left`;
    0 when unknown or full attention): a query at position p reads ``[p - window_left, p]``.
    """

    name: str
    index: int
    layer_names: tuple[str, ...]
    layer_ids: tuple[int, ...]
    block_size: int
    manager_block_size: int
    num_blocks: int
    sliding_window: int
    window_left: int = 0

    @property
    def kind(self) -> str:
        """``full`` or ``swa``."""
        return SWA if self.sliding_window else FULL

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.manager_block_size // self.block_size

    def manager_block_slots(self, blocks: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
        """Slots of ``(scheduler block id, valid tokens)`` pairs (int64)."""
        if not blocks:
            return torch.zeros(0, dtype=torch.int64, device=device)
        ids = torch.tensor([b for b, _ in blocks], dtype=torch.int64, device=device)
        counts = torch.tensor([n for _, n in blocks], dtype=torch.int64, device=device)
        offs = torch.arange(self.manager_block_size, dtype=torch.int64, device=device)
        slots = (ids[:, None] * self.manager_block_size + offs[None, :])
        return slots[offs[None, :] < counts[:, None]]


# How each vLLM attention backend applies a sliding window W, in one place: the cached positions before
# its own that a query at position p reads (it reads [p - left, p]). Taken from each backend's attention
# code and, for the CPU, proved by experiment (tests/engines/vllm/test_window.py: corrupting position
# p - W + 1 changes the next token's logits, corrupting p - W changes nothing).
WINDOW_CONVENTIONS: dict[str, str] = {
    "CPU_ATTN": "impl.sliding_window = W; cpu_attention_with_kv_cache reads [p - W + 1, p]: left = W - 1",
    "FLASH_ATTN": "impl.sliding_window = (W - 1, 0) (FlashAttention 2/3 window_size): left = W - 1",
    "TRITON_ATTN": "impl.sliding_window = (W - 1, 0): left = W - 1",
    "FLASHINFER": "impl.sliding_window = (W - 1, 0) -> window_left = W - 1: left = W - 1",
}


def window_left(layer, window: int) -> int:
    """Cached positions before its own that a query reads in ``layer`` (a vLLM ``Attention`` layer with
    sliding window ``window``), from its backend's convention (`WINDOW_CONVENTIONS`); refuses a backend
    whose convention is not recorded there."""
    backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: None)()
    stored = getattr(getattr(layer, "impl", None), "sliding_window", None)
    if backend not in WINDOW_CONVENTIONS:
        raise KvCanaryValueError(
            f"kv-canary: sliding-window attention on vLLM backend {backend!r} is not supported (its window "
            f"convention is not recorded; known: {', '.join(WINDOW_CONVENTIONS)})"
        )
    left = int(stored) - 1 if backend == "CPU_ATTN" else int(stored[0])
    if left != window - 1 or left < 1:
        raise KvCanaryValueError(
            f"kv-canary: backend {backend} stores sliding window {stored!r} for a window of {window}; expected "
            f"{WINDOW_CONVENTIONS[backend]} with W >= 2"
        )
    return left


_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


def layer_number(name: str, fallback: int) -> int:
    """The model layer number in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    found = _LAYER_NUMBER.findall(name)
    return int(found[-1]) if found else fallback


def build_group_layouts(kv_cache_config, kv_caches: dict[str, torch.Tensor], kernel_block_sizes=None,
                        attention_layers=None, exclude=frozenset()) -> list[GroupLayout]:
    """Canary groups of a vLLM ``KVCacheConfig`` (read only): one per KV cache group, in vLLM's order, named by kind
    (`group_name`: ``full``, ``swa``, then ``full.1``, ``swa.1``, ... when a kind repeats). ``attention_layers``
    (layer name -> ``Attention`` layer, vLLM's static forward context): gives each sliding-window group its
    ``window_left``. ``exclude``: layer names left out of the canary's layer sets (a
    speculative draft model's own layers, `compat.draft_layer_names`); a group of excluded layers only is no canary
    group (the others keep their ``index``)."""
    layouts = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if exclude and group.layer_names and all(n in exclude for n in group.layer_names):
            continue
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if kind == "SlidingWindowSpec":
            of_kind, window = SWA, int(spec.sliding_window)
        elif kind == "FullAttentionSpec":
            of_kind, window = FULL, 0
        else:
            raise KvCanaryValueError(
                f"kv-canary: vLLM KV cache group {index} is {kind}; the canary checks full-attention and "
                "sliding-window groups only"
            )
        names = tuple(n for n in group.layer_names if n in kv_caches and n not in exclude)
        if not names:
            raise KvCanaryValueError(f"kv-canary: vLLM KV cache group {index} has no registered KV tensors")
        manager_bs = int(spec.block_size)
        tensor = kv_caches[names[0]]
        kernel_bs = int(kernel_block_sizes[index]) if kernel_block_sizes else int(tensor.shape[2])
        if manager_bs % kernel_bs:
            raise KvCanaryValueError(f"kv-canary: block size {manager_bs} is not a multiple of the kernel block size {kernel_bs}")
        if tensor.dim() != 4 or int(tensor.shape[2]) != kernel_bs:
            raise KvCanaryValueError(
                f"kv-canary: unexpected vLLM KV cache tensor {tuple(tensor.shape)} for layer {names[0]}; the canary "
                f"expects the CPU layout [num_blocks, num_kv_heads, {kernel_bs}, 2 * head_size]"
            )
        left = 0
        if window and attention_layers is not None:
            lefts = {window_left(attention_layers[n], window) for n in names}
            if len(lefts) != 1:
                raise KvCanaryValueError(f"kv-canary: vLLM KV cache group {index} mixes window conventions {sorted(lefts)}")
            left = lefts.pop()
        layouts.append(GroupLayout(
            name=group_name(of_kind, sum(g.kind == of_kind for g in layouts)), index=index, layer_names=names,
            layer_ids=tuple(layer_number(n, i) for i, n in enumerate(names)),
            block_size=kernel_bs, manager_block_size=manager_bs, num_blocks=int(tensor.shape[0]),
            sliding_window=window, window_left=left,
        ))
    return layouts


def group_name(kind: str, earlier: int) -> str:
    """The canary name of a KV cache group of ``kind`` after ``earlier`` groups of that kind: ``full`` / ``swa``, then
    ``full.1``, ``full.2``, ... (names `kvcanary.runtime.GroupSpec` accepts)."""
    return kind if earlier == 0 else f"{kind}.{earlier}"


# ---- token-major views of one layer's CPU cache ---------------------------------------------------
ViewFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _regions(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    nb, heads, block, two_d = (int(x) for x in kv.shape)
    dim = two_d // 2
    flat = kv.view(nb, heads, 2, block * dim)
    return flat[:, :, 0], flat[:, :, 1], nb, heads, block, dim


def _views_vec(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v, nb, h, b, d = _regions(kv)
    k_view = k.view(nb, h, d, b).permute(0, 3, 1, 2).unsqueeze(-1)  # [nb, B, H, D, 1]
    v_view = v.view(nb, h, b, d).permute(0, 2, 1, 3)  # [nb, B, H, D]
    return k_view, v_view


def _views_amx(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v, nb, h, b, d = _regions(kv)
    k_view = k.view(nb, h, b // 16, d // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)  # [nb, B/16, 16, H, D/2, 2]
    v_view = v.view(nb, h, d // 16, b // 2, 16, 2).permute(0, 3, 5, 1, 2, 4).unsqueeze(-1)  # [nb, B/2, 2, H, D/16, 16, 1]
    return k_view, v_view


def _views_plain(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v, nb, h, b, d = _regions(kv)
    return k.view(nb, h, b, d).permute(0, 2, 1, 3), v.view(nb, h, b, d).permute(0, 2, 1, 3)


CANDIDATES: dict[str, ViewFn] = {"vec": _views_vec, "amx": _views_amx, "plain": _views_plain}


def token_rows(view: torch.Tensor, block_size: int) -> torch.Tensor:
    """A copy of a token-major view as ``[num_blocks * block_size, elements per token]``."""
    return view.reshape(view.shape[0] * block_size, -1)


def _fits(view_fn: ViewFn, probes: dict[str, torch.Tensor], heads: int, dim: int, block: int) -> bool:
    try:
        views = {name: view_fn(t) for name, t in probes.items()}
    except RuntimeError:
        return False
    for side in (0, 1):
        tok = token_rows(views["t"][side], block).float()
        head = token_rows(views["h"][side], block).float()
        col = token_rows(views["d"][side], block).float()
        if tok.shape != (block, heads * dim):
            return False
        if not bool((tok == torch.arange(block, dtype=torch.float32)[:, None]).all()):
            return False
        codes = (head * dim + col).to(torch.int64).sort(dim=1).values
        if not bool((codes == torch.arange(heads * dim)[None, :]).all()):
            return False
    return True


def probe_cpu_layout(kv: torch.Tensor, isa: str) -> Optional[str]:
    """Name of the candidate view that fits how the CPU kernel for ``isa`` stores K/V, or None.

    Writes markers (token index, head index, dim index — exact in the cache dtype) for one full
    block through ``vllm._custom_ops.cpu_attn_reshape_and_cache`` into a scratch tensor shaped like
    one block of ``kv``, then checks each candidate (see the module docstring).
    """
    from vllm import _custom_ops as ops

    _, heads, block, two_d = (int(x) for x in kv.shape)
    dim = two_d // 2
    if max(block, heads, dim) > 256 and kv.dtype == torch.bfloat16:
        return None  # markers would not be exact
    probes = {}
    for name in ("t", "h", "d"):
        scratch = torch.zeros((1, heads, block, two_d), dtype=kv.dtype)
        key_cache, value_cache = scratch.view(1, heads, 2 * block, dim).chunk(2, dim=2)
        idx = torch.meshgrid(torch.arange(block), torch.arange(heads), torch.arange(dim), indexing="ij")
        marks = {"t": idx[0], "h": idx[1], "d": idx[2]}[name].to(kv.dtype).contiguous()
        try:
            ops.cpu_attn_reshape_and_cache(
                marks, marks, key_cache, value_cache, torch.arange(block, dtype=torch.int64), isa,
                k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
            )
        except (RuntimeError, TypeError) as exc:
            logger.warning("kv-canary: KV layout probe for isa %r failed (%s)", isa, exc)
            return None
        probes[name] = scratch
    for cand, fn in CANDIDATES.items():
        if _fits(fn, probes, heads, dim, block):
            return cand
    return None


def layer_kv_views(kv: torch.Tensor, layout_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major K and V views (row = kernel block) of one layer's CPU cache tensor."""
    return CANDIDATES[layout_name](kv)


def token_element_offsets(kv: torch.Tensor, layout_name: str, side: int, block_size: int) -> torch.Tensor:
    """int64 ``[block_size, elements per token]``: element offsets, from the start of a block of ``kv``
    (one layer's CPU cache tensor), of each token's K (side 0) or V (side 1) elements in logical
    (token-major view) order."""
    one = torch.arange(int(kv.stride(0)), dtype=torch.int64).view(1, *kv.shape[1:])
    return token_rows(CANDIDATES[layout_name](one)[side], block_size).contiguous()


def slot_elements(kv: torch.Tensor, layout_name: str, side: int, block_size: int, slot: int) -> torch.Tensor:
    """Flat element indices into ``kv`` of slot ``slot``'s K or V elements, in logical order."""
    offsets = token_element_offsets(kv, layout_name, side, block_size)
    return (slot // block_size) * int(kv.stride(0)) + offsets[slot % block_size]


class StripMirror:
    """Dense copy of the first ``nbytes`` of each slot's token-major strip, for one layer and side.

    The generic strided read of a permuted view costs a byte-offset computation per slot and launch;
    in ``partial`` hash mode (16 bytes per slot) the adapter instead gathers those bytes into this
    ``[num_slots, nbytes / element_size]`` tensor right before the canary reads real KV (TAIL, sweep),
    with per-token element offsets computed once from the view. The canary hashes the mirror — the
    same bytes, read from the engine's cache at the same moment.
    """

    def __init__(self, kv: torch.Tensor, layout_name: str, side: int, block_size: int, nbytes: int = 16) -> None:
        if not kv.is_contiguous():
            raise KvCanaryValueError("kv-canary: StripMirror needs a contiguous KV cache tensor")
        es = kv.element_size()
        if nbytes % es:
            raise KvCanaryValueError(f"kv-canary: StripMirror nbytes={nbytes} is not a multiple of the element size {es}")
        self.kv = kv
        self.block_size = block_size
        self.block_stride = int(kv.stride(0))
        n_el = nbytes // es
        self.offsets = token_element_offsets(kv, layout_name, side, block_size)[:, :n_el].contiguous()  # [block_size, n_el]
        self.mirror = torch.zeros(int(kv.shape[0]) * block_size, n_el, dtype=kv.dtype, device=kv.device)

    def refresh(self, slots: torch.Tensor) -> None:
        """Copy the strips of ``slots`` (int64, any order, repeats allowed) from the engine's cache."""
        if slots.numel() == 0:
            return
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        index = blocks[:, None] * self.block_stride + self.offsets[slots % self.block_size]
        self.mirror[slots] = self.kv.view(-1)[index]

    def refresh_all(self) -> None:
        """Copy every slot's strip (no index list: one gather of the same columns from each block)."""
        blocks = int(self.kv.shape[0])
        cols = self.offsets.flatten()  # [block_size * n_el] element offsets inside a block
        self.mirror.view(blocks, -1).copy_(self.kv.view(blocks, self.block_stride).index_select(1, cols))


# ---- GPU attention backends: FlashAttention 2/3, Triton attention, FlashInfer, FlexAttention -------
# vLLM 0.26-0.32 give every GPU backend the same logical layer shape [num_blocks, num_kv_heads, block_size,
# 2 * head_size] — per (block, head, token) the head's K (head_size elements) then its V — and one of two
# physical orders (the backend's ``get_kv_cache_stride_order``): NHD (vLLM's default; memory order
# [num_blocks, block_size, num_kv_heads, 2 * head_size], so one token's K and V of every head are one
# contiguous strip) or HND (the logical order itself).
GPU_LAYOUTS = ("nhd", "hnd")


def gpu_kv_layout(kv: torch.Tensor) -> Optional[str]:
    """``"nhd"`` / ``"hnd"`` for a GPU backend's layer tensor in that physical order, None for anything else."""
    if kv.dim() != 4:
        return None
    nb, heads, block, two_d = (int(x) for x in kv.shape)
    s = tuple(int(x) for x in kv.stride())
    if s == (block * heads * two_d, two_d, heads * two_d, 1):
        return "nhd"
    if s == (heads * block * two_d, block * two_d, two_d, 1):
        return "hnd"
    return None


def gpu_kv_sources(kv: torch.Tensor, layout_name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(k_source, v_source, page_size)``: the two byte sources the canary hashes for one GPU layer.

    nhd: page 1; the K source is each slot's whole strip ``[num_slots, heads * 2 * head_size]`` (the K and V
    of every head — ``all`` / deep fingerprints cover every byte of the slot), the V source head 0's V
    ``[num_slots, head_size]``; ``partial`` reads the first 16 bytes of each (head 0's K and V).
    hnd: page ``block_size``; the K source is head 0's ``[K, V]`` record per token, the V source the last
    head's (the heads in between are not hashed). Both are views of ``kv`` with contiguous rows (no copy)."""
    nb, heads, block, two_d = (int(x) for x in kv.shape)
    dim = two_d // 2
    if layout_name == "nhd":
        strips = kv.permute(0, 2, 1, 3).reshape(nb * block, heads * two_d)  # a view: NHD memory order
        return strips, strips[:, dim:two_d], 1
    if layout_name == "hnd":
        return kv[:, 0], kv[:, heads - 1], block
    raise KvCanaryValueError(f"kv-canary: unknown GPU KV layout {layout_name!r} (known: {', '.join(GPU_LAYOUTS)})")


def gpu_token_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major K and V views ``[num_blocks, block_size, heads, head_size]`` of one GPU layer tensor."""
    dim = int(kv.shape[3]) // 2
    tok = kv.permute(0, 2, 1, 3)
    return tok[..., :dim], tok[..., dim:]
