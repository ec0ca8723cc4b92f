"""Draining: the device violation rings, and getting their rows to the host without stalling the forward.

A violation is *born* in an op (a row appended to its group's ring of its launch tag); right after the step's launches
the stamp op writes, beside each new row, the step and batch row it belongs to (so rows stay meaningful
after the step's plans are overwritten). Draining then works one step or more late:

1. end of every ``interval``-th step (a *look*): a non-blocking copy of the write indices into pinned memory,
   an event recorded;
2. a later look finds that copy complete (``event.query()``, never a wait); if it shows rows, the drain
   enqueues a *harvest*: rings, stamps and indices copied (non-blocking) into pinned memory, then the
   indices reset — stream-ordered, so no row appended before the reset is missed;
3. a later step finds the harvest complete and decodes its rows once into `RingRow`s.

On the CPU (no asynchrony) and in ``raise`` mode (which may wait) a step's rows are harvested at its end.
Counts per ring (group, tag) come from the write indices, exact even when a ring is full (the first ``capacity`` rows
since the last harvest are kept, docs/design.md §3.4).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops import (
    VIOLATION_FIELD_EXPECTED_AUX,
    VIOLATION_FIELD_EXPECTED_TOKEN,
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
    VIOLATION_FIELD_STORED_CHAIN_HASH,
    VIOLATION_FIELD_STORED_TOKEN,
    VIOLATION_FIELDS,
    CanaryLaunchTag,
    FailReason,
)
from kvcanary.ops.constants import (
    MASK64,
    STAMP_FIELD_BATCH_ROW,
    STAMP_FIELD_EXPECTED_POSITION,
    STAMP_FIELD_STEP,
    STAMP_FIELDS,
    WRITE_FAIL_REASONS,
)
from kvcanary.runtime.cuda_host import current_stream
from kvcanary.runtime.polled import PolledWords


RingKey = tuple[str, CanaryLaunchTag]
"""A ring's key: (canary group name, launch tag). Groups of one kind (``full`` and ``full.1``) launch under the
same tags; each group keeps rings of its own, so a row names its group."""


def ring_order(keys: Sequence[RingKey]) -> list[RingKey]:
    """``keys`` without repeats, in stack order: HEAD / TAIL / SWEEP tags of the full groups, then the swa groups',
    then the MOVE tags (full, swa); inside each block group by group (first appearance), each group's tags by value.
    One group per kind gives the tags' own order; a group's HEAD and TAIL (and its SWEEP) rings stay adjacent."""
    first: dict[str, int] = {}
    for name, _ in keys:
        first.setdefault(name, len(first))

    def block(tag: CanaryLaunchTag) -> int:
        v = int(tag)
        return v // 6 if v < 12 else 2 + (v - 12) // 2

    return sorted(set(keys), key=lambda k: (block(k[1]), first[k[0]], int(k[1])))


@dataclass(frozen=True, slots=True)
class RingRow:
    """One ring row decoded, with its stamp. Hashes are unsigned; ``expected_token`` is -1 when none was
    expected; ``batch_row`` / ``expected_position`` are -1 when the stamp could not tell. For a HEAD / TAIL row
    ``batch_row`` is the batch row that read or wrote the slot; for a SWEEP row it is the entry of the swept slice
    (`sweep_entry`): a sweep serves no request. ``group``: the canary group whose ring held it (its name; the tag
    tells only the kind)."""

    tag: CanaryLaunchTag
    group: str
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_hash: int
    expected_aux: int
    reasons: FailReason
    step: int
    batch_row: int
    expected_position: int

    @property
    def is_write(self) -> bool:
        return bool(int(self.reasons) & WRITE_FAIL_REASONS)

    @property
    def sweep_entry(self) -> int:
        """The slice entry a SWEEP row checked (its stamp's batch-row field)."""
        return self.batch_row


@dataclass(frozen=True)
class Harvest:
    """What one drain brought back: exact counts per ring (`RingKey`), rows lost to full rings, the kept rows."""

    counts: dict[RingKey, int]
    dropped: int
    rows: list[RingRow]


class ViolationRings:
    """Per-ring device rings (int64 [cap, 8]), write indices (int32), step marks and stamps; one ring per
    `RingKey` (group name, launch tag), stacked in `ring_order`."""

    def __init__(self, *, keys: Sequence[RingKey], capacity: int, device: torch.device,
                 write_index: Optional[torch.Tensor] = None) -> None:
        self.keys = ring_order(keys)
        self.index = {key: i for i, key in enumerate(self.keys)}
        self.capacity = capacity
        self.device = device
        t = len(self.keys)
        self.rings = torch.zeros(t, capacity, VIOLATION_FIELDS, dtype=torch.int64, device=device)
        self.stamps = torch.full((t, capacity, STAMP_FIELDS), -1, dtype=torch.int64, device=device)
        self.write_index = torch.zeros(t, dtype=torch.int32, device=device) if write_index is None else write_index
        if self.write_index.shape != (t,) or self.write_index.dtype != torch.int32:
            raise KvCanaryValueError(f"kv-canary: ring write_index must be int32 [{t}], got {self.write_index.dtype} "
                                     f"{tuple(self.write_index.shape)}")
        self.rows_from = torch.zeros(t, dtype=torch.int32, device=device)

    def ring_for(self, group: str, tag: CanaryLaunchTag) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ring [capacity, 8], write_index [1])`` views for group ``group``'s launches under ``tag``."""
        i = self.index[(group, tag)]
        return self.rings[i], self.write_index[i : i + 1]

    def stamps_for(self, group: str, tag: CanaryLaunchTag) -> torch.Tensor:
        """The stamps ``[capacity, STAMP_FIELDS]`` beside ``ring_for(group, tag)``'s ring."""
        return self.stamps[self.index[(group, tag)]]

    def stamp_args(self, group: str, tag: CanaryLaunchTag) -> dict:
        """The ring-side keyword arguments of the stamp op for group ``group``'s ring of ``tag``."""
        i = self.index[(group, tag)]
        return dict(
            violation_ring=self.rings[i], violation_write_index=self.write_index[i : i + 1],
            rows_from=self.rows_from[i : i + 1], stamps=self.stamps[i],
        )

    def stamp_launches(self, group: str, tags: Sequence[CanaryLaunchTag]) -> list[dict]:
        """The ring-side arguments of the stamp launches covering group ``group``'s rings of ``tags``: one over the
        stacked rings when they are consecutive in the stack, else one per tag (`stamp_args`)."""
        idx = [self.index[(group, t)] for t in tags]
        lo, k = idx[0], len(idx)
        if k == 1 or idx != list(range(lo, lo + k)):
            return [self.stamp_args(group, t) for t in tags]
        return [dict(
            violation_ring=self.rings[lo : lo + k], violation_write_index=self.write_index[lo : lo + k],
            rows_from=self.rows_from[lo : lo + k], stamps=self.stamps[lo : lo + k],
        )]

    def mark(self) -> None:
        """Remember where every ring stands before a step's launches (device copy, capturable)."""
        self.rows_from.copy_(self.write_index)

    def memory_bytes(self) -> int:
        return self.rings.numel() * 8 + self.stamps.numel() * 8 + 2 * self.write_index.numel() * 4


