"""Per-request context keys on the simulated engine: caught across contexts, silent within one — also when the KV
moves (fork, host offload / restore, transfer between engines) and under the sweep."""
import random

from kvcanary.engines.sim.moves import SimMoves

from tests.runtime.conftest import make_sim


def _keyed(engine, n=3, seed=0, context=7, prompt_len=20, max_new=40):
    rng = random.Random(seed)
    return [engine.add_request([rng.randrange(1, 32000) for _ in range(prompt_len)], max_new, context=context)
            for _ in range(n)]


def _drain(engine, steps=400):
    for _ in range(steps):
        if not engine.running and not engine.waiting:
            return
        engine.step()


def test_keyed_requests_moved_and_swept_are_silent():
    engine, canary = make_sim(seed=11, canary_options=dict(sweep_interval=2, mode="raise"))
    a, b, c = _keyed(engine)
    for _ in range(4):
        engine.step()
    assert a.own_from == b.own_from == 0 and a.num_computed > 0  # the moves below carry position 0
    moves = SimMoves(engine)
    child = moves.fork(a.rid, a.rid + "-fork")
    assert child.context == a.context
    moves.offload(b.rid)
    engine.step()
    moves.restore(b.rid)
    other, other_canary = make_sim(seed=12, canary_options=dict(mode="raise"))
    t = moves.transfer_out(c.rid)
    moved, report = SimMoves(other).transfer_in(t)
    assert moved.context == c.context and report.clean and report.verified > 0
    _drain(engine)
    _drain(other)
    canary.sweep()
    assert all(r.clean for r in moves.reports) and len(moves.reports) == 2
    assert canary.counters()["total"] == 0 and other_canary.counters()["total"] == 0


def test_prefix_hit_across_contexts_is_caught_and_silent_within_one():
    def run(second_context):
        engine, canary = make_sim(seed=13, block_size=4)
        (first,) = _keyed(engine, n=1, seed=1, context=3, max_new=2)
        _drain(engine)  # finished: its blocks are in the prefix cache
        (second,) = _keyed(engine, n=1, seed=1, context=second_context, max_new=2)  # the same prompt
        _drain(engine)
        return second, canary.violations()

    second, found = run(second_context=4)
    assert found and {v.request_id for v in found} == {second.rid}
    assert any(v.stored_position == 0 and "verify_chain_hash" in v.reason_label for v in found)
    _, found = run(second_context=3)
    assert found == []
