"""`HealthWatchdog`: notices a canary that stopped running.

Every ``health_interval`` forwards it looks at the device launch counters (as last read back by the
drain's non-blocking snapshots — no wait on the forward path; they may trail by a step or two). If
forwards happened since the last check but no canary kernel ran — the bracket is bypassed, a CUDA
graph replays without the canary, a hook was removed — it says so once per stall: a warning in
``log`` mode, `CanaryHealthError` in ``raise`` mode. It re-arms when the counters move again.
"""
from __future__ import annotations

import logging

from kvcanary.errors import KvCanaryRuntimeError
from kvcanary.runtime.config import CanaryConfig

logger = logging.getLogger("kvcanary")


class CanaryHealthError(KvCanaryRuntimeError):
    """The canary stopped running while the engine kept serving (mode ``raise``)."""


class HealthWatchdog:
    def __init__(self, config: CanaryConfig) -> None:
        self.interval = config.health_interval
        self.mode = config.mode
        self.stalls = 0
        self._last_forwards = 0
        self._last_launches = 0
        self._next_check = self.interval
        self._stalled = False

    def due(self, engine_forwards: int) -> bool:
        """Whether `observe` would check at ``engine_forwards`` (lets the caller skip gathering ``launches``)."""
        return 0 < self.interval and engine_forwards >= self._next_check

    def observe(self, *, engine_forwards: int, canary_forwards: int, launches: int) -> None:
        """Check, if ``engine_forwards`` reached the next interval; ``launches``: kernel launches so far."""
        if not self.due(engine_forwards):
            return
        self._next_check = engine_forwards + self.interval
        forwards_delta = engine_forwards - self._last_forwards
        moved = launches != self._last_launches
        self._last_forwards, self._last_launches = engine_forwards, launches
        if moved or forwards_delta == 0:
            self._stalled = False
            return
        if self._stalled:
            return
        self._stalled = True
        self.stalls += 1
        message = (
            f"kv-canary: health: the canary stopped running — {forwards_delta} forward(s) since the last check "
            f"(engine forwards {engine_forwards}, bracketed {canary_forwards}) and no canary kernel launched"
        )
        if self.mode == "raise":
            raise CanaryHealthError(message)
        logger.warning(message)
