"""`Canary`: the object an engine adapter holds — one per engine instance.

How an adapter drives it (the whole engine-facing API):

1. Create it once, after the KV pools exist::

       canary = create_canary(CanaryConfig.from_env(), groups=[GroupSpec(name="full", num_slots=N,
                              layer_ids=(0, 1, 2, 3))], max_requests=R, max_context=C, device=dev)
       # None in mode "none": attach nothing, pay nothing.

2. Tell it where each group's real K/V live (per layer; the config picks which layers are hashed)::

       canary.set_kv_cache("full", {layer: (k_tensor, v_tensor) for layer in ...}, page_size=P)

   ``k_tensor`` / ``v_tensor`` hold slot ``s`` at row ``s // P``, byte column ``(s % P) * bytes_per_token``
   (e.g. ``[num_slots, heads, dim]`` with P = 1, or ``[num_pages, P, heads, dim]``). Tensors must stay
   the same objects (the engine's preallocated pools); call again if the engine reallocates them.

3. Tell it which slots are live (allocated: running requests and idle prefix-cache entries), for the
   periodic sweep — a callable returning ``{group name: int tensor of slot indices}``::

       canary.set_live_slots_provider(lambda: {"full": allocator.used_slots()})

4. Around every model forward (outside CUDA graph capture, before the graph replays)::

       with canary.forward(batch):          # batch: BatchDescription, built before the forward
           engine.run_model(...)            # writes the KV of batch.groups[g].out_cache_loc

   or the two halves ``before_forward(batch)`` / ``after_forward()`` when a ``with`` does not fit
   (hooks). A forward entered while another is open passes through unchecked (re-entrancy).
   ``BatchDescription`` carries request rows, prefix / extend lengths, input ids and positions, the
   position -> slot table per group (or a full table + LUT for a sliding-window group), the slots
   written, request ids (for attribution) and, optionally, token histories (verify-token check)
   and a token oracle (write-input assert).

5. Optionally call ``note_engine_forward()`` from the engine's own step loop (not from the hook):
   the health watchdog then notices forwards that ran without the canary.

Users read results with `violations`, `counters`, `stats`, `memory_bytes`; `close` drains the
last step and returns final stats.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from kvcanary.runtime.batch import BatchDescription, GroupSpec
from kvcanary.runtime.bracket import ForwardBracket
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.counters import LaunchCounters
from kvcanary.runtime.groups import CanaryGroup
from kvcanary.runtime.health import HealthWatchdog
from kvcanary.runtime.stats import CanaryStats, StatsReporter
from kvcanary.runtime.sweep import SweepReport, Sweeper
from kvcanary.runtime.violations import CanaryViolationError, Violation, ViolationDrain, ViolationLedger

LiveSlotsProvider = Callable[[], Mapping[str, torch.Tensor]]
KvLayers = Union[Mapping[int, tuple[torch.Tensor, torch.Tensor]], Callable[[int], tuple[torch.Tensor, torch.Tensor]]]

logger = logging.getLogger("kvcanary")


def create_canary(config: CanaryConfig, **kwargs: object) -> Optional["Canary"]:
    """A `Canary` for ``config``, or None when ``config.mode == "none"`` (nothing attached).

    ``kwargs`` are `Canary`'s: groups, max_requests, max_context, device.
    """
    if not config.enabled:
        return None
    return Canary(config, **kwargs)  # type: ignore[arg-type]


class Canary:
    """Shadow records for every KV slot of an engine, checked around each forward.

    Args:
        config: what to check and how to report (mode must not be ``none``: use `create_canary`).
        groups: one `GroupSpec` per attention group (``full``, and ``swa`` for sliding window).
        max_requests: rows of the engine's request table (row 0 = padding) — sizes the write plan.
        max_context: longest sequence the engine serves — sizes the verify plan.
        device: where the engine's KV and tables live; the canary's buffers go there too.

    Device memory (reported when it attaches, and by `memory_bytes`): per group and slot, a HEAD
    record and one TAIL record per hashed side (32 bytes each) plus 32 bytes of write-time slot
    records for the sweep; plus the verify plans and violation rings.
    """

    def __init__(
        self,
        config: CanaryConfig,
        *,
        groups: Sequence[GroupSpec],
        max_requests: int,
        max_context: int,
        device: Union[str, torch.device] = "cpu",
    ) -> None:
        if not config.enabled:
            raise ValueError("kv-canary: Canary needs mode 'log' or 'raise'; mode 'none' attaches nothing (use create_canary)")
        if not groups:
            raise ValueError("kv-canary: Canary needs at least one GroupSpec")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"kv-canary: GroupSpec names must be unique, got {names}")
        for name, value in (("max_requests", max_requests), ("max_context", max_context)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv-canary: Canary {name} must be a positive integer, got {value!r}")
        self.config = config
        self.device = torch.device(device)
        self.groups: dict[str, CanaryGroup] = {
            spec.name: CanaryGroup(spec, config=config, device=self.device) for spec in groups
        }
        self.launch_counters = LaunchCounters(self.device)
        self.ledger = ViolationLedger(config)
        self.drain = ViolationDrain(
            tags=[tag for g in self.groups.values() for tag in g.tags()],
            capacity=config.ring_capacity,
            device=self.device,
            ledger=self.ledger,
        )
        self.bracket = ForwardBracket(
            self.groups, config=config, drain=self.drain, counters=self.launch_counters,
            max_requests=max_requests, max_context=max_context,
        )
        self.sweeper = Sweeper(
            self.groups, config=config, drain=self.drain, counters=self.launch_counters, owners=self.bracket.owners
        )
        self.health = HealthWatchdog(config)
        self.stats_reporter = StatsReporter(config.stats_interval)
        self._live_slots: Optional[LiveSlotsProvider] = None
        self._depth = 0
        self._step = 0
        self._engine_forwards = 0
        self._closed = False
        logger.info("kv-canary: attached (%s): %s", config.mode, self.memory_report())

    # ---- engine-facing -------------------------------------------------------------------
    def set_kv_cache(self, group: str, layers: KvLayers, *, page_size: int = 1) -> None:
        """Register group ``group``'s K/V storage per layer (see the module docstring).

        ``layers`` maps a layer id (one of the group's ``layer_ids``) to ``(k, v)``, or is a callable
        doing so; only the layers selected by ``config.real_kv_layers`` are read.
        """
        self._group(group).set_kv_cache(layers, page_size=page_size)

    def set_live_slots_provider(self, provider: Optional[LiveSlotsProvider]) -> None:
        """Callable returning ``{group name: live slot indices}`` for the periodic sweep."""
        self._live_slots = provider

    @contextlib.contextmanager
    def forward(self, batch: BatchDescription) -> Iterator[None]:
        """Bracket one engine forward: HEAD checks on entry, TAIL checks (and maybe a sweep) on exit.

        If the body raises, TAIL is skipped, the step's violations are still drained, and the
        engine's exception propagates. Re-entrant use passes through.
        """
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.before_forward(batch)
        try:
            yield
        except BaseException:
            self._end_step(run_tail=False)
            raise
        self.after_forward()

    def before_forward(self, batch: BatchDescription) -> None:
        """Stage ``batch``, plan, HEAD verify + write. Pair with `after_forward`."""
        self._check_open()
        if self._depth:
            self._depth += 1
            return
        self._depth = 1
        self.drain.collect()  # the previous step's violations: one step late
        self._step += 1
        try:
            self.bracket.begin(batch, step=self._step)
        except BaseException:
            self._depth = 0
            raise

    def after_forward(self) -> None:
        """TAIL verify + write for the open forward, then the sweep if due, draining, reports.

        In ``raise`` mode raises `CanaryViolationError` listing this step's violations.
        """
        if self._depth == 0:
            raise RuntimeError("kv-canary: after_forward() without a matching before_forward()")
        if self._depth > 1:
            self._depth -= 1
            return
        self._end_step(run_tail=True)

    def note_engine_forward(self, count: int = 1) -> None:
        """Count forwards the engine ran, from outside the bracket (feeds the health watchdog)."""
        self._engine_forwards += count
        self.health.observe(
            engine_forwards=self._engine_forwards, canary_forwards=self._step, counters=self.launch_counters
        )

    def sweep(self, live: Optional[Mapping[str, torch.Tensor]] = None) -> SweepReport:
        """Verify every live slot now (default: from the live-slots provider); drains at once."""
        self._check_open()
        if self._depth:
            raise RuntimeError("kv-canary: sweep() inside an open forward; sweeps run between forwards")
        self.drain.collect()
        report = self.sweeper.run(self._resolve_live(live), step=self._step)
        self.drain.snapshot()
        self.drain.collect()
        self._raise_if_needed(self._step)
        return report

    # ---- user-facing ---------------------------------------------------------------------
    def violations(self) -> list[Violation]:
        """Every violation drained so far (oldest first; bounded by the ledger's keep limit)."""
        self.drain.collect()
        return self.ledger.violations()

    def counters(self) -> dict[str, object]:
        """Exact counts: total, by reason label, by launch tag name, ring overflow."""
        self.drain.collect()
        return self.ledger.counters()

    def stats(self) -> CanaryStats:
        """Forwards, slots verified / written, kernel launches, sweeps, violations, memory."""
        self.drain.collect()
        return CanaryStats.gather(
            forwards=self._step, counters=self.launch_counters, ledger=self.ledger,
            sweeper=self.sweeper, bracket=self.bracket, memory_bytes=self.memory_bytes(), health=self.health,
        )

    def memory_bytes(self) -> int:
        """Device bytes the canary allocated (buffers, slot records, plans, rings, counters)."""
        return (
            sum(g.memory_bytes() for g in self.groups.values())
            + self.bracket.memory_bytes() + self.drain.memory_bytes() + self.launch_counters.memory_bytes()
        )

    def memory_report(self) -> str:
        slots = sum(g.num_slots for g in self.groups.values())
        per_slot = sum(g.memory_bytes() for g in self.groups.values()) / max(slots, 1)
        return (
            f"{self.memory_bytes() / 2**20:.2f} MiB on {self.device} for {slots} slots in "
            f"{len(self.groups)} group(s) ({per_slot:.0f} B/slot + plans and rings)"
        )

    def close(self) -> CanaryStats:
        """Drain what is left and return the final stats. Idempotent."""
        if not self._closed:
            self.drain.collect()
            self.ledger.close()
            self._closed = True
        return CanaryStats.gather(
            forwards=self._step, counters=self.launch_counters, ledger=self.ledger,
            sweeper=self.sweeper, bracket=self.bracket, memory_bytes=self.memory_bytes(), health=self.health,
        )

    def __enter__(self) -> "Canary":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def step(self) -> int:
        """Forwards bracketed so far."""
        return self._step

    # ---- internals -----------------------------------------------------------------------
    def _end_step(self, *, run_tail: bool) -> None:
        step = self._step
        try:
            if run_tail:
                self.bracket.finish()
                if self.sweeper.due(step) and self._live_slots is not None:
                    self.sweeper.run(self._resolve_live(None), step=step)
            else:
                self.bracket.abandon()
            self.drain.snapshot()
            if self.device.type != "cuda" or self.config.mode == "raise":
                self.drain.collect()
        finally:
            self._depth = 0
        self.health.observe(
            engine_forwards=max(self._engine_forwards, step), canary_forwards=step, counters=self.launch_counters
        )
        self.stats_reporter.maybe_report(step, self.stats)
        self._raise_if_needed(step)

    def _raise_if_needed(self, step: int) -> None:
        if self.config.mode != "raise":
            return
        found = self.ledger.take_unraised()
        if found:
            raise CanaryViolationError(found, step=step)

    def _resolve_live(self, live: Optional[Mapping[str, torch.Tensor]]) -> Mapping[str, torch.Tensor]:
        if live is None:
            if self._live_slots is None:
                raise ValueError("kv-canary: sweep() needs live slots: pass them or call set_live_slots_provider()")
            live = self._live_slots()
        unknown = set(live) - set(self.groups)
        if unknown:
            raise ValueError(f"kv-canary: live slots for unknown group(s) {sorted(unknown)}; groups are {sorted(self.groups)}")
        return live

    def _group(self, name: str) -> CanaryGroup:
        try:
            return self.groups[name]
        except KeyError:
            raise ValueError(f"kv-canary: no group {name!r}; groups are {sorted(self.groups)}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("kv-canary: this Canary is closed")
