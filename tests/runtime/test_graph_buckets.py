"""Launches sized to a graph bucket (`ForwardLaunches.head(limit=...)`, what `CanaryGraphs` captures per bucket)
find what batch-sized launches find: the static buffers are padding past the staged batch, so a bucket larger
than the batch changes no record, counter-visible check or violation. CPU (torch twins); the captured graphs
themselves are compared on CUDA in tests/gpu/test_runtime_graphs.py."""
from __future__ import annotations

import torch

from kvcanary.engines.sim import SimWorkload
from tests.runtime.conftest import flip_and_redirect, make_sim

SMALL = 16


def _bucketed(canary) -> None:
    """HEAD (and so TAIL) span a bucket: SMALL tokens for small batches, else the whole static capacity."""
    head = canary.launches.head

    def bucket_head(**_: object) -> None:
        s = canary.static
        head(limit=(s.max_rows, SMALL) if s.num_tokens <= SMALL else (s.max_rows, s.max_tokens))

    canary.launches.head = bucket_head


def _run(bucketed: bool):
    engine, canary = make_sim(seed=4, canary_options=dict(sweep_interval=8))
    if bucketed:
        _bucketed(canary)
    stream = SimWorkload(seed=4, new_tokens=(20, 40), abort_prob=0.0, arrival_prob=0.5).stream(engine.config.max_context)

    def steps(n: int) -> None:
        for _ in range(n):
            for prompt, new in next(stream):
                engine.add_request(prompt, new)
            engine.step()

    steps(30)
    flip_and_redirect(engine)
    steps(30)
    return canary, canary.violations()


def _key(v):
    return (v.step, v.launch_tag.name, v.slot, v.stored_position, v.expected_position, int(v.reasons), v.request_id)


def test_bucket_sized_launches_match_batch_sized_launches():
    plain, found = _run(bucketed=False)
    bucketed, found_bucketed = _run(bucketed=True)
    assert found, "the faults must be caught"
    assert sorted(map(_key, found_bucketed), key=repr) == sorted(map(_key, found), key=repr)
    assert plain.static.max_tokens > SMALL  # both buckets were used
    for name, g in plain.groups.items():
        h = bucketed.groups[name]
        assert torch.equal(g.head_buf, h.head_buf)
        for side in g.tail_sides:
            assert torch.equal(g.tail_bufs[side], h.tail_bufs[side])
        for field in ("position", "prev_slot", "step", "owner"):
            assert torch.equal(getattr(g.records, field)[:-1], getattr(h.records, field)[:-1]), field