class ViolationDrain:
    """Moves ring rows to the host without a wait on the per-forward path (see the module docstring).

    ``polled`` holds the rings' write indices and the counters the host watches (``watched``: the latest
    host values of its counters and disabled plans) in one buffer: one copy per step reads them all.
    ``event`` makes the events that mark a copy's completion (``record(stream)``, ``query()``, ``synchronize()``;
    default ``torch.cuda.Event``), ``stream()`` gives the stream to record them on (default: the current CUDA
    stream) — a host-side clock can stand in for both."""

    def __init__(self, rings: ViolationRings, *, synchronous: bool, polled: PolledWords,
                 asynchronous: Optional[bool] = None, event=None, stream=None, interval: int = 1) -> None:
        if rings.write_index is not polled.write_index:
            raise KvCanaryValueError("kv-canary: the rings' write_index must be the polled words' view")
        self.rings = rings
        self.polled = polled
        self.interval = interval  # asynchronous mode: steps between looks (a look: one copy of ``polled``)
        self._steps = 0
        self.asynchronous = (rings.device.type == "cuda" and not synchronous) if asynchronous is None else asynchronous
        self._event = event or torch.cuda.Event
        self._stream = stream or current_stream  # the memoised stream object (`cuda_host.current_stream`)
        self.watched: tuple[list[int], list[int]] = polled.decode([0] * polled.buffer.numel())[1:]
        self.watched_step = 0  # the step whose end ``watched`` was read at (asynchronous mode: a look that completed)
        self._epoch = 0  # harvests enqueued so far; a snapshot taken before the last one is stale
        self._snapshots: deque = deque()
        self._harvest: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]] = None
        if self.asynchronous:
            t, cap = len(rings.keys), rings.capacity
            self._pinned = [_host(polled.buffer.numel(), dtype=torch.int64) for _ in range(8)]
            self._events = [self._event() for _ in range(8)]  # reused: one per pinned snapshot buffer
            self._h_rings = _host(t, cap, VIOLATION_FIELDS, dtype=torch.int64)
            self._h_stamps = _host(t, cap, STAMP_FIELDS, dtype=torch.int64)
            self._h_index = _host(t, dtype=torch.int32)
            self._next_pinned = 0

    # ---- the per-step half (no waits in asynchronous mode) ---------------------------------------
    def end_step(self, step: int = 0) -> list[Harvest]:
        """Call after step ``step``'s launches were enqueued. Returns harvests that completed (maybe none)."""
        if not self.asynchronous:
            self.watched = self.polled.decode(self.polled.buffer.tolist())[1:]
            self.watched_step = step
            return self.flush()
        done = self._take_harvest(wait=False)
        self._steps += 1
        if self._steps % self.interval:
            return [done] if done is not None else []
        k = self._next_pinned
        self._next_pinned = (k + 1) % len(self._pinned)
        if len(self._snapshots) == len(self._pinned):  # the GPU is far behind: drop the oldest look (slot k)
            self._snapshots.popleft()
        self._pinned[k].copy_(self.polled.buffer, non_blocking=True)
        event = self._events[k]
        self._record(event)
        self._snapshots.append((self._epoch, k, event, step))
        while self._snapshots and self._snapshots[0][2].query():
            epoch, k, _, self.watched_step = self._snapshots.popleft()
            index, *watched = self.polled.decode(self._pinned[k].tolist())
            self.watched = tuple(watched)
            if epoch == self._epoch and self._harvest is None and any(index):
                self._enqueue_harvest()
        return [done] if done is not None else []

    # ---- whenever the caller may wait (user queries, close, raise mode, CPU) -----------------------
    def flush(self, step: Optional[int] = None) -> list[Harvest]:
        """Everything recorded so far, now (waits for the device); ``step``: the last step enqueued (``watched_step``)."""
        out = []
        if self.asynchronous:
            pending = self._take_harvest(wait=True)
            if pending is not None:
                out.append(pending)
            self._snapshots.clear()
            self.watched = self.polled.decode(self.polled.buffer.tolist())[1:]
            if step is not None:
                self.watched_step = step
            self._enqueue_harvest()
            out.append(self._take_harvest(wait=True))
        else:
            counts = self.rings.write_index.tolist()
            if any(counts):
                rings = self.rings.rings.to("cpu", copy=True)
                stamps = self.rings.stamps.to("cpu", copy=True)
                self.rings.write_index.zero_()
                out.append(self._decode(torch.tensor(counts, dtype=torch.int32), rings, stamps))
        return [h for h in out if h.counts]

    # ---- internals ---------------------------------------------------------------------------------
    def _enqueue_harvest(self) -> None:
        r = self.rings
        self._h_rings.copy_(r.rings, non_blocking=True)
        self._h_stamps.copy_(r.stamps, non_blocking=True)
        self._h_index.copy_(r.write_index, non_blocking=True)
        r.write_index.zero_()
        event = self._event()
        self._record(event)
        self._epoch += 1
        self._harvest = (self._h_index, self._h_rings, self._h_stamps, event)

    def _record(self, event) -> None:
        event.record(self._stream())

    def _take_harvest(self, *, wait: bool) -> Optional[Harvest]:
        if self._harvest is None:
            return None
        index, rings, stamps, event = self._harvest
        if wait:
            event.synchronize()
        elif not event.query():
            return None
        self._harvest = None
        return self._decode(index, rings, stamps)

    def _decode(self, index: torch.Tensor, rings: torch.Tensor, stamps: torch.Tensor) -> Harvest:
        cap = self.rings.capacity
        counts = {key: n for key, n in zip(self.rings.keys, index.tolist()) if n}
        rows: list[RingRow] = []
        for key, n in counts.items():
            i = self.rings.index[key]
            kept = min(n, cap)
            for f, s in zip(rings[i, :kept].tolist(), stamps[i, :kept].tolist()):
                rows.append(RingRow(
                    tag=key[1],
                    group=key[0],
                    slot=f[VIOLATION_FIELD_SLOT_IDX],
                    position=f[VIOLATION_FIELD_POSITION],
                    stored_token=f[VIOLATION_FIELD_STORED_TOKEN],
                    expected_token=f[VIOLATION_FIELD_EXPECTED_TOKEN],
                    stored_hash=f[VIOLATION_FIELD_STORED_CHAIN_HASH] & MASK64,
                    expected_aux=f[VIOLATION_FIELD_EXPECTED_AUX],
                    reasons=FailReason(f[VIOLATION_FIELD_FAIL_REASON_BITS]),
                    step=s[STAMP_FIELD_STEP], batch_row=s[STAMP_FIELD_BATCH_ROW],
                    expected_position=s[STAMP_FIELD_EXPECTED_POSITION],
                ))
        dropped = sum(max(0, n - cap) for n in counts.values())
        return Harvest(counts=counts, dropped=dropped, rows=rows)


def _host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer for non-blocking device->host copies (pinned when CUDA is present)."""
    t = torch.zeros(*shape, dtype=dtype)
    return t.pin_memory() if torch.cuda.is_available() else t
