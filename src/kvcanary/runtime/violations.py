"""Violations: the device rings the ops append to, draining them, and reporting what they hold.

* `ViolationDrain` owns one ring per launch tag (``int64 [capacity, 8]``) and one write index per
  tag. At the end of a step it snapshots the write indices (an asynchronous copy on a GPU); the
  snapshot is read and the rows decoded at the start of the next step (one step late, never
  blocking the forward) — or at once on the CPU and in ``raise`` mode. Draining resets the
  indices, so each step starts with empty rings.
* `Violation` is one decoded row with its attribution (request id and row, step, forward kind).
* `ViolationLedger` counts (per reason bit, per tag, ring overflow — exact even when a ring is
  full, because tag counts come from the write index) and reports: one stable log line per
  violation, a readable block for the first few of a step, JSON lines, and the query API.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

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
from kvcanary.runtime.config import CanaryConfig

logger = logging.getLogger("kvcanary")

WRITE_BITS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH
MAX_KEPT_VIOLATIONS = 100_000

REASON_MEANING = {
    FailReason.VERIFY_CHAIN_HASH_MISMATCH: "the slot's chain link does not match its predecessor's record "
    "(the slot holds another sequence's KV, or its predecessor was overwritten)",
    FailReason.VERIFY_POSITION_MISMATCH: "the slot holds KV for another position than the one the table maps to it",
    FailReason.VERIFY_REAL_KV_HASH_MISMATCH: "the K/V bytes changed after they were written",
    FailReason.WRITE_TOKEN_MISMATCH: "the engine wrote a token other than the oracle's",
    FailReason.WRITE_POSITION_MISMATCH: "the engine wrote a position that does not continue its sequence",
    FailReason.VERIFY_TOKEN_MISMATCH: "the slot's token differs from the request's token history",
}


def _hex(x: Optional[int]) -> str:
    return "-" if x is None else f"0x{x & (2**64 - 1):016x}"


@dataclass(frozen=True, kw_only=True)
class Violation:
    """One canary mismatch, decoded and attributed.

    op: ``verify`` or ``write`` (which launch recorded it). stored_position: the slot's stored
    position (verify) or the position being written (write); expected_position: what the table / sequence called for (None when
    unknown). stored_token / expected_token: expected_token is None when no token was expected.
    stored_hash: the stored prev_hash (verify) or the chain value written (write); expected_hash:
    the predecessor's chain value (verify only). request_id / request_row: the request that read or
    wrote the slot (HEAD/TAIL), or the slot's last writer (SWEEP); None when unknown.
    """

    launch_tag: CanaryLaunchTag
    group: str
    op: str
    slot: int
    stored_position: int
    expected_position: Optional[int]
    stored_token: int
    expected_token: Optional[int]
    stored_hash: int
    expected_hash: Optional[int]
    reasons: FailReason
    request_id: Optional[str]
    request_row: Optional[int]
    step: int
    forward_kind: str

    @property
    def position(self) -> int:
        return self.stored_position

    @property
    def reason_label(self) -> str:
        return self.reasons.label

    @property
    def phase(self) -> str:
        return self.launch_tag.phase

    def log_line(self) -> str:
        """The stable one-line form (``kv_canary violation: launch_tag=... fail_reason=...``)."""
        exp_tok = "-" if self.expected_token is None else self.expected_token
        exp_pos = "-" if self.expected_position is None else self.expected_position
        return (
            f"kv_canary violation: launch_tag={self.launch_tag.name} fail_reason={self.reason_label} "
            f"slot_idx={self.slot} position={self.position} expected_position={exp_pos} "
            f"stored_token={self.stored_token} expected_token={exp_tok} "
            f"stored_hash={_hex(self.stored_hash)} expected_hash={_hex(self.expected_hash)} "
            f"group={self.group} op={self.op} request_id={self.request_id if self.request_id is not None else '-'} "
            f"request_row={self.request_row if self.request_row is not None else '-'} "
            f"step={self.step} forward_kind={self.forward_kind}"
        )

    def readable(self) -> str:
        """A multi-line block for people."""
        who = "unknown request" if self.request_id is None else f"request {self.request_id!r}"
        if self.request_row is not None:
            who += f" (row {self.request_row})"
        lines = [
            f"kv-canary: {self.reason_label} at step {self.step} ({self.forward_kind}), {who}",
            f"  where:    group {self.group!r}, slot {self.slot}, {self.launch_tag.name} {self.op}",
            f"  position: {self.position}" + ("" if self.expected_position is None else f", expected {self.expected_position}"),
            f"  token:    {self.stored_token}" + ("" if self.expected_token is None else f", expected {self.expected_token}"),
            f"  chain:    {_hex(self.stored_hash)}" + ("" if self.expected_hash is None else f", expected {_hex(self.expected_hash)}"),
        ]
        lines += [f"  meaning:  {REASON_MEANING[bit]}" for bit in FailReason if self.reasons & bit]
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = asdict(self)
        d["launch_tag"] = self.launch_tag.name
        d["reasons"] = int(self.reasons)
        d["fail_reason"] = self.reason_label
        d["stored_hash"] = _hex(self.stored_hash)
        d["expected_hash"] = None if self.expected_hash is None else _hex(self.expected_hash)
        return d


class CanaryViolationError(RuntimeError):
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


@dataclass(frozen=True)
class Attribution:
    request_id: Optional[str]
    request_row: Optional[int]
    expected_position: Optional[int]
    step: int
    forward_kind: str


class AttributionSource(Protocol):
    """Something that launched under some tags and can say whose slot a violation row is about."""

    def attribute(self, *, tag: CanaryLaunchTag, op: str, rows: list[list[int]]) -> list[Attribution]: ...


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
        """One drain's worth: exact per-tag counts, rows lost to full rings, decoded rows."""
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


