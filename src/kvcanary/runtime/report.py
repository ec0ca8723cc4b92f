"""Reporting: the ledger of attributed violations — exact counters, log lines, JSON lines, sinks, raise.

Counts per launch tag come from the rings' write indices (exact even when a ring is full); counts per
reason from the rows kept. Every kept violation is counted, kept (up to a bound), handed to the sinks and
written as one JSON object to ``jsonl_path`` when set. The *log* is rate-limited so an incident stays
readable: one stable line per violation (``kv_canary violation: launch_tag=... fail_reason=...``) for the first
``log_lines_per_slot`` rows of each (reason, group, slot), at WARNING (ERROR in ``raise`` mode), and one
``kv_canary summary`` line per drain (counts by reason and by request, lines suppressed). At DEBUG also: a
``kv_canary first-seen`` marker the first time a (group, slot) is reported and a readable block (with what the
reason means) for the first ``readable_per_step`` logged rows of a drain. A sink that fails (a JSON-lines file that cannot be
written, a callable that raises) is reported once, counted in ``sink_errors`` and dropped in ``log`` mode;
reporting goes on.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Callable, Sequence

from kvcanary.errors import KvCanaryRuntimeError
from kvcanary.runtime.attribution import Violation
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.drain import RingKey
from kvcanary.runtime.reads import reason_labels

logger = logging.getLogger("kvcanary")

MAX_KEPT_VIOLATIONS = 100_000


class CanaryViolationError(KvCanaryRuntimeError):
    """Raised at the end of a step (mode ``raise``) that found violations; ``.violations`` lists them."""

    def __init__(self, violations: Sequence[Violation], *, step: int, elsewhere: int = 0) -> None:
        self.violations = list(violations)
        self.step = step
        # `Canary.raise_with` / `runtime.fail_together`: violations the group's ranks found this step, all ranks
        self.elsewhere = elsewhere
        if not self.violations and elsewhere:
            super().__init__(f"kv-canary: 0 violations on this rank by step {step}; the ranks of its group found "
                             f"{elsewhere} (raised together: Canary.raise_with or runtime.fail_together)")
            return
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
        self.lines_per_slot = config.log_lines_per_slot
        self._lines: Counter[tuple[str, str, int]] = Counter()  # (reason, group, slot) -> lines logged
        self._seen: set[tuple[str, int]] = set()
        self.suppressed_lines = 0
        self.sink_errors = 0
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

    def record(self, *, counts: dict[RingKey, int], dropped: int, violations: list[Violation]) -> None:
        """One drain's worth: exact counts per ring (group, tag; ``by_tag`` sums a tag over the groups of its kind),
        rows lost to full rings, attributed rows."""
        for (_, tag), n in counts.items():
            self.by_tag[tag.name] += n
            self.total += n
        self.ring_overflow += dropped
        if dropped:
            logger.warning(
                "kv-canary: %d violation row(s) did not fit the rings (ring_capacity); counted by tag, reasons unknown",
                dropped,
            )
        level = logging.ERROR if self.mode == "raise" else logging.WARNING
        suppressed = 0
        for i, v in enumerate(violations):
            for label in reason_labels(int(v.reasons)):
                self.by_reason[label] += 1
            if (v.group, v.slot) not in self._seen:
                self._seen.add((v.group, v.slot))
                logger.debug("kv_canary first-seen: group=%s slot_idx=%d step=%d fail_reason=%s request_id=%s",
                             v.group, v.slot, v.step, v.reason_label, v.request_id if v.request_id is not None else "-")
            key = (v.reason_label, v.group, v.slot)
            self._lines[key] += 1
            if self._lines[key] <= self.lines_per_slot:
                logger.log(level, v.log_line())
                if i < self.readable_per_step:
                    logger.debug(v.readable())
            else:
                suppressed += 1
            if len(self._kept) < MAX_KEPT_VIOLATIONS:
                self._kept.append(v)
            self._unraised.append(v)
            self._to_sinks(v)
        self.suppressed_lines += suppressed
        if violations:
            self._summary(level, violations, suppressed)
        if self._jsonl is not None:
            try:
                self._jsonl.flush()
            except OSError as exc:
                self._sink_failed("jsonl", exc)

    def _summary(self, level: int, violations: list[Violation], suppressed: int) -> None:
        reasons = Counter(v.reason_label for v in violations)
        requests = Counter(v.request_id if v.request_id is not None else "-" for v in violations)
        steps = (min(v.step for v in violations), max(v.step for v in violations))
        logger.log(
            level, "kv_canary summary: steps=%d..%d violations=%d by_reason=%s by_request=%s suppressed_lines=%d",
            steps[0], steps[1], len(violations), ",".join(f"{k}={n}" for k, n in sorted(reasons.items())),
            ",".join(f"{k}={n}" for k, n in requests.most_common(8)) + (",..." if len(requests) > 8 else ""),
            suppressed,
        )

    def _to_sinks(self, v: Violation) -> None:
        if self.jsonl_path is not None:
            try:
                if self._jsonl is None:
                    self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
                self._jsonl.write(json.dumps(v.to_json()) + "\n")
            except OSError as exc:
                self._sink_failed("jsonl", exc)
        for sink in list(self._sinks):
            try:
                sink(v)
            except Exception as exc:  # a user's callable: log mode reports it once and keeps serving
                self._sink_failed(sink, exc)

    def _sink_failed(self, sink, exc: Exception) -> None:
        if self.mode == "raise":
            raise exc
        self.sink_errors += 1
        if sink == "jsonl":
            logger.error("kv-canary: cannot write violations to jsonl_path=%r (%s); JSON-lines output stops, "
                         "counting and logging go on", self.jsonl_path, exc)
            self.jsonl_path = None
            self._jsonl = None
        else:
            logger.error("kv-canary: violation sink %r raised %r; it is dropped, reporting goes on", sink, exc)
            self._sinks.remove(sink)

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
            "suppressed_lines": self.suppressed_lines,
            "sink_errors": self.sink_errors,
        }

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
