"""Rollback faults of speculative decoding, injected into vLLM's scheduler output (the fault connector's scheduler
side; needs no vLLM import).

After a verify forward vLLM rolls a request back by its rejected drafts: the next step's computed-token count is the
committed length, so the rejected drafts' KV is overwritten, never read. The faults hand the worker one step whose
count for one request is too high, as an engine whose rollback is skipped or off by one (the worker then computes
positions, slots and attention's lengths from it, all consistent with each other):

* ``keep_rejected_drafts`` — the count is ``r`` too high (``r``: the drafts rejected at the request's last verify
  forward): the rejected drafts' KV is read as context;
* ``rollback_off_by_one`` — the count is 1 too high (a request with ``r >= 1``): the first rejected draft is read as
  context and every position after it is one too high.

Expected: ``verify_token`` against that request in that forward (the committed token at the first rejected position
is the target model's, not the rejected draft the slot holds).
"""
from __future__ import annotations

import random
from typing import Any

ROLLBACK_FAULTS = ("keep_rejected_drafts", "rollback_off_by_one")
EXPECTED = ("verify_token", "verify_chain_hash", "verify_position", "write_position")


class RollbackSkipper:
    """Scheduler side: remembers where each request's last scheduled step ended and how many drafts it verified; fires
    each pending rollback fault (``specs``: the fault connector's, others ignored) once, at the first step past its
    ``after_forward`` that has a request rolled back by 1 or more drafts."""

    def __init__(self, specs: list[dict[str, Any]]) -> None:
        self.pending = [(k, s) for k, s in enumerate(specs) if s.get("name") in ROLLBACK_FAULTS]
        self.steps = 0
        self._ends: dict[str, tuple[int, int]] = {}  # request id -> (end of its last step, drafts it verified)
        self._hit: set[str] = set()  # requests a fault already acted on (each fault gets a request of its own)

    def apply(self, scheduler_output) -> dict[int, dict[str, Any]]:
        """Shift this step's counts for the faults that fire now (in place, before the worker sees them); per fired
        fault index: ``request_id``, ``shift``, ``rejected`` and ``committed`` (the true computed count)."""
        if not self.pending or not getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            return {}
        self.steps += 1
        cached = scheduler_output.scheduled_cached_reqs
        counts = cached.num_computed_tokens
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        rolled = []  # (row in the cached requests, request id, drafts rejected)
        for i, rid in enumerate(cached.req_ids):
            end, drafts = self._ends.get(rid, (0, 0))
            if rid in resumed or rid in self._hit:  # back from preemption (recomputed, no rollback); already faulted
                continue
            if drafts and 0 < end - counts[i] <= drafts:
                rolled.append((i, rid, end - counts[i]))
        self._remember(scheduler_output)
        fired: dict[int, dict[str, Any]] = {}
        for k, spec in list(self.pending):
            if self.steps <= int(spec.get("after_forward", 0)) or not rolled:
                continue
            i, rid, rejected = random.Random(f"{spec.get('seed', 0)}:{self.steps}").choice(rolled)
            shift = rejected if spec["name"] == "keep_rejected_drafts" else 1
            fired[k] = {"request_id": rid, "shift": shift, "rejected": rejected, "committed": int(counts[i])}
            counts[i] += shift
            self._hit.add(rid)
            rolled = [r for r in rolled if r[1] != rid]
            self.pending.remove((k, spec))
        return fired

    def _remember(self, scheduler_output) -> None:
        """Each scheduled request's end after this step (true counts: before any shift) and its drafts."""
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        scheduled = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        starts = {rid: int(n) for rid, n in zip(cached.req_ids, cached.num_computed_tokens)}
        for req in scheduler_output.scheduled_new_reqs:
            starts[req.req_id] = int(req.num_computed_tokens)
        for rid, start in starts.items():
            self._ends[rid] = (start + int(scheduled.get(rid, 0)), len(drafts.get(rid) or ()))
        for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._ends.pop(rid, None)


__all__ = ["ROLLBACK_FAULTS", "RollbackSkipper"]
