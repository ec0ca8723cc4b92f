"""Detection accounting: match each ledger entry to the violations the canary reported.

A violation *relates* to an injection when it comes at or after the injection's step and before
``until_step`` (the end of its detection window) and names the injected slot (same group) or is
charged to the injected request. The injection is *detected* when a related violation carries one of
its expected reasons; latency is counted in forwards from the injection's step. ``detected_by`` names
the checks (chain, position, token, fingerprint, write_input) whose reasons the first detecting
forward reported; ``collateral`` the reasons seen in the window that the injection did not expect.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from kvcanary.faults.ledger import CHECK_OF_REASON, Injection


@dataclass(frozen=True, kw_only=True)
class Outcome:
    injection: Injection
    detected: bool
    latency_forwards: Optional[int]
    detected_by: tuple[str, ...]
    reasons: tuple[str, ...]
    request_id: Optional[str]
    collateral: tuple[str, ...]
    violations_in_window: int


def _labels(v) -> set[str]:
    return set(v.reason_label.split("+"))


def account(injection: Injection, violations: Sequence, *, until_step: Optional[int] = None) -> Outcome:
    """The `Outcome` of one injection given every violation of its run."""
    window = [v for v in violations if v.step >= injection.step and (until_step is None or v.step < until_step)]
    expected = set(injection.expected)

    def related(v) -> bool:
        on_slot = injection.slot >= 0 and v.slot == injection.slot and v.group == injection.group
        return on_slot or (injection.request_id is not None and v.request_id == injection.request_id)

    hits = [v for v in window if related(v) and _labels(v) & expected]
    collateral = sorted({lab for v in window for lab in _labels(v)} - expected)
    if not hits:
        return Outcome(injection=injection, detected=False, latency_forwards=None, detected_by=(), reasons=(),
                       request_id=None, collateral=tuple(collateral), violations_in_window=len(window))
    first = min(v.step for v in hits)
    at_first = [v for v in hits if v.step == first]
    best = min(at_first, key=lambda v: v.request_id != injection.request_id)
    labels = sorted({lab for v in at_first for lab in _labels(v)})
    return Outcome(
        injection=injection, detected=True, latency_forwards=first - injection.step,
        detected_by=tuple(sorted({CHECK_OF_REASON.get(lab, lab) for lab in labels})), reasons=tuple(labels),
        request_id=best.request_id, collateral=tuple(collateral), violations_in_window=len(window),
    )


def summarize(outcomes: Iterable[Outcome], key: Optional[Callable[[Outcome], str]] = None) -> dict:
    """Per fault class: injected, detected, missed, expected_detectable, detected_expected (detected among
    the expected-detectable ones), median_latency_forwards, collateral_reasons, detected_by (check -> count)."""
    out: dict = {}
    for o in outcomes:
        c = out.setdefault(key(o) if key else o.injection.fault, {
            "injected": 0, "detected": 0, "missed": 0, "expected_detectable": 0, "detected_expected": 0,
            "wrong_request": 0, "_lat": [], "collateral_reasons": {}, "detected_by": {}, "why_not": [],
        })
        c["injected"] += 1
        c["expected_detectable"] += o.injection.expected_detectable
        if o.detected:
            c["detected"] += 1
            c["detected_expected"] += o.injection.expected_detectable
            c["wrong_request"] += o.injection.request_id is not None and o.request_id != o.injection.request_id
            c["_lat"].append(o.latency_forwards)
            for check in o.detected_by:
                c["detected_by"][check] = c["detected_by"].get(check, 0) + 1
        else:
            c["missed"] += 1
        for lab in o.collateral:
            c["collateral_reasons"][lab] = c["collateral_reasons"].get(lab, 0) + 1
        if o.injection.why_not and o.injection.why_not not in c["why_not"]:
            c["why_not"].append(o.injection.why_not)
    for c in out.values():
        lat = c.pop("_lat")
        c["median_latency_forwards"] = statistics.median(lat) if lat else None
    return out
