"""`MoveObserver`: the KV that transformers moves between forwards, carried into one session's canary.

transformers 5.24.0 moves KV outside the forward in two ways (the wrapped methods and what they do are in
`compat`, the KV-moves section):

* **fork** (``num_return_sequences > 1``): a child shares its parent's full blocks and gets copies of the
  rest (``perform_cache_copy``). After the engine's copy: ``Canary.copy_slots`` of every copied block's
  slots, source -> destination, owned by the child whose block table holds the destination block.
* **CPU offload / restore**: a victim's blocks go to a host pool (``_offload_to_cpu``) and come back, later,
  into other blocks (``restore_scheduled_requests``). At offload the records of the victim's live slots are
  exported (``Canary.export_records``) and parked in host memory, keyed by request id, beside the engine's
  host copy. At restore they are imported into the new blocks (``Canary.import_records``) and verified at
  once against the restored KV, expected positions and the request's tokens, under the ``MOVE_{K,V}`` tags
  and attributed to the restoring request: KV damaged while parked is reported then.

* **free**: blocks going back to the engine's pool (``CachePool.free_blocks`` / ``reset``) are released from
  the sweep's live set (``Canary.release_slots``): a freed block's bytes may be reused at once — by its own
  group, or by the other group once its sector is free (the groups cut one byte tensor into blocks of different
  sizes) — so the sweep pass that listed it live at its start must not check it any longer.

Slots are the canary's compact slots (`layout.GroupLayout`): ``block * page_size + offset``. A request's live
positions: ``[0, L)`` for full attention (position ``p`` in logical block ``p // page_size``), the last
``min(L, W)`` for a sliding window of ``W`` (ring index ``p % W``), ``L`` = ``compat.kv_length``.

Moves run between forwards, on the engine's compute stream (where it copies). `enter` returns the canary when
the session is live (ending a deferred step first) or None (a stale session: pass through); an error of the
canary goes to `failed` (the handle's log / raise policy) and never stops the engine's own move.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvcanary.engines.transformers_cb import compat
from kvcanary.engines.transformers_cb.layout import GroupLayout
from kvcanary.errors import KvCanaryRuntimeError

FORK_LABEL, RESTORE_LABEL = "fork", "cpu-restore"


@dataclass(frozen=True, kw_only=True)
class ParkedRecords:
    """One group's records of an offloaded request, held in host memory until its restore.

    positions / block_index / offset: int64 ``[n]`` (CPU): each live position, the logical block that
    holds it and the offset in that block. records: the int64 ``[1 + n, 4 * B]`` export (CPU), same order.
    """

    positions: torch.Tensor
    block_index: torch.Tensor
    offset: torch.Tensor
    records: torch.Tensor


def live_positions(g: GroupLayout, kv_len: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, logical block, offset) int64 ``[n]`` of the positions a request of ``kv_len`` cached
    tokens keeps in ``num_blocks`` blocks of group ``g`` (see the module docstring), in position order."""
    if g.sliding_window:
        pos = torch.arange(max(0, kv_len - g.sliding_window), kv_len, dtype=torch.int64)
        ring = pos % g.sliding_window
    else:
        pos = torch.arange(min(kv_len, num_blocks * g.page_size), dtype=torch.int64)
        ring = pos
    block = torch.div(ring, g.page_size, rounding_mode="floor")
    keep = block < num_blocks
    return pos[keep], block[keep], (ring % g.page_size)[keep]


def block_slots(g: GroupLayout, blocks) -> torch.Tensor:
    """Every slot of ``blocks`` (block ids, in order): int64 ``[len(blocks) * page_size]``."""
    b = torch.as_tensor(list(blocks), dtype=torch.int64)
    return (b[:, None] * g.page_size + torch.arange(g.page_size, dtype=torch.int64)[None, :]).flatten()


