"""Fail together: the ranks of a tensor-parallel group agree, once per step, whether any of them found a violation
(docs/design.md §4.6), so that in ``raise`` mode they all raise in the same step instead of one rank stopping and
the others hanging in their next collective.

Each rank keeps its own canary over its own KV shard. At the end of a step every rank calls `FailTogether.agree`
with what it found; one ``all_reduce`` (SUM) of one int64 pair — (violations found, rank failed) — tells every rank
the group's totals. A CPU tensor on a gloo group (or any group whose backend reduces CPU tensors), a CUDA tensor on
the current device for an NCCL-only group. Nothing else is exchanged; the cost is one small collective per step,
and it is a host synchronisation (``raise`` mode waits at the end of each step anyway).

Two ways to use it:

* inside the runtime: `Canary.raise_with(group)` (the same all-reduce; its ``_raise_if_needed`` can delegate to
  `FailTogether.agree`);
* around the runtime, from an adapter or a test, without touching the `Canary`: `raise_together` runs the end of a
  step (``canary.after_forward``, ``canary.end_step``, ``canary.sweep``, or a whole ``with canary.forward(...)``
  block) and turns "this rank raised" / "another rank raised" into the same exception on every rank. Use one of the
  two, not both (each would reduce once per step).

Every rank of the group must call it for the same steps, as for any collective: a rank that stops calling (its
process died, its canary is closed) leaves the others waiting in the all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, TypeVar, Union

import torch

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryValueError
from kvcanary.runtime.report import CanaryViolationError

T = TypeVar("T")


@dataclass(frozen=True)
class Verdict:
    """The group's totals for one step: violations found on all ranks, ranks whose step failed otherwise."""

    violations: int
    failed_ranks: int

    @property
    def any(self) -> bool:
        """True when some rank found a violation or failed: every rank should raise."""
        return self.violations > 0 or self.failed_ranks > 0


class FailTogether:
    """One process group's per-step agreement (module docstring).

    group: a ``torch.distributed`` process group, or None for the default group (``init_process_group`` must have
        run before the first `agree`).
    device: where the reduced tensor lives; default: the CPU when the group's backend reduces CPU tensors (gloo,
        or a ``cpu:gloo,cuda:nccl`` group), else (NCCL) the current CUDA device.
    """

    def __init__(self, group=None, *, device: Optional[Union[str, torch.device]] = None) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            raise KvCanaryValueError("kv-canary: FailTogether needs torch.distributed, which this torch build lacks")
        self.group = group
        self._device = torch.device(device) if device is not None else None
        self.steps = 0  # agreements made

    @property
    def device(self) -> torch.device:
        if self._device is None:
            self._device = _reduce_device(self.group)
        return self._device

    def agree(self, violations: int, *, failed: bool = False) -> Verdict:
        """One all-reduce: this rank found ``violations`` (>= 0) and its step ``failed`` (an error other than a
        violation); returns the group's totals. Every rank must call it once per step."""
        import torch.distributed as dist

        if isinstance(violations, bool) or not isinstance(violations, int) or violations < 0:
            raise KvCanaryValueError(f"kv-canary: FailTogether.agree violations must be an integer >= 0, got {violations!r}")
        flags = torch.tensor([violations, int(bool(failed))], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group)
        total, failed_ranks = (int(x) for x in flags.tolist())
        self.steps += 1
        return Verdict(violations=total, failed_ranks=failed_ranks)


def raise_together(together: FailTogether, run: Callable[[], T], *, step: Union[int, Callable[[], int]]) -> T:
    """Run ``run`` (the end of one step on this rank), agree with the group, and raise on every rank when any rank
    found a violation or failed; else return ``run``'s result.

    ``step``: the step number to report (an int, or a callable read after ``run``, e.g. ``lambda: canary.step``).
    A rank whose ``run`` raised `CanaryViolationError` re-raises it with ``elsewhere`` set to the group's total; a
    rank whose ``run`` raised anything else re-raises that error (after the agreement, so the others are not left
    waiting); a rank that found nothing raises `CanaryViolationError` with no violations of its own and
    ``elsewhere`` = the group's total, or, when only failures were reported, a ``kv-canary:`` `KvCanaryRuntimeError`.
    An exception that is not an ``Exception`` (``KeyboardInterrupt``) propagates at once, without agreeing."""
    own: Optional[Exception] = None
    result = None
    try:
        result = run()
    except Exception as exc:  # noqa: BLE001 — reported to the group, then re-raised below
        own = exc
    found = len(own.violations) if isinstance(own, CanaryViolationError) else 0
    failed = own is not None and not isinstance(own, CanaryViolationError)
    verdict = together.agree(found, failed=failed)
    at = own.step if isinstance(own, CanaryViolationError) else (step() if callable(step) else step)
    if failed:
        raise own  # type: ignore[misc]
    if isinstance(own, CanaryViolationError):
        raise CanaryViolationError(own.violations, step=at, elsewhere=verdict.violations) from own
    if verdict.violations:
        raise CanaryViolationError([], step=at, elsewhere=verdict.violations)
    if verdict.failed_ranks:
        raise KvCanaryRuntimeError(f"kv-canary: {verdict.failed_ranks} rank(s) of the group failed in step {at} "
                                   "(raised together)")
    return result  # type: ignore[return-value]


def _reduce_device(group) -> torch.device:
    """CPU when the group's backend reduces CPU tensors, else the current CUDA device (NCCL)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
