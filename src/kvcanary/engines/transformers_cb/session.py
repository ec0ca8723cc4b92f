"""The state the transformers adapter keeps per engine session (one ``PagedAttentionCache``): `_Session` (its
canary and where the engine's current step stands), `_Suspended` (a cache whose forwards run unchecked after a
canary error in ``log`` mode) and `_SessionResult` (what a closed session leaves readable; `session_result` builds
one, `merge_counters` sums them over sessions)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvcanary.engines.transformers_cb.forward_view import ForwardTranslator, StaticKwargs, StepInfo
from kvcanary.engines.transformers_cb.moves import MoveObserver
from kvcanary.runtime import Canary

# where the current engine step stands (`_Session.phase`)
IDLE, HOOK_STEP, WRAPPED_STEP, DEFERRED_END = "idle", "hook", "wrapped", "deferred"

# why a forward ran unchecked (`TransformersCbHandle.counters()["unchecked_by_cause"]`)
CAUSE_CAPACITY, CAUSE_INTERNAL, CAUSE_PLAIN = "capacity", "internal", "plain_forward"


@dataclass
class _Session:
    """The canary of one PagedAttentionCache, and where the engine's current step stands."""

    cache: object
    processor: object
    canary: Canary
    translator: ForwardTranslator
    graphs: bool  # the processor captures CUDA graphs: the compute_batch wrapper drives the steps
    canary_graphs_due: bool = False  # eager engine on CUDA: capture the canary's own work after one forward
    sweep_graph_due: bool = False  # graph mode on CUDA: capture the sweep slice alone once a step has swept
    statics: Optional[StaticKwargs] = None  # eager engine: fixed-shape copies of the kwargs (translation graph)
    translation: Optional[object] = None  # CUDA graph of describe + stage over ``statics``
    phase: str = IDLE
    head_open: bool = False  # launch_head ran (eagerly or into a capture) and launch_tail is due
    step: Optional[StepInfo] = None
    engine_forwards: int = 0  # forwards the engine ran (eager, captured-then-run, replayed; warmup included)
    warmup_forwards: int = 0  # of which the runner's warmup (fake requests over never-written KV: padding rows)
    graphs_captured: int = 0
    graphs_dropped: int = 0
    failed_in_capture: Optional[tuple[str, str]] = None  # (cause, reason): suspend once the engine's capture ends
    moves: Optional[MoveObserver] = None  # fork / CPU offload / restore wrappers (moves.py), removed at close
    manager: Optional[object] = None  # the ContinuousBatchingManager whose ``stop`` is shadowed (removed at close)
    final_swept_at: int = -1  # canary step of the full sweep run when the engine stopped (-1: none)


@dataclass(frozen=True)
class _Suspended:
    """A cache whose canary was closed after a canary error in ``log`` mode: its forwards run unchecked."""

    cache: object
    processor: object
    graphs: bool  # graph mode: a counting wrapper around compute_batch counts the forwards (replays run no hooks)
    cause: str
    reason: str = ""  # the error that suspended the session


@dataclass(frozen=True)
class _SessionResult:
    forwards: int
    stats: object
    violations: list
    counters: dict


def session_result(s: _Session) -> _SessionResult:
    """What ``s`` leaves readable: its canary's steps, stats, violations and counters, with the adapter's counts."""
    counters = dict(s.canary.counters())
    coverage = getattr(s.canary, "coverage", None)  # the runtime's account of what it skipped, when it has one
    if callable(coverage) and "coverage" not in counters:
        counters["coverage"] = dict(coverage())
    counters.update(engine_forwards=s.engine_forwards, warmup_forwards=s.warmup_forwards,
                    graphs_captured=s.graphs_captured, graphs_dropped=s.graphs_dropped)
    if s.moves is not None:
        counters["moves"] = s.moves.counts()
    return _SessionResult(forwards=s.canary.step, stats=s.canary.stats(), violations=s.canary.violations(),
                          counters=counters)


def merge_counters(parts: list[dict]) -> dict:
    """Sum per-session counters: numbers add, dicts merge recursively (e.g. ``coverage``), lists become the
    sorted union of their items (e.g. ``coverage["unhashed_groups"]``); other values are dropped."""
    out: dict = {}
    for part in parts:
        _merge_into(out, part)
    return out


def _merge_into(out: dict, part: dict) -> None:
    for key, value in part.items():
        if isinstance(value, dict):
            _merge_into(out.setdefault(key, {}), value)
        elif isinstance(value, (list, tuple, set)):
            out[key] = sorted(set(out.get(key, [])) | set(value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = out.get(key, 0) + value
