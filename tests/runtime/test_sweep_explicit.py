"""The explicit full sweep (`Canary.sweep` -> `Sweeper.run`): its report and its input checks, and the
rotating passes' per-group report in `CanaryStats.last_pass` (mutation audit, docs/mutation.md)."""
import re

import pytest
import torch

from kvcanary.ops import FailReason
from kvcanary.ops.constants import CANARY_FIELD_PREV_HASH
from kvcanary.engines.sim.engine import kv_bytes
from tests.runtime.conftest import make_canary, make_sim

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
    stats = eng.canary.stats()  # the explicit sweep is counted and is the stats' last sweep
    assert (stats.sweeps, stats.sweep_passes) == (1, 0)
    assert (stats.last_sweep_live, stats.last_sweep_verified, stats.last_sweep_unrecorded) == (
        {"full": 6}, {"full": 4}, {"full": 2})
    eng.canary.sweep(live={"full": torch.tensor([10])})
    assert eng.canary.stats().sweeps == 2 and eng.canary.stats().last_sweep_live == {"full": 1}


def test_a_single_recorded_live_slot_is_verified(manual):
    eng = _two_forwards(manual)
    eng.kv[1][1][12, 0] ^= 4  # last layer, V: bytes the default real-KV hash covers
    report = eng.canary.sweep(live={"full": torch.tensor([12, 50])})  # 50: never written
    assert (report.verified, report.unrecorded) == ({"full": 1}, {"full": 1})
    vs = eng.canary.violations()
    assert vs and {v.slot for v in vs} == {12} and all(v.phase == "sweep" for v in vs)
    # a sweep row expects no token (the sweep's plan carries none: -1)
    assert all(v.expected_token is None for v in vs)


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


def test_a_group_with_nothing_recorded_does_not_end_the_sweep():
    """Groups are swept in the order given; one with no recorded live slot is skipped, the next still swept."""
    engine, canary = make_sim(canary_options={"sweep_interval": 0}, seed=0, sliding_window=16, num_layers=2)
    engine.run(12)
    assert canary.violations() == []
    names = [g.name for g in engine.config.group_specs()]
    assert len(names) == 2
    first, second = names
    g = canary.groups[second]
    written = (g.records.step != -1).nonzero().flatten()
    written = written[written > 0]
    assert written.numel() > 0
    slot = int(written[0])
    for side in g.tail_sides:  # break the slot's stored link: nothing else is wrong
        g.buffer("tail", side).view(torch.int64)[slot, CANARY_FIELD_PREV_HASH] ^= 1
    report = canary.sweep(live={first: torch.zeros(0, dtype=torch.int64), second: torch.tensor([slot])})
    assert report.live == {first: 0, second: 1} and report.verified == {first: 0, second: 1}
    vs = canary.violations()
    assert vs and {(v.group, v.slot) for v in vs} == {(second, slot)} and all(v.phase == "sweep" for v in vs)


@pytest.mark.parametrize("interval,starts", [
    (0, [False] * 7),  # no rotating sweep: no pass ever starts
    (1, [True] * 7),  # a pass is one slice
    (3, [True, False, False, True, False, False, True]),
])
def test_a_pass_starts_every_interval_slices(full_spec, interval, starts):
    sweeper = make_canary(full_spec, sweep_interval=interval).sweeper
    seen = []
    for _ in starts:
        seen.append(sweeper.pass_starts())
        if interval:
            sweeper.slice()
    assert seen == starts


def test_a_live_mask_sweeps_the_same_slots_as_their_indices(manual):
    eng = _two_forwards(manual)
    eng.kv[1][1][12, 0] ^= 4
    mask = torch.zeros(NUM_SLOTS, dtype=torch.bool)
    mask[[12, 13, 50]] = True  # 50: never written
    report = eng.canary.sweep(live={"full": mask})
    assert (report.live, report.verified, report.unrecorded) == ({"full": 3}, {"full": 2}, {"full": 1})
    vs = eng.canary.violations()
    assert vs and {v.slot for v in vs} == {12} and all(v.phase == "sweep" for v in vs)


@pytest.mark.parametrize("shape", [(NUM_SLOTS - 1,), (NUM_SLOTS + 1,), (2, NUM_SLOTS // 2)])
def test_a_live_mask_of_another_shape_is_refused(manual, shape):
    eng = _two_forwards(manual)
    msg = re.escape(f"kv-canary: live mask of group 'full' must have shape ({NUM_SLOTS},) (one entry per slot), "
                    f"got {tuple(shape)}")
    with pytest.raises(ValueError, match=f"^{msg}$"):
        eng.canary.sweep(live={"full": torch.zeros(shape, dtype=torch.bool)})


def test_rotating_passes_from_masks_equal_passes_from_indices():
    """The simulated engine hands over its allocators' masks; a provider of the same slots as indices gives the
    same live sets, the same passes and the same (clean) verdicts."""
    runs = []
    for as_indices in (False, True):
        engine, canary = make_sim(canary_options={"sweep_interval": 4}, seed=2)
        if as_indices:
            canary.set_live_slots_provider(
                lambda e=engine: {k: v.nonzero().flatten() for k, v in e.live_slots().items()})
        engine.run(24)
        lives = {name: sl.live.clone() for name, sl in canary.sweeper._slices.items()}
        runs.append((canary.stats().last_pass, lives, canary.counters()["total"]))
    (pass_m, live_m, total_m), (pass_i, live_i, total_i) = runs
    assert pass_m == pass_i and total_m == total_i == 0
    assert live_m.keys() == live_i.keys() and all(torch.equal(live_m[k], live_i[k]) for k in live_m)


def test_a_token_after_unstored_ones_is_swept_without_a_false_chain_link(manual):
    """A write whose first tokens of a row are not stored (negative slots: a sliding window's positions that left it
    within the chunk) chains the first stored token from the row's seed, not from a chain head. Its record must not
    claim a chain head: a sweep of the slot then checks no link (the predecessor is unknown), and finds nothing."""
    eng = manual(sweep_interval=0, chain_position_warmup=-1)  # the window's gap: no chain-position assert
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6, 7], slots=[10, 11, 12]))
    batch = eng.batch(row=1, prefix=3, tokens=[8, 9, 10, 11], slots=[-1, -1, 14, 15])
    with eng.canary.forward(batch):
        loc = batch.groups["full"].out_cache_loc
        stored = loc >= 0
        for layer, (k, v) in eng.kv.items():
            for side, t in enumerate((k, v)):
                t[loc[stored]] = kv_bytes(batch.input_ids[stored], batch.positions[stored], layer, side, 32)
    assert eng.canary.violations() == []
    report = eng.canary.sweep(live={"full": torch.tensor([10, 11, 12, 14, 15])})
    assert report.complete and report.verified == {"full": 5}
    assert eng.canary.violations() == []
    records = eng.canary.groups["full"].records
    assert records.prev_slot[14].item() == 0 and records.prev_slot[15].item() == 14  # unknown link; a known one
