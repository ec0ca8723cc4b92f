"""The explicit sweep launched from device masks without a host read (`Canary.launch_sweep` ->
`Sweeper.run_masks`): the same verdicts as `Canary.sweep` on the same live set, in chunks of any size."""
import random
import re

import pytest
import torch

from kvcanary.ops.constants import CANARY_FIELD_PREV_HASH
from tests.runtime.conftest import make_sim, warm_sim

NUM_SLOTS = 64  # full_spec


def _verdicts(vs):
    return sorted((v.group, v.slot, int(v.reasons)) for v in vs)


def _corrupt(canary, engine, rng):
    """Flip a stored link or a real-KV byte of a few written slots of each group."""
    for name, g in canary.groups.items():
        written = (g.records.step != -1).nonzero().flatten()
        written = written[written > 0].tolist()
        for slot in rng.sample(written, min(3, len(written))):
            if rng.random() < 0.5:
                g.buffer("tail", g.tail_sides[0]).view(torch.int64)[slot, CANARY_FIELD_PREV_HASH] ^= 1
            else:
                layer = rng.choice(sorted(layer for grp, layer in engine.kv if grp == name))
                engine.kv[(name, layer)][rng.randrange(2)][slot, 0] ^= 1


@pytest.mark.parametrize("seed", range(6))
def test_masks_find_what_indices_find_in_chunks_of_any_size(seed):
    rng = random.Random(seed)
    engine, canary = make_sim(canary_options={"sweep_interval": 0}, seed=seed, sliding_window=rng.choice([0, 16]),
                              num_layers=rng.choice([2, 3, 5]))
    warm_sim(engine, steps=rng.randrange(10, 30), seed=seed)
    assert canary.violations() == []
    _corrupt(canary, engine, rng)
    masks = engine.live_slots()
    report = canary.sweep(live={n: m.nonzero().flatten() for n, m in masks.items()})
    by_indices = _verdicts(canary.violations())
    assert by_indices, "the corruption must be found by the indexed sweep"
    seen = len(canary.violations())
    canary.sweeper.run_masks(masks, step=7, chunk=rng.choice([1, 5, 13, 1 << 17]))
    by_masks = _verdicts(canary.violations()[seen:])
    assert by_masks == by_indices
    last = canary.sweeper.last
    assert last.step == 7 and (last.live, last.verified, last.unrecorded) == (
        report.live, report.verified, report.unrecorded)


def test_launch_sweep_reports_through_the_drain_and_counts_the_sweep():
    engine, canary = make_sim(canary_options={"sweep_interval": 0}, seed=3)
    warm_sim(engine, steps=20, seed=3)
    g = next(iter(canary.groups.values()))
    slot = int(engine.live_slots()[g.name].nonzero().flatten()[-1])
    g.buffer("tail", g.tail_sides[0]).view(torch.int64)[slot, CANARY_FIELD_PREV_HASH] ^= 1
    canary.launch_sweep(engine.live_slots())
    vs = canary.violations()
    assert {(v.group, v.slot, v.phase) for v in vs} == {(g.name, slot, "sweep")}
    assert canary.stats().sweeps == 1


def test_a_clean_cache_stays_silent():
    engine, canary = make_sim(canary_options={"sweep_interval": 0}, seed=5, sliding_window=16)
    warm_sim(engine, steps=25, seed=5)
    canary.launch_sweep(engine.live_slots())
    assert canary.violations() == []
    assert canary.sweeper.last.verified == {n: int(m.sum()) for n, m in engine.live_slots().items()}


@pytest.mark.parametrize("mask", [torch.zeros(NUM_SLOTS, dtype=torch.int64), torch.zeros(NUM_SLOTS + 1, dtype=torch.bool)])
def test_a_mask_of_another_dtype_or_size_is_refused(manual, mask):
    eng = manual(sweep_interval=0)
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6, 7], slots=[10, 11, 12]))
    msg = re.escape(f"kv-canary: a live mask of group 'full' must be bool [{NUM_SLOTS}] on cpu, got {mask.dtype} "
                    f"[{mask.numel()}] on cpu")
    with pytest.raises(ValueError, match=f"^{msg}$"):
        eng.canary.launch_sweep({"full": mask})


