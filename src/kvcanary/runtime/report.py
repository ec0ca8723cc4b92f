"""Reporting: the ledger of attributed violations — exact counters, log lines, JSON lines, sinks, raise.

Counts per launch tag come from the rings' write indices (exact even when a ring is full); counts per
reason from the rows kept. Every kept violation gets one stable log line
(``kv_canary violation: launch_tag=... fail_reason=...``), the first few of a drain a readable block,
and one JSON object in ``jsonl_path`` when set.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Callable, Sequence

from kvcanary.errors import KvCanaryRuntimeError
from kvcanary.ops import CanaryLaunchTag, FailReason
from kvcanary.runtime.attribution import Violation
from kvcanary.runtime.config import CanaryConfig

logger = logging.getLogger("kvcanary")

MAX_KEPT_VIOLATIONS = 100_000


class CanaryViolationError(KvCanaryRuntimeError):
    """Raised at the end of a step (mode ``raise``) that found violations; ``.violations`` lists them."""

    def __init__(self, violations: Sequence[Violation], *, step: int) -> None:
        self.violations = list(violations)
        self.step = step
        shown = "\n".join(v.log_line() for v in self.violations[:20])
        more = len(self.violations) - 20
        super().__init__(
            f"kv-canary: {len(self.violations)} violation(s) by step {step}:\n{shown}"
            + (f"\n... and {more} more" if more > 0 else "")
        )


class ViolationLedger:
    """Counters, the kept violations, and the sinks (log, JSON lines, callables)."""

    def __init__(self, config: CanaryConfig) -> None:
        self.mode = config.mode
        self.readable_per_step = config.readable_per_step
        self.jsonl_path = config.jsonl_path
        self._jsonl = None
        self.by_reason: Counter[str] = Counter()
        self.by_tag: Counter[str] = Counter()
        self.total = 0
        self.ring_overflow = 0
        self._kept: list[Violation] = []
        self._unraised: list[Violation] = []
        self._sinks: list[Callable[[Violation], None]] = []

    def add_sink(self, sink: Callable[[Violation], None]) -> None:
        """Call ``sink(violation)`` for every violation drained from now on."""
        self._sinks.append(sink)

    def record(self, *, counts: dict[CanaryLaunchTag, int], dropped: int, violations: list[Violation]) -> None:
        """One drain's worth: exact per-tag counts, rows lost to full rings, attributed rows."""
        for tag, n in counts.items():
            self.by_tag[tag.name] += n
            self.total += n
        self.ring_overflow += dropped
        if dropped:
            logger.warning(
                "kv-canary: %d violation row(s) did not fit the rings (ring_capacity); counted by tag, reasons unknown",
                dropped,
            )
        level = logging.ERROR if self.mode == "raise" else logging.WARNING
        for i, v in enumerate(violations):
            for bit in FailReason:
                if v.reasons & bit:
                    self.by_reason[bit.label] += 1
            logger.log(level, v.log_line())
            if i < self.readable_per_step:
                logger.log(level, v.readable())
            if len(self._kept) < MAX_KEPT_VIOLATIONS:
                self._kept.append(v)
            self._unraised.append(v)
            if self.jsonl_path is not None:
                if self._jsonl is None:
                    self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
                self._jsonl.write(json.dumps(v.to_json()) + "\n")
            for sink in self._sinks:
                sink(v)
        if self._jsonl is not None:
            self._jsonl.flush()

    def violations(self) -> list[Violation]:
        return list(self._kept)

    def take_unraised(self) -> list[Violation]:
        found, self._unraised = self._unraised, []
        return found

    def counters(self) -> dict[str, object]:
        return {
            "total": self.total,
            "by_reason": dict(self.by_reason),
            "by_tag": dict(self.by_tag),
            "ring_overflow": self.ring_overflow,
            "kept": len(self._kept),
        }

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
