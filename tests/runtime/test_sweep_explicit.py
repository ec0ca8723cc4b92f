"""The explicit full sweep (`Canary.sweep` -> `Sweeper.run`): its report and its input checks, and the
rotating passes' per-group report in `CanaryStats.last_pass` (mutation audit, docs/mutation.md)."""
import pytest
import torch

from kvcanary.ops import FailReason
from tests.runtime.conftest import make_sim

NUM_SLOTS = 64  # full_spec


def _two_forwards(manual):
    eng = manual(sweep_interval=0)
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6, 7], slots=[10, 11, 12]))
    eng.forward(eng.batch(row=1, prefix=3, tokens=[8], slots=[13]))
    assert eng.canary.violations() == []
    return eng


def test_report_names_the_step_and_counts_live_verified_and_unrecorded_slots(manual):
    eng = _two_forwards(manual)
    step = int(eng.canary.sweeper.step.item())
    assert step == 2
    report = eng.canary.sweep(live={"full": torch.tensor([0, 10, 11, 12, 13, 40, 41], dtype=torch.int32)})
    assert report.step == step
    # padding slot 0 is dropped; 40 and 41 are live but were never written
    assert (report.live, report.verified, report.unrecorded) == ({"full": 6}, {"full": 4}, {"full": 2})
    assert report.complete and eng.canary.violations() == []


@pytest.mark.parametrize("slots,lo,hi", [([-1, 10], -1, 10), ([10, NUM_SLOTS], 10, NUM_SLOTS), ([NUM_SLOTS + 3], NUM_SLOTS + 3, NUM_SLOTS + 3)])
def test_live_slots_outside_the_group_are_refused_with_their_range(manual, slots, lo, hi):
    eng = _two_forwards(manual)
    msg = rf"^kv-canary: live slots of group 'full' must be in \[1, {NUM_SLOTS}\), got \[{lo}, {hi}\]$"
    with pytest.raises(ValueError, match=msg):
        eng.canary.sweep(live={"full": torch.tensor(slots)})


def test_last_slot_of_the_group_is_accepted_and_swept(manual):
    eng = manual(sweep_interval=0)
    last = NUM_SLOTS - 1
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6], slots=[last - 1, last]))
    eng.kv[0][0][last, 0] ^= 1  # layer 0, K: bytes the default real-KV hash covers
    report = eng.canary.sweep(live={"full": torch.tensor([last - 1, last])})
    assert report.verified == {"full": 2}
    vs = eng.canary.violations()
    assert vs and {v.slot for v in vs} == {last} and all(v.phase == "sweep" for v in vs)
    assert any(v.reasons & FailReason.VERIFY_REAL_KV_HASH_MISMATCH for v in vs)


def test_rotating_passes_report_live_and_verified_slots_per_group():
    engine, canary = make_sim(canary_options={"sweep_interval": 4}, seed=0)
    engine.run(12)
    stats = canary.stats()
    assert stats.sweep_passes >= 2
    assert set(stats.last_pass) == {g.name for g in engine.config.group_specs()}
    for p in stats.last_pass.values():
        assert set(p) == {"live", "verified"} and p["live"] > 0 and p["verified"] == p["live"]