@pytest.mark.parametrize("seed", range(4))
def test_windowed_sweeps_cover_the_slot_space_once_per_pass_with_the_same_verdicts(seed):
    """``sweep_max_bytes`` smaller than the slot space's K/V: each sweep takes the next window (slot order,
    wrapping); one pass of windows finds exactly what one whole sweep finds, and each window is within budget."""
    rng = random.Random(100 + seed)
    engine, canary = make_sim(canary_options={"sweep_interval": 0}, seed=seed, num_layers=rng.choice([2, 3, 5]),
                              sliding_window=rng.choice([0, 16]))
    warm_sim(engine, steps=rng.randrange(10, 30), seed=seed)
    _corrupt(canary, engine, rng)
    masks = engine.live_slots()
    canary.sweep(live={n: m.nonzero().flatten() for n, m in masks.items()})
    whole = _verdicts(canary.violations())
    assert whole
    g = next(iter(canary.groups.values()))
    per_slot = g.kv_bytes_per_slot()
    window = rng.choice([1, 3, 7, 20])
    canary.sweeper.max_bytes = window * per_slot + rng.randrange(per_slot)  # as CanaryConfig(sweep_max_bytes=...)
    seen = len(canary.violations())
    covered = {n: [] for n in masks}
    passes = max(-(-grp.num_slots // canary.sweeper.window_slots(grp)) for grp in canary.groups.values())
    for _ in range(passes):
        canary.launch_sweep(masks)
        last = canary.sweeper.last
        for n, (lo, hi) in last.windows.items():
            grp = canary.groups[n]
            assert 0 < hi - lo <= canary.sweeper.window_slots(grp) and (hi - lo) * grp.kv_bytes_per_slot() <= canary.sweeper.max_bytes
            assert last.live[n] == int(masks[n][max(lo, 1):hi].sum())
            covered[n].append((lo, hi))
    assert sorted(set(_verdicts(canary.violations()[seen:]))) == sorted(set(whole))  # smaller groups wrap: repeats
    for n, spans in covered.items():  # a group with fewer windows per pass wraps back to 0 (and finds nothing new)
        first = spans[: -(-canary.groups[n].num_slots // canary.sweeper.window_slots(canary.groups[n]))]
        assert first[0][0] == 0 and first[-1][1] == canary.groups[n].num_slots
        assert all(a[1] == b[0] for a, b in zip(first, first[1:]))


def test_sweep_max_bytes_is_validated_and_zero_means_every_slot():
    with pytest.raises(ValueError, match=r"^kv-canary: sweep_max_bytes must be an integer >= 0, got -1$"):
        make_sim(canary_options={"sweep_max_bytes": -1})
    engine, canary = make_sim(canary_options={"sweep_interval": 0, "sweep_max_bytes": 0}, seed=2)
    warm_sim(engine, steps=12, seed=2)
    canary.launch_sweep(engine.live_slots())
    assert all(hi - lo == canary.groups[n].num_slots for n, (lo, hi) in canary.sweeper.last.windows.items())


def test_given_windows_bound_what_a_sweep_verifies_and_bad_ones_are_refused():
    engine, canary = make_sim(canary_options={"sweep_interval": 0}, seed=4)
    warm_sim(engine, steps=20, seed=4)
    masks = engine.live_slots()
    name, mask = next(iter(masks.items()))
    g = canary.groups[name]
    live = mask.nonzero().flatten()
    lo, hi = int(live[len(live) // 3]), int(live[2 * len(live) // 3])
    victims = [int(live[0]), int(live[len(live) // 2])]  # one outside [lo, hi), one inside
    for slot in victims:
        g.buffer("tail", g.tail_sides[0]).view(torch.int64)[slot, CANARY_FIELD_PREV_HASH] ^= 1
    canary.launch_sweep({name: mask}, windows={name: (lo, hi)})
    found = {v.slot for v in canary.violations()}  # the victim inside, and its chain successor if that is inside
    assert victims[1] in found and victims[0] not in found and all(lo <= s < hi for s in found)
    last = canary.sweeper.last
    assert last.windows[name] == (lo, hi) and last.live[name] == int(mask[lo:hi].sum())
    canary.launch_sweep({name: mask}, windows={name: (-5, 10 ** 9)})  # clamped to the slot space: both found
    assert canary.sweeper.last.windows[name] == (0, g.num_slots)
    assert set(victims) <= {v.slot for v in canary.violations()}
    with pytest.raises(ValueError, match=r"^kv-canary: the sweep window of group .* must be \(lo, hi\) slot integers"):
        canary.launch_sweep({name: mask}, windows={name: (1.5, 3)})
