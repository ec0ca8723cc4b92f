"""`CanaryStats`: what the canary has done so far, and the periodic stats line."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

from kvcanary.runtime.counters import CounterSnapshot, LaunchCounters
from kvcanary.runtime.sweep import SweepReport

logger = logging.getLogger("kvcanary")


@dataclass(frozen=True)
class CanaryStats:
    """forwards: steps bracketed. slots_verified / slots_written: per phase (head, tail, sweep).
    kernel_launches: verify + write launches. violations: total and by reason label.
    sweeps: explicit full sweeps plus completed rotating passes; last_sweep_*: the last explicit sweep's
    live, verified and unrecorded slots (else the last rotating pass's). sweep_passes: rotating passes completed (live / verified slots of
    the last pass per group in ``last_pass``). capacity_growths: static buffers grown for batches beyond
    the configured limits. plans_disabled: verify plans that exceeded their capacity (those verifies did not
    run). sweep_stale: sweep rows discarded because their slot left the live set during the pass.
    write_assert_skipped: forwards whose write-input assert had no oracle. engine_forwards: forwards the engine
    ran (`Canary.engine_forwards`); unchecked_forwards: of those, forwards that ran without the canary; state:
    ``checking``, ``eager_fallback`` or ``suspended: <cause>``. jitter_stalls / jitter_cycles: HEAD / TAIL entries the
    timing jitter stalled and the SM clock cycles it drew for them (0 with jitter off; docs/design.md §4.9).
    checked_forwards: forwards whose HEAD checks ran on the device (`Canary.checked_forwards`)."""

    forwards: int
    slots_verified: dict[str, int]
    slots_written: dict[str, int]
    kernel_launches: int
    violations: int
    violations_by_reason: dict[str, int]
    ring_overflow: int
    sweeps: int
    last_sweep_live: dict[str, int] = field(default_factory=dict)
    last_sweep_verified: dict[str, int] = field(default_factory=dict)
    last_sweep_unrecorded: dict[str, int] = field(default_factory=dict)
    sweep_passes: int = 0
    last_pass: dict[str, dict[str, int]] = field(default_factory=dict)
    capacity_growths: int = 0
    plans_disabled: int = 0
    sweep_stale: int = 0
    write_assert_skipped: int = 0
    health_stalls: int = 0
    memory_bytes: int = 0
    engine_forwards: int = 0
    unchecked_forwards: int = 0
    state: str = "checking"
    jitter_stalls: int = 0
    jitter_cycles: int = 0
    checked_forwards: int = 0

    @classmethod
    def gather(cls, *, forwards, counters: LaunchCounters | CounterSnapshot, ledger, sweeper, capacity_growths: int,
               write_assert_skipped: int, plans_disabled: int, memory_bytes: int, health=None,
               sweep_stale: int = 0, engine_forwards: int = 0, unchecked_forwards: int = 0,
               state: str = "checking", passes: bool = True, head_tag: Optional[int] = None,
               head_launches: int = 1) -> "CanaryStats":
        """``counters``: the device counters (read now: a sync) or a snapshot read back earlier; ``passes=False``
        leaves the rotating passes' per-group figures out (reading them is a device read); ``head_tag``: the launch
        tag whose verify launches count checked forwards, ``head_launches`` of them per forward (one per group of
        that tag's kind)."""
        snap = counters if isinstance(counters, CounterSnapshot) else counters.snapshot()
        last = sweeper.last
        passes = sweeper.pass_report() if passes and sweeper.passes else {}
        if last is None and passes:  # no explicit sweep yet: the last rotating pass
            last = SweepReport(
                step=forwards, live={g: p["live"] for g, p in passes.items()},
                verified={g: p["verified"] for g, p in passes.items()},
                unrecorded={g: p["live"] - p["verified"] for g, p in passes.items()},
            )
        return cls(
            forwards=forwards,
            slots_verified={p: snap.slots_verified(p) for p in ("head", "tail", "sweep")},
            slots_written={p: snap.slots_written(p) for p in ("head", "tail")},
            kernel_launches=snap.kernel_launches,
            violations=ledger.total,
            violations_by_reason=dict(ledger.by_reason),
            ring_overflow=ledger.ring_overflow,
            sweeps=sweeper.sweeps + sweeper.passes,
            sweep_passes=sweeper.passes,
            last_pass=passes,
            last_sweep_live=dict(last.live) if last else {},
            last_sweep_verified=dict(last.verified) if last else {},
            last_sweep_unrecorded=dict(last.unrecorded) if last else {},
            capacity_growths=capacity_growths,
            plans_disabled=plans_disabled,
            sweep_stale=sweep_stale,
            write_assert_skipped=write_assert_skipped,
            health_stalls=health.stalls if health is not None else 0,
            memory_bytes=memory_bytes,
            engine_forwards=engine_forwards,
            unchecked_forwards=unchecked_forwards,
            state=state,
            jitter_stalls=snap.jitter_stalls,
            jitter_cycles=snap.jitter_cycles,
            checked_forwards=snap.verify_kernels[head_tag] // max(1, head_launches) if head_tag is not None else 0,
        )

    def line(self) -> str:
        reasons = ",".join(f"{k}={v}" for k, v in sorted(self.violations_by_reason.items())) or "-"
        return (
            f"kv_canary stats: forwards={self.forwards} verified={sum(self.slots_verified.values())} "
            f"written={sum(self.slots_written.values())} launches={self.kernel_launches} sweeps={self.sweeps} "
            f"violations={self.violations} by_reason={reasons} ring_overflow={self.ring_overflow} "
            f"engine_forwards={self.engine_forwards} unchecked_forwards={self.unchecked_forwards} state={self.state}"
            + (f" jitter_stalls={self.jitter_stalls} jitter_cycles={self.jitter_cycles}" if self.jitter_stalls else "")
        )


class StatsReporter:
    """Logs `CanaryStats.line` every ``interval`` forwards (0 = never)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def maybe_report(self, step: int, stats: Callable[[], CanaryStats]) -> Optional[CanaryStats]:
        if self.interval <= 0 or step % self.interval:
            return None
        s = stats()
        logger.info(s.line())
        return s