class MoveObserver:
    """The fork / offload / restore / free wrappers of one session (see the module docstring)."""

    def __init__(self, *, cache, processor, layouts: list[GroupLayout], enter: Callable[[], Optional[object]],
                 failed: Callable[[Exception], None], context_id: Optional[Callable[[str], int]] = None) -> None:
        self.cache = cache
        self.context_id = context_id  # request id -> its context key (the translator's), for restores
        self.processor = processor
        self.manager = compat.offloading_manager(processor) if compat.cpu_offload_enabled(processor) else None
        self.by_type = {g.layer_type: g for g in layouts}
        self.by_index = {g.index: g for g in layouts}
        self.enter = enter
        self.failed = failed
        self.parked: dict[str, dict[str, ParkedRecords]] = {}  # request id -> group name -> records
        self.forks = 0  # perform_cache_copy calls observed
        self.slots_copied = 0
        self.offloads = 0  # requests whose records were parked
        self.restores = 0  # requests whose records were imported and verified
        self.slots_restored = 0
        self.slots_released = 0  # slots of blocks freed to the engine's pool
        self._installed: list[tuple[object, str]] = []

    # ---- install / remove ----------------------------------------------------------------------------
    def install(self) -> None:
        """Shadow the engine's move methods on this session's cache (and offloading manager, when the host
        pool exists); `remove` undoes exactly this."""
        try:
            self._shadow(self.cache, compat.FORK_COPY_METHOD, self._wrap_fork_copy)
            pool = compat.cache_pool(self.cache)
            self._shadow(pool, compat.POOL_FREE_METHOD, self._wrap_pool_free)
            self._shadow(pool, compat.POOL_RESET_METHOD, self._wrap_pool_reset)
            if self.manager is not None:
                self._shadow(self.manager, compat.OFFLOAD_METHOD, self._wrap_offload)
                self._shadow(self.manager, compat.RESTORE_METHOD, self._wrap_restore)
        except Exception:
            self.remove()
            raise

    def remove(self) -> None:
        for obj, name in self._installed:
            compat.unshadow_method(obj, name)
        self._installed = []
        self.parked.clear()

    def counts(self) -> dict:
        """The moves observed: ``fork_copies``, ``slots_copied``, ``offloads``, ``restores``, ``slots_restored``,
        ``slots_released`` (slots of blocks freed to the pool)."""
        return {"fork_copies": self.forks, "slots_copied": self.slots_copied, "offloads": self.offloads,
                "restores": self.restores, "slots_restored": self.slots_restored,
                "slots_released": self.slots_released}

    def _shadow(self, obj, name: str, make) -> None:
        compat.shadow_method(obj, name, make)
        self._installed.append((obj, name))

    # ---- the wrappers ----------------------------------------------------------------------------------
    def _wrap_fork_copy(self, original):
        def perform_cache_copy(copy_src_and_dst):
            result = original(copy_src_and_dst)
            self._observe(lambda canary: self._copy(canary, copy_src_and_dst))
            return result

        return perform_cache_copy

    def _wrap_pool_free(self, original):
        def free_blocks(index, block_ids):
            result = original(index, block_ids)
            if block_ids:
                self._observe(lambda canary: self._release(canary, index, block_ids))
            return result

        return free_blocks

    def _wrap_pool_reset(self, original):
        def reset():
            result = original()
            self._observe(lambda canary: [canary.release_slots(g.name, torch.arange(g.num_slots))
                                          for g in self.by_type.values()])
            return result

        return reset

    def _wrap_offload(self, original):
        def offload_to_cpu(victims, victim_block_tables):
            moved = original(victims, victim_block_tables)
            self._observe(lambda canary: self._park(canary, victims, victim_block_tables, moved))
            return moved

        return offload_to_cpu

    def _wrap_restore(self, original):
        def restore_scheduled_requests(requests_in_batch):
            due: list = []
            try:  # read before the engine pops its host-block lists
                due = self._due(requests_in_batch)
            except Exception as exc:  # noqa: BLE001 — the canary's failure, never the engine's
                self.failed(exc)
            result = original(requests_in_batch)
            if due:
                self._observe(lambda canary: self._unpark(canary, due))
            return result

        return restore_scheduled_requests

    def _observe(self, work: Callable[[object], None]) -> None:
        try:
            canary = self.enter()
            if canary is None:
                return
            stream = compat.compute_stream(self.processor)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                work(canary)
        except Exception as exc:  # noqa: BLE001 — routed to the handle's log / raise policy
            self.failed(exc)

    # ---- fork ------------------------------------------------------------------------------------------
    def _copy(self, canary, copy_src_and_dst: dict) -> None:
        for layer_type, (src_blocks, dst_blocks) in copy_src_and_dst.items():
            if not src_blocks:
                continue
            g = self._group(layer_type)
            owner = self._owners(layer_type, set(dst_blocks))
            ids: list = []
            lens: list[int] = []
            for block in dst_blocks:
                rid = owner.get(block)
                if ids and ids[-1] == rid:
                    lens[-1] += g.page_size
                else:
                    ids.append(rid)
                    lens.append(g.page_size)
            src, dst = block_slots(g, src_blocks), block_slots(g, dst_blocks)
            report = canary.copy_slots(g.name, src, dst, request_ids=ids, request_lens=lens, label=FORK_LABEL)
            self.slots_copied += report.moved
        self.forks += 1

    def _owners(self, layer_type: str, blocks: set) -> dict:
        """Destination block -> the request whose block table holds it (fresh blocks: one owner each)."""
        owner = {}
        for rid, table in compat.request_blocks(compat.allocators(self.cache)[layer_type]).items():
            for block in table:
                if block in blocks:
                    owner[block] = rid
        return owner

    # ---- free ------------------------------------------------------------------------------------------
    def _release(self, canary, index: int, block_ids) -> None:
        g = self.by_index.get(int(index))
        if g is None:
            raise KvCanaryRuntimeError(f"kv-canary: the engine freed blocks of an unknown cache allocator index {index}")
        canary.release_slots(g.name, block_slots(g, block_ids))
        self.slots_released += len(block_ids) * g.page_size

    # ---- offload / restore -----------------------------------------------------------------------------
    def _park(self, canary, victims, victim_block_tables: dict, moved) -> None:
        for state in victims:
            rid = state.request_id
            if rid not in moved:
                continue
            kv_len = compat.kv_length(state)
            parked = {}
            for layer_type, blocks in victim_block_tables[rid].items():
                g = self._group(layer_type)
                pos, block, off = live_positions(g, kv_len, len(blocks))
                slots = torch.as_tensor(list(blocks), dtype=torch.int64)[block] * g.page_size + off
                records = canary.export_records(g.name, slots).to("cpu")
                parked[g.name] = ParkedRecords(positions=pos, block_index=block, offset=off, records=records)
            self.parked[rid] = parked
            self.offloads += 1

    def _due(self, requests_in_batch) -> list:
        """(request id, state, allocator name -> host blocks) of the batch's requests about to be restored."""
        due = []
        for fs in requests_in_batch:
            state = compat.request_state(fs)
            if compat.is_cpu_offloaded(state):
                counts = compat.offloaded_block_counts(self.manager, state.request_id)
                if counts is not None:
                    due.append((state.request_id, state, counts))
        return due

    def _unpark(self, canary, due: list) -> None:
        for rid, state, counts in due:
            parked = self.parked.pop(rid, None)
            if parked is None:
                raise KvCanaryRuntimeError(
                    f"kv-canary: request {rid} was restored from CPU offload but the canary holds no records for it "
                    "(offloaded before this session opened); its restored KV cannot be checked"
                )
            kv_len = compat.kv_length(state)
            tokens = torch.as_tensor(compat.request_tokens(state), dtype=torch.int64)
            for layer_type, n_host in counts.items():
                g = self._group(layer_type)
                p = parked.get(g.name)
                if p is None or not p.positions.numel():
                    continue
                blocks = torch.as_tensor(compat.request_blocks(compat.allocators(self.cache)[layer_type]).get(rid, []),
                                         dtype=torch.int64)
                restored = min(n_host, int(blocks.numel()))
                keep = (p.block_index < restored) & (p.positions < kv_len) & (p.positions < tokens.numel())
                at = p.block_index.clamp(max=max(0, restored - 1))
                dst = torch.where(keep, blocks[at] * g.page_size + p.offset if restored else p.offset, 0)
                want = torch.where(keep, tokens[p.positions.clamp(max=max(0, tokens.numel() - 1))], -1)
                keys = [self.context_id(rid)] if self.context_id is not None else None
                report = canary.import_records(g.name, dst, p.records, verify=True, positions=p.positions,
                                               tokens=want, request_ids=[rid], label=RESTORE_LABEL, context_keys=keys)
                self.slots_restored += report.moved
            self.restores += 1

    def _group(self, layer_type: str) -> GroupLayout:
        g = self.by_type.get(layer_type)
        if g is None:
            raise KvCanaryRuntimeError(f"kv-canary: the engine moved KV of an unknown cache allocator {layer_type!r}")
        return g


__all__ = ["MoveObserver", "ParkedRecords", "block_slots", "live_positions"]
