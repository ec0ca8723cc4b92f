"""Chaos injection for the fail-safe suites: one of the canary's internals raises at its k-th call.

A `ChaosPoint` names a function or method of the canary (runtime, ops as the runtime calls them, or an adapter);
`inject` replaces it (through pytest's ``monkeypatch``, so the product carries no seam) with a wrapper that raises
`ChaosError` at call ``at_call`` — ``before`` the original runs, or ``after`` it ran (its work half-done from the
caller's point of view). `pick_cases` draws seeded cases; `chaos_table` prints the results.
"""
from __future__ import annotations

import importlib
import os
import random
from dataclasses import dataclass, field
from typing import Optional


class ChaosError(RuntimeError):
    """An injected failure of the canary's own code (deliberately not a KvCanaryError)."""


@dataclass(frozen=True)
class ChaosPoint:
    """``target`` ``"module:Class.method"`` or ``"module:function"``; ``stage``: where in a step it sits."""

    name: str
    target: str
    stage: str

    def resolve(self) -> tuple[object, str]:
        module, _, path = self.target.partition(":")
        owner: object = importlib.import_module(module)
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        return owner, attr


# the runtime's internals, by stage of a step (each reached on every engine that drives a `Canary`)
RUNTIME_POINTS = (
    ChaosPoint("stage", "kvcanary.runtime.staging:StaticBatch.stage", "forward"),
    ChaosPoint("plan_op", "kvcanary.runtime.launch:launch_canary_plan_kernels", "forward"),
    ChaosPoint("head", "kvcanary.runtime.launch:ForwardLaunches.head", "forward"),
    ChaosPoint("write_op", "kvcanary.runtime.launch:launch_canary_write_kernels", "forward"),
    ChaosPoint("verify_op", "kvcanary.runtime.launch:launch_canary_verify_kernels", "forward"),
    ChaosPoint("record_write", "kvcanary.runtime.kernels:record_write", "forward"),
    ChaosPoint("tail", "kvcanary.runtime.launch:ForwardLaunches.tail", "forward"),
    ChaosPoint("sweep_slice", "kvcanary.runtime.sweep:Sweeper.slice_device", "sweep"),
    ChaosPoint("sweep_live", "kvcanary.runtime.sweep:Sweeper.refresh_live", "sweep"),
    ChaosPoint("drain", "kvcanary.runtime.drain:ViolationDrain.end_step", "drain"),
    ChaosPoint("flush", "kvcanary.runtime.drain:ViolationDrain.flush", "drain"),
)
MOVE_POINTS = (
    ChaosPoint("copy_slots", "kvcanary.runtime.moves:SlotMoves.copy_slots", "moves"),
    ChaosPoint("export", "kvcanary.runtime.moves:SlotMoves.export_records", "moves"),
    ChaosPoint("import", "kvcanary.runtime.moves:SlotMoves.import_records", "moves"),
)


@dataclass
class Injection:
    point: ChaosPoint
    at_call: int
    when: str = "before"
    calls: int = 0
    fired: bool = False

    @property
    def label(self) -> str:
        return f"{self.point.name}#{self.at_call}/{self.when}"


def inject(monkeypatch, point: ChaosPoint, *, at_call: int, when: str = "before") -> Injection:
    """Make ``point`` raise `ChaosError` at its ``at_call``-th call (1-based), ``before`` or ``after`` the original."""
    owner, attr = point.resolve()
    original = getattr(owner, attr)
    inj = Injection(point=point, at_call=at_call, when=when)

    def wrapper(*args, **kwargs):
        inj.calls += 1
        if inj.calls != inj.at_call:
            return original(*args, **kwargs)
        inj.fired = True
        if inj.when == "after":
            original(*args, **kwargs)
        raise ChaosError(f"chaos: {inj.label}")

    if isinstance(owner, type) and isinstance(owner.__dict__.get(attr), staticmethod):
        wrapper = staticmethod(wrapper)  # type: ignore[assignment]
    monkeypatch.setattr(owner, attr, wrapper)
    return inj


def pick_cases(seed: int, points, n: int, *, max_call: int, max_calls: Optional[dict] = None
               ) -> list[tuple[ChaosPoint, int, str]]:
    """``n`` seeded (point, call, before/after) cases, every point once before any repeats; the call is drawn
    from ``1..max_call`` (``max_calls[point.name]`` or ``max_calls[point.stage]`` when given: points reached
    only a few times in a run)."""
    rng = random.Random(seed)
    order = list(points)
    rng.shuffle(order)
    limits = max_calls or {}
    out = []
    for i in range(n):
        p = order[i % len(order)]
        top = limits.get(p.name, limits.get(p.stage, max_call))
        out.append((p, rng.randint(1, top), rng.choice(("before", "after"))))
    return out


@dataclass
class ChaosRow:
    engine: str
    mode: str
    case: str
    fired: bool
    same_outputs: Optional[bool]
    engine_forwards: int
    checked_forwards: int
    unchecked_forwards: int
    suspended: bool
    serves_after: bool
    notes: str = ""
    extra: dict = field(default_factory=dict)


def chaos_table(rows: list[ChaosRow]) -> str:
    """A fixed-width table of `ChaosRow`s."""
    head = ("engine", "mode", "failure", "fired", "outputs", "engine_fw", "checked", "unchecked", "suspended",
            "serves_after", "notes")
    body = [(r.engine, r.mode, r.case, "yes" if r.fired else "no",
             "-" if r.same_outputs is None else ("same" if r.same_outputs else "DIFF"), str(r.engine_forwards),
             str(r.checked_forwards), str(r.unchecked_forwards), "yes" if r.suspended else "no",
             "yes" if r.serves_after else "NO", r.notes) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def emit_table(title: str, rows: list[ChaosRow]) -> str:
    """Print the table (visible with ``-s``) and append it to ``$KVCANARY_TEST_CHAOS_TABLE`` when set."""
    text = f"{title}\n{chaos_table(rows)}\n"
    print("\n" + text)
    path = os.environ.get("KVCANARY_TEST_CHAOS_TABLE")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return text
