"""The simulated engine's KV moves (fork, host offload / restore, transfer) under the canary."""
import pytest

from kvcanary.engines.sim import SimConfig, SimEngine
from kvcanary.engines.sim.moves import SimMoves
from kvcanary.ops import FailReason

from tests.runtime.conftest import make_sim, warm_sim


def _busy(engine, n=2, min_computed=8):
    reqs = [r for r in engine.running if r.num_computed >= min_computed and r.max_new - r.generated >= 4]
    assert len(reqs) >= n, "warm the engine longer"
    return reqs[:n]


def _drain(engine, steps=400):
    for _ in range(steps):
        if not engine.running and not engine.waiting:
            return
        engine.step()


def test_fork_offload_restore_clean_run_is_silent():
    engine, canary = make_sim(seed=5, canary_options=dict(sweep_interval=3))
    warm_sim(engine, seed=5)
    moves = SimMoves(engine)
    a, b = _busy(engine)
    child = moves.fork(a.rid, a.rid + "-fork")
    moves.offload(b.rid)
    for _ in range(3):
        engine.step()
    report = moves.restore(b.rid)
    assert report.clean and report.moved == report.verified > 0
    _drain(engine)
    assert child.state == "finished" and b.state == "finished"
    assert canary.counters()["total"] == 0
    assert [r.kind for r in moves.reports] == ["copy", "import"] and all(r.clean for r in moves.reports)


def test_host_copy_corrupted_is_caught_at_restore_against_the_restoring_request():
    engine, canary = make_sim(seed=6)
    warm_sim(engine, seed=6)
    moves = SimMoves(engine)
    (b,) = _busy(engine, 1)
    entry = moves.offload(b.rid)
    entry.kv[1, 2, 5] ^= 0x10  # layer 0 V, third offloaded slot, one bit
    report = moves.restore(b.rid)
    assert len(report.violations) == 1
    v = report.violations[0]
    assert v.request_id == b.rid and v.reasons == FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    assert v.launch_tag.name == "MOVE_V_FULL" and v.slot == b.full_slots[b.own_from + 2]
    assert v.stored_position == b.own_from + 2 and v.forward_kind == f"import:restore:{b.rid}"


@pytest.mark.parametrize("fault", [None, "zero"])
def test_transfer_between_engines(fault):
    p, _ = make_sim(seed=7)
    d, canary_d = make_sim(seed=8)
    warm_sim(p, steps=20, seed=7)
    (req,) = _busy(p, 1, min_computed=4)
    t = SimMoves(p).transfer_out(req.rid)
    assert req.state == "transferred"
    if fault == "zero":
        t.kv[:, 1] = 0
    got, report = SimMoves(d).transfer_in(t)
    if fault is None:
        assert report.clean and report.verified == t.num_computed
        _drain(d)
        assert got.state == "finished" and canary_d.counters()["total"] == 0
    else:
        assert {v.slot for v in report.violations} == {got.full_slots[1]}
        assert {v.request_id for v in report.violations} == {req.rid}


def test_unchecked_engine_moves_kv_alone():
    engine = SimEngine(SimConfig(seed=5))
    warm_sim(engine, seed=5)
    moves = SimMoves(engine)
    (a,) = _busy(engine, 1)
    moves.offload(a.rid)
    assert moves.restore(a.rid) is None
    _drain(engine)
    assert a.state == "finished"


def test_sliding_window_is_refused():
    engine, _ = make_sim(sliding_window=8)
    with pytest.raises(ValueError, match="kv-canary: SimMoves supports full-attention"):
        SimMoves(engine)
