"""Hand-broken bookkeeping on the simulated engine is caught with the right reason, tag, slot,
position and request."""
import pytest

from kvcanary.runtime.canary import OWNER_SPAN
from kvcanary.runtime.launch import ROW_HISTORY
from kvcanary.ops import CanaryLaunchTag, FailReason
from kvcanary.faults.sim_hooks import cached_idle_slots, flip_kv_bit, free_and_reuse, redirect_slot, shift_positions

from tests.runtime.conftest import make_sim, warm_sim


def _victim(engine, min_computed=8):
    """A running request with a decent prefix, and a position in it no other request shares."""
    shared = {}
    for r in engine.running:
        for s in r.full_slots[: r.num_computed]:
            shared[s] = shared.get(s, 0) + 1
    for r in engine.running:
        if r.num_computed >= min_computed and r.max_new - r.generated >= 3:
            for p in range(r.num_computed - 1, r.own_from - 1, -1):
                if shared[r.full_slots[p]] == 1:
                    return r, p
    raise AssertionError("no suitable running request; warm the engine longer")


def _first(canary, **match):
    vs = canary.violations()
    assert vs, "expected a violation"
    for k, want in match.items():
        assert getattr(vs[0], k) == want, (k, vs[0])
    return vs


def test_slot_redirected_to_another_live_slot():
    engine, canary = make_sim(seed=3)
    warm_sim(engine, seed=3)
    assert canary.counters()["total"] == 0
    req, pos = _victim(engine)
    other = next(r for r in engine.running if r is not req and r.num_computed > 2)
    target = other.full_slots[1]  # another live slot, at position 1 of another request
    assert pos != 1
    redirect_slot(engine, req.rid, pos, target)
    engine.step()
    vs = _first(canary, launch_tag=CanaryLaunchTag.HEAD_K_FULL, slot=target, request_id=req.rid,
                request_row=req.row, expected_position=pos, stored_position=1, op="verify")
    assert vs[0].reasons & FailReason.VERIFY_POSITION_MISMATCH
    assert vs[0].reasons & FailReason.VERIFY_CHAIN_HASH_MISMATCH


def test_slot_freed_and_reused_while_referenced():
    engine, canary = make_sim(seed=4)
    warm_sim(engine, seed=4)
    req, pos = _victim(engine)
    slot = free_and_reuse(engine, req.rid, pos)
    engine.step()  # the next allocation takes the slot and overwrites its record
    engine.step()
    vs = [v for v in canary.violations() if v.slot == slot and v.request_id == req.rid]
    assert vs, canary.violations()[:3]
    first = vs[0]
    assert first.launch_tag.phase in ("tail", "head") and first.op == "verify"
    assert first.expected_position == pos and first.request_row == req.row
    # The new owner's forward overwrites the KV first (TAIL: real-KV hash), then the record
    # (next HEAD: position / chain against the victim's table).
    assert first.reasons & (FailReason.VERIFY_REAL_KV_HASH_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH
                            | FailReason.VERIFY_CHAIN_HASH_MISMATCH)
    head = [v for v in vs if v.launch_tag == CanaryLaunchTag.HEAD_K_FULL and v.expected_position == pos]
    assert head and head[0].reasons & FailReason.VERIFY_POSITION_MISMATCH


@pytest.mark.parametrize("side", ["k", "v"])
def test_flipped_kv_byte_in_running_request(side):
    engine, canary = make_sim(seed=5)
    warm_sim(engine, seed=5)
    req, pos = _victim(engine)
    slot = req.full_slots[pos]
    flip_kv_bit(engine, "full", slot, side=side, byte=3, bit=5)
    engine.step()
    tag = CanaryLaunchTag.of(phase="tail", side=side, group="full")
    vs = _first(canary, launch_tag=tag, slot=slot, request_id=req.rid, request_row=req.row,
                stored_position=pos, expected_position=pos)
    assert vs[0].reasons == FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    assert vs[0].reason_label == "verify_real_kv_hash"


def test_flipped_byte_in_idle_cached_slot_is_caught_only_by_the_sweep():
    engine, canary = make_sim(seed=6)
    engine.run(60)
    idle = cached_idle_slots(engine)
    assert idle, "the workload should leave cached prefixes"
    slot = idle[-1]
    owner = int(canary.groups["full"].records.owner[slot])
    written_step, batch_row = divmod(owner, OWNER_SPAN)
    writer = canary.step_log.get(written_step)
    flip_kv_bit(engine, "full", slot, side="v", byte=0, bit=0)
    for _ in range(3):  # forwards without new arrivals do not read idle cached slots
        engine.step()
    assert canary.counters()["total"] == 0
    report = canary.sweep()
    assert report.complete
    vs = _first(canary, launch_tag=CanaryLaunchTag.SWEEP_V_FULL, slot=slot, forward_kind="sweep",
                reasons=FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    assert vs[0].request_id == writer.request_ids[batch_row] and vs[0].request_id is not None
    assert vs[0].request_row == int(canary.launches.row_history[written_step % ROW_HISTORY, batch_row])


def test_position_off_by_one():
    engine, canary = make_sim(seed=7)
    warm_sim(engine, seed=7)
    req, _ = _victim(engine)
    p = req.num_computed
    engine.batch_hooks.append(shift_positions(req.rid, +1))
    engine.step()
    vs = canary.violations()
    write_rows = [v for v in vs if v.op == "write" and v.request_id == req.rid]
    assert write_rows, vs[:3]
    w = write_rows[0]
    assert w.launch_tag == CanaryLaunchTag.HEAD_K_FULL and w.stored_position == p + 1 and w.expected_position == p
    assert w.reasons == FailReason.WRITE_POSITION_MISMATCH
    assert w.slot == req.full_slots[p] and w.request_row == req.row
    engine.step()  # now the stored position disagrees with the table
    later = [v for v in canary.violations() if v.op == "verify" and v.slot == req.full_slots[p]]
    assert later and later[0].reasons & FailReason.VERIFY_POSITION_MISMATCH
    assert later[0].expected_position == p and later[0].stored_position == p + 1


def test_sliding_window_group_redirect_and_flip():
    engine, canary = make_sim(seed=8, sliding_window=16)
    warm_sim(engine, seed=8)
    assert canary.counters()["total"] == 0
    req = next(r for r in engine.running if r.num_computed >= 8)
    pos = req.num_computed - 2
    swa_slot = req.swa_slots[pos]
    assert swa_slot != 0
    flip_kv_bit(engine, "swa", swa_slot, side="k", byte=1)
    engine.step()
    vs = _first(canary, launch_tag=CanaryLaunchTag.TAIL_K_SWA, slot=swa_slot, request_id=req.rid,
                group="swa", reasons=FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    assert vs[0].expected_position == pos