class ViolationDrain:
    """Per-tag device rings + write indices; snapshot at step end, collect one step late."""

    def __init__(self, *, tags: Sequence[CanaryLaunchTag], capacity: int, device: torch.device, ledger: ViolationLedger) -> None:
        self.tags = sorted(set(tags))
        self._index = {tag: i for i, tag in enumerate(self.tags)}
        self.capacity = capacity
        self.device = device
        self.ledger = ledger
        self.rings = torch.zeros(len(self.tags), capacity, VIOLATION_FIELDS, dtype=torch.int64, device=device)
        self.write_index = torch.zeros(len(self.tags), dtype=torch.int32, device=device)
        self._sources: dict[CanaryLaunchTag, AttributionSource] = {}
        self._pending: Optional[tuple[torch.Tensor, Optional[torch.cuda.Event]]] = None
        self._host_index = (
            torch.zeros(len(self.tags), dtype=torch.int32).pin_memory() if device.type == "cuda" else None
        )

    def ring_for(self, tag: CanaryLaunchTag) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ring [capacity, 8], write_index [1])`` views for launches under ``tag``."""
        i = self._index[tag]
        return self.rings[i], self.write_index[i : i + 1]

    def register(self, tags: Sequence[CanaryLaunchTag], source: AttributionSource) -> None:
        """Rows under ``tags`` drained from now on are attributed by ``source``."""
        for tag in tags:
            self._sources[tag] = source

    def snapshot(self) -> None:
        """Capture the write indices after a step's launches (asynchronously on a GPU)."""
        if self._host_index is not None:
            self._host_index.copy_(self.write_index, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (self._host_index, event)
        else:
            self._pending = (self.write_index.clone(), None)

    def collect(self) -> list[Violation]:
        """Decode the snapshot's rows, hand them to the ledger, reset the rings. No-op without one."""
        if self._pending is None:
            return []
        host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        counts = host.tolist()
        if not any(counts):
            return []
        rows_by_tag = {}
        for tag, n in zip(self.tags, counts):
            if n:
                rows_by_tag[tag] = self.rings[self._index[tag], : min(n, self.capacity)].cpu().tolist()
        self.write_index.zero_()
        violations: list[Violation] = []
        for tag, rows in rows_by_tag.items():
            violations.extend(self._decode(tag, rows))
        violations.sort(key=lambda v: (v.step, v.launch_tag.phase != "head", v.launch_tag.phase == "sweep"))
        dropped = sum(max(0, n - self.capacity) for n in counts)
        self.ledger.record(
            counts={tag: n for tag, n in zip(self.tags, counts) if n}, dropped=dropped, violations=violations
        )
        return violations

    def _decode(self, tag: CanaryLaunchTag, rows: list[list[int]]) -> list[Violation]:
        out = []
        source = self._sources.get(tag)
        by_op: dict[str, list[list[int]]] = {"verify": [], "write": []}
        for row in rows:
            by_op["write" if row[VIOLATION_FIELD_FAIL_REASON_BITS] & WRITE_BITS else "verify"].append(row)
        for op, op_rows in by_op.items():
            if not op_rows:
                continue
            attrs = (
                source.attribute(tag=tag, op=op, rows=op_rows)
                if source is not None
                else [Attribution(None, None, None, -1, "unknown")] * len(op_rows)
            )
            for row, at in zip(op_rows, attrs):
                expected_token = row[VIOLATION_FIELD_EXPECTED_TOKEN]
                is_write = op == "write"
                out.append(
                    Violation(
                        launch_tag=tag,
                        group=tag.group,
                        op=op,
                        slot=row[VIOLATION_FIELD_SLOT_IDX],
                        stored_position=row[VIOLATION_FIELD_POSITION],
                        expected_position=row[VIOLATION_FIELD_EXPECTED_AUX] if is_write else at.expected_position,
                        stored_token=row[VIOLATION_FIELD_STORED_TOKEN],
                        expected_token=None if expected_token == -1 else expected_token,
                        stored_hash=row[VIOLATION_FIELD_STORED_CHAIN_HASH] & (2**64 - 1),
                        expected_hash=None if is_write else row[VIOLATION_FIELD_EXPECTED_AUX] & (2**64 - 1),
                        reasons=FailReason(row[VIOLATION_FIELD_FAIL_REASON_BITS]),
                        request_id=at.request_id,
                        request_row=at.request_row,
                        step=at.step,
                        forward_kind=at.forward_kind,
                    )
                )
        return out

    def memory_bytes(self) -> int:
        return self.rings.numel() * 8 + self.write_index.numel() * 4
