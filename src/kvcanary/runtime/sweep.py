"""`Sweeper`: verify every live cached slot — also idle prefix-cache slots no forward reads — at a
bounded cost per forward.

Rotating slices: each forward verifies the next ``ceil(num_slots / sweep_interval)`` slots of each group
(SWEEP_K / SWEEP_V over the TAIL buffers and, with deep fingerprints, over every byte of every layer), so a full pass over the slot space takes ``sweep_interval``
forwards and no forward pays for a stop-the-world pass. The slice's plan is built on the device from the
runtime's slot records (the position each slot was written at and the slot it chained from; a slot
outside the live set, or never written, becomes the padding slot 0, which verify skips), with a device
cursor: the slice is capturable in a CUDA graph. The live set is refreshed from the adapter's provider at
the start of each pass (host work once per pass): slot indices, or a bool mask over the group's slots (copied as
is: no index scatter, and no index list for the engine to build).

A predecessor rewritten since (freed and reused) is passed as unreachable (0), so only the slot's own
record and real KV are judged. `run` is the explicit full sweep (`Canary.sweep`): all live slots at once.
`run_masks` is the same sweep launched without a host read: each group's live set is a bool mask on the device,
swept chunk by chunk with the slice machinery (a whole pass in one call); its violations come through the drain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops import TOKEN_TO_KV_SLOT_PADDING, VerifyPlan, launch_canary_verify_kernels, launch_stamp_violation_rows
from kvcanary.runtime import kernels
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.counters import LaunchCounters
from kvcanary.runtime.drain import ViolationRings
from kvcanary.runtime.groups import NEVER_WRITTEN, CanaryGroup

OWNER_HISTORY = 64  # steps a swept slice's owners are remembered for late-drained rows
MASK_SWEEP_CHUNK = 1 << 17  # plan entries per launch of an explicit sweep from live masks (`Sweeper.run_masks`)


@dataclass(frozen=True)
class SweepReport:
    """One sweep: per group, live slots given (in its window, for a windowed sweep), slots verified, live slots
    never written."""

    step: int
    live: dict[str, int] = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)
    unrecorded: dict[str, int] = field(default_factory=dict)
    windows: dict[str, tuple[int, int]] = field(default_factory=dict)  # `run_masks`: slot window [lo, hi) per group

    @property
    def complete(self) -> bool:
        """True when every recorded live slot was verified."""
        return all(self.verified.get(g, 0) + self.unrecorded.get(g, 0) == n for g, n in self.live.items())


class _Slices:
    """One group's rotating slice: plan buffers, live mask, device cursor and pass counters."""

    def __init__(self, g: CanaryGroup, interval: int, owner_rows: int = OWNER_HISTORY) -> None:
        dev = g.device
        self.size = max(1, math.ceil(g.num_slots / interval))
        self.span = self.size * interval  # cursor wraps here: one pass == interval slices
        self.plan = VerifyPlan.allocate(self.size, dev)
        self.plan.verify_num_valid.fill_(self.size)
        self.plan.verify_expected_tokens.fill_(-1)
        self.offsets = torch.arange(self.size, dtype=torch.int64, device=dev)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=dev)
        self.done = torch.zeros(1, dtype=torch.int32, device=dev)  # the slice kernel's ticket counter (stays 0)
        self.live = torch.zeros(g.num_slots + 1, dtype=torch.bool, device=dev)  # + trash row
        self.live_count = torch.zeros(1, dtype=torch.int64, device=dev)  # at the current pass start
        self.verified = torch.zeros(1, dtype=torch.int64, device=dev)  # in the current pass
        self.last_pass = torch.zeros(2, dtype=torch.int64, device=dev)  # (live, verified) of the last full pass
        # Stamps name a slice entry (each entry is its own "row": rows of ones); the owner of each entry's slot
        # when it was swept stays here for OWNER_HISTORY steps, so late-drained rows blame the right writer.
        self.ones = torch.ones(self.size, dtype=torch.int64, device=dev)
        self.owner_history = torch.full((owner_rows, self.size), -1, dtype=torch.int64, device=dev)
        # host staging of live sets handed over in host memory, per dtype (int64 indices, bool masks), and the
        # event after the last upload from each
        self._pinned: dict[torch.dtype, torch.Tensor] = {}
        self._pinned_done: dict[torch.dtype, object] = {}

    def upload(self, values: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``values`` as a flat ``dtype`` device tensor. A host tensor bound for CUDA goes through a reused pinned
        buffer with a non-blocking copy (a pageable copy would wait for the stream: a sync once per pass)."""
        dev = self.live.device
        values = values.flatten()
        if values.device.type != "cpu" or dev.type != "cuda":
            return values.to(dev, dtype)
        n = values.numel()
        pinned, done = self._pinned.get(dtype), self._pinned_done.get(dtype)
        if pinned is None or pinned.numel() < n:
            pinned = self._pinned[dtype] = torch.empty(max(n, 2 * (pinned.numel() if pinned is not None else 0)),
                                                       dtype=dtype, pin_memory=True)
        elif done is not None:
            done.synchronize()  # one pass ago: long done
        pinned[:n].copy_(values)
        out = pinned[:n].to(dev, non_blocking=True)
        event = self._pinned_done[dtype] = torch.cuda.Event()
        event.record()
        return out


class Sweeper:
    """Runs the per-forward sweep slices and the explicit full sweep."""

    def __init__(
        self, groups: dict[str, CanaryGroup], *, config: CanaryConfig, rings: ViolationRings,
        counters: LaunchCounters, step: torch.Tensor,
    ) -> None:
        self.groups = groups
        self.interval = config.sweep_interval
        self.rings = rings
        self.counters = counters
        self.step = step
        self.sweeps = 0  # explicit full sweeps
        self.passes = 0  # rotating passes completed
        self.slices_run = 0
        self._refreshed_at = -1  # slices_run at the last live-set refresh (a pass refreshes once)
        self._last: Optional[SweepReport] = None
        self._mask_passes: dict[str, _Slices] = {}  # `run_masks`: one chunked pass per group, built on first use
        self.max_bytes = config.sweep_max_bytes
        self._window_next: dict[str, int] = {}  # `run_masks`: first slot of each group's next window
        self.windows: dict[str, tuple[int, int]] = {}  # `run_masks`: each group's last window [lo, hi)
        self._masks_pending: Optional[int] = None  # step of a `run_masks` sweep whose counts are not read yet
        self._masks_named: tuple[str, ...] = ()  # the groups that sweep named
        self._no_assert = torch.zeros(1, dtype=torch.int32, device=next(iter(groups.values())).device)
        self._slices = {n: _Slices(g, self.interval) for n, g in groups.items()} if self.interval > 0 else {}

    # ---- per forward --------------------------------------------------------------------------------
    def pass_starts(self) -> bool:
        """True when the next slice starts a pass whose live set is not refreshed yet (the host refreshes it first)."""
        return self.interval > 0 and self.slices_run % self.interval == 0 and self._refreshed_at != self.slices_run

    def refresh_live(self, live: Mapping[str, torch.Tensor]) -> None:
        """New live set for the pass about to start (host: once per pass)."""
        self._refreshed_at = self.slices_run
        if self.slices_run:
            self.passes += 1
        for name, sl in self._slices.items():
            if self.slices_run:
                sl.last_pass.copy_(torch.cat([sl.live_count, sl.verified]))
            slots = live.get(name)
            g = self.groups[name]
            if slots is not None and slots.dtype == torch.bool:  # a mask over the group's slots: copied as is
                sl.live[: g.num_slots].copy_(sl.upload(slots, torch.bool))
                sl.live[-1] = False
            else:
                sl.live.zero_()
                if slots is not None and slots.numel():
                    slots = sl.upload(slots).clamp(0, g.num_slots)  # out of range -> trash
                    sl.live.index_fill_(0, slots, True)
            sl.live[0] = False
            sl.live[-1] = False
            sl.live_count.copy_(sl.live.sum().view(1))
            sl.verified.zero_()

    def release(self, name: str, slots: torch.Tensor) -> None:
        """The engine freed ``slots`` (int indices of group ``name``): they leave the current pass's live set at
        once, so no slice verifies them while they are free (the engine may reuse their bytes, or give them to
        another request, before the slice reaches them). A slot not yet reached counts out of the pass's live
        total too. The next pass's live set comes from the provider as usual. Device ops only (no host read)."""
        sl = self._slices.get(name)
        if sl is None:
            return
        g = self.groups[name]
        dev = sl.live.device
        if slots.device.type == "cpu" and dev.type == "cuda":  # frees come often: a fresh pinned buffer from torch's
            host = torch.empty(slots.numel(), dtype=torch.int64, pin_memory=True)  # caching host allocator, no
            host.copy_(slots.flatten())  # wait for earlier copies (the shared pass buffer would wait for the last one)
            slots = host.to(dev, non_blocking=True)
        slots = slots.to(dev, torch.int64).flatten().clamp(0, g.num_slots)  # out of range -> trash (never live)
        if not slots.numel():
            return
        hit = torch.zeros_like(sl.live)
        hit.index_fill_(0, slots, True)
        hit &= sl.live
        pending = hit[: g.num_slots] & (torch.arange(g.num_slots, device=hit.device) >= sl.cursor)
        sl.live_count.sub_(pending.sum().view(1))
        sl.live &= ~hit

    def slice(self) -> None:
        """Verify the next slice of every group."""
        self.slice_device()
        self.slices_run += 1

    def slice_device(self) -> None:
        """The device half of `slice` (capturable; the caller counts ``slices_run``): `slice_plans`, then
        `slice_checks`."""
        self.slice_plans()
        self.slice_checks()

    def slice_plans(self) -> None:
        """Every group's slice plan, owners, ``verified`` and cursor from the slot records: one fused kernel per
        group on CUDA (`kernels.sweep_slice`). The only part of a slice that reads the records."""
        for name, sl in self._slices.items():
            g = self.groups[name]
            kernels.sweep_slice(
                records=g.records, plan=sl.plan, live_mask=sl.live, cursor=sl.cursor, offsets=sl.offsets,
                span=sl.span, step=self.step, owner_history=sl.owner_history, verified=sl.verified, done=sl.done,
            )

    def slice_checks(self) -> None:
        """Verify every group's slice plan (TAIL records, real KV, deep fingerprints) and stamp its rows."""
        for name, sl in self._slices.items():
            self._launch(self.groups[name], sl.plan, entry_rows=sl.ones)

    # ---- explicit full sweep ------------------------------------------------------------------------
    def run(self, live: Mapping[str, torch.Tensor]) -> SweepReport:
        """Verify the live slots of each group named in ``live`` now (host reads allowed)."""
        report = SweepReport(step=int(self.step.item()))
        for name, slots in live.items():
            g = self.groups[name]
            if slots.dtype == torch.bool:
                slots = slots.nonzero().flatten()  # a mask: its live slots
            slots = slots.to(g.device, torch.int64).flatten()
            slots = slots[slots != TOKEN_TO_KV_SLOT_PADDING]
            if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= g.num_slots):
                raise KvCanaryValueError(
                    f"kv-canary: live slots of group {name!r} must be in [1, {g.num_slots}), got "
                    f"[{int(slots.min())}, {int(slots.max())}]"
                )
            recorded = slots[g.records.step[slots] != NEVER_WRITTEN]
            report.live[name] = int(slots.numel())
            report.verified[name] = int(recorded.numel())
            report.unrecorded[name] = int(slots.numel()) - int(recorded.numel())
            if recorded.numel() == 0:
                continue
            n = int(recorded.numel())
            plan = VerifyPlan.allocate(n, g.device)
            plan.verify_num_valid.fill_(n)
            plan.verify_expected_tokens.fill_(-1)
            written_at = g.records.step[recorded]
            self._fill_plan(plan, g.records, recorded, written_at, torch.ones_like(recorded, dtype=torch.bool))
            self._launch(g, plan)
        self.sweeps += 1
        self.last = report
        return report

    def run_masks(self, masks: Mapping[str, torch.Tensor], step: int, chunk: int = MASK_SWEEP_CHUNK,
                  windows: Optional[Mapping[str, tuple[int, int]]] = None) -> None:
        """Verify the live slots of each group named in ``masks`` (bool ``[num_slots]`` on the group's device; True
        = live) now, without a host read: the group's slot window ``windows[name]`` (``[lo, hi)``, clamped to the
        slot space: an adapter that picks its own windows) or else its next window (all its slots, or at most
        ``sweep_max_bytes`` of K/V: `window_slots`), in chunks of at most ``chunk`` slots, each a plan filled from
        the slot records on the device and verified like `run`'s (rows attributed from the slot records when
        drained). ``step``: the host step the report names; the counts are read when `last` is."""
        for name, mask in masks.items():
            g = self.groups.get(name)
            if g is None:
                raise KvCanaryValueError(f"kv-canary: no canary group {name!r} (groups: {sorted(self.groups)})")
            if mask.dtype != torch.bool or mask.device != g.device or mask.numel() != g.num_slots:
                raise KvCanaryValueError(
                    f"kv-canary: a live mask of group {name!r} must be bool [{g.num_slots}] on {g.device}, got "
                    f"{mask.dtype} [{mask.numel()}] on {mask.device}")
            if windows is not None and name in windows:
                lo, hi = self._given_window(name, g, windows[name])
            else:
                lo, hi = self._next_window(name, g)
            size = min(chunk, max(hi - lo, 1))
            sl = self._mask_passes.get(name)
            if sl is None or sl.size != math.ceil(g.num_slots / math.ceil(g.num_slots / size)):
                sl = self._mask_passes[name] = _Slices(g, math.ceil(g.num_slots / size), owner_rows=1)
            sl.live[: g.num_slots].copy_(mask.flatten())
            sl.live[:max(lo, 1)] = False
            sl.live[hi:] = False  # also the trash row
            sl.live_count.copy_(sl.live.sum().view(1))
            sl.verified.zero_()
            sl.cursor.fill_(lo)
            for _ in range(math.ceil((hi - lo) / sl.size)):
                self.rings.mark()  # each chunk's stamps name its own rows only
                kernels.sweep_slice(records=g.records, plan=sl.plan, live_mask=sl.live, cursor=sl.cursor,
                                    offsets=sl.offsets, span=sl.span, step=self.step, owner_history=sl.owner_history,
                                    verified=sl.verified, done=sl.done)
                self._launch(g, sl.plan)
            self.windows[name] = (lo, hi)
        self.sweeps += 1
        self._masks_pending = step
        self._masks_named = tuple(masks)

    def warm_masks(self) -> None:
        """Launch `run_masks`'s kernels once per group on an all-False mask (nothing verified), so they compile before
        the first sweep; the sweep count, windows and the last report stay as they were."""
        saved = (self.sweeps, dict(self.windows), self._masks_pending, self._masks_named)
        masks = {n: torch.zeros(g.num_slots, dtype=torch.bool, device=g.device) for n, g in self.groups.items()}
        self.run_masks(masks, step=0, windows={n: (0, min(g.num_slots, MASK_SWEEP_CHUNK)) for n, g in self.groups.items()})
        self.sweeps, self.windows, self._masks_pending, self._masks_named = saved

    def window_slots(self, g: CanaryGroup) -> int:
        """Slots of ``g`` one `run_masks` sweep covers: all of them, or as many as ``sweep_max_bytes`` of K/V hold."""
        if self.max_bytes == 0:
            return g.num_slots
        return max(1, min(g.num_slots, self.max_bytes // g.kv_bytes_per_slot()))

    @staticmethod
    def _given_window(name: str, g: CanaryGroup, window) -> tuple[int, int]:
        """An adapter's window ``(lo, hi)`` clamped to ``[0, num_slots]``; refused when it is not two integers."""
        if (not isinstance(window, tuple) or len(window) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in window)):
            raise KvCanaryValueError(f"kv-canary: the sweep window of group {name!r} must be (lo, hi) slot integers, "
                                     f"got {window!r}")
        lo = min(max(window[0], 0), g.num_slots)
        return lo, min(max(window[1], lo), g.num_slots)

    def _next_window(self, name: str, g: CanaryGroup) -> tuple[int, int]:
        """``[lo, hi)``: the slots after the group's last window (from 0 after the end of the slot space)."""
        lo = self._window_next.get(name, 0)
        lo = 0 if lo >= g.num_slots else lo
        hi = min(g.num_slots, lo + self.window_slots(g))
        self._window_next[name] = hi
        return lo, hi

    @property
    def last(self) -> Optional[SweepReport]:
        """The last explicit sweep's report (a `run_masks` sweep's counts are read from the device here, once)."""
        if self._masks_pending is not None:
            counts = {n: self._mask_passes[n] for n in self._masks_named}
            live = {n: int(sl.live_count.item()) for n, sl in counts.items()}
            verified = {n: int(sl.verified.item()) for n, sl in counts.items()}
            self._last = SweepReport(step=self._masks_pending, live=live, verified=verified,
                                     unrecorded={n: live[n] - verified[n] for n in live},
                                     windows={n: self.windows[n] for n in self._masks_named})
            self._masks_pending = None
        return self._last

    @last.setter
    def last(self, report: Optional[SweepReport]) -> None:
        self._last = report
        self._masks_pending = None

    # ---- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def _fill_plan(plan: VerifyPlan, rec, slots: torch.Tensor, written_at: torch.Tensor, live: torch.Tensor) -> None:
        kernels.fill_sweep_plan(plan, rec, slots, written_at, live)

    def _launch(self, g: CanaryGroup, plan: VerifyPlan, entry_rows: Optional[torch.Tensor] = None) -> None:
        """Verify ``plan`` on every TAIL side and stamp the rows (with ``entry_rows`` — ones — a stamp's batch
        row is the plan entry; without, rows are attributed from the slot records when drained)."""
        stamp_plan = dict(verify_plan=plan, req_pool_indices=entry_rows, prefix_lens=entry_rows) if entry_rows is not None else {}
        # The TAIL records, then every layer's bytes; sides interleaved so that K and V (other rings) share a
        # launch on CUDA while each ring still gets its rows in this order.
        contexts = [g.context("sweep", side, "verify", rings=self.rings, counters=self.counters,
                              chain_assert=self._no_assert, deep=deep)
                    for deep in (None, *g.deep_chunks()) for side in g.tail_sides]
        launch_canary_verify_kernels(contexts=contexts, plan=plan, check_verify_expected_token=False)
        tags = [g.tag("sweep", side) for side in g.tail_sides]
        for ring_args in self.rings.stamp_launches(g.name, tags):  # one launch when the sides' rings are adjacent
            launch_stamp_violation_rows(**ring_args, step=self.step, **stamp_plan)

    def owner_at_sweep(self, group: str, step: int, entry: int, current_step: int) -> Optional[int]:
        """Owner code of the slot behind ``entry`` of the slice swept at ``step``, if still remembered."""
        sl = self._slices.get(group)
        if sl is None or entry < 0 or entry >= sl.size or current_step - step >= OWNER_HISTORY:
            return None
        return int(sl.owner_history[step % OWNER_HISTORY, entry])

    def cursor_state(self) -> list[torch.Tensor]:
        """Device state a warm-up run must restore (cursors and pass counters)."""
        return [t for sl in self._slices.values() for t in (sl.cursor, sl.verified)]

    def pass_report(self) -> dict[str, dict[str, int]]:
        """Per group: live slots and slots verified in the last complete rotating pass (a host read)."""
        return {n: dict(zip(("live", "verified"), sl.last_pass.tolist())) for n, sl in self._slices.items()}
