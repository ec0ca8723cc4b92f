"""Slots the engine frees during a rotating pass (`Canary.release_slots` -> `Sweeper.release`): the pass stops
checking them, and keeps checking every other live slot."""
import pytest
import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops import FailReason


def _engine(manual, live):
    eng = manual(sweep_interval=2)  # 64 slots: slice one covers 0-31, slice two 32-63
    eng.canary.set_live_slots_provider(lambda: {"full": torch.tensor(sorted(live))})
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6, 7, 8], slots=[10, 11, 40, 41]))  # the pass starts; slice one
    return eng


@pytest.mark.parametrize("release", [True, False])
def test_a_slot_freed_and_reused_within_a_pass_is_not_judged_once_released(manual, release):
    live = {10, 11, 40, 41}
    eng = _engine(manual, live)
    # between forwards the engine frees slot 41, scribbles on its bytes (free memory is the engine's) and gives it
    # to a request that has not written it yet (listed live again); meanwhile a bit of live slot 40 flips
    if release:
        eng.canary.release_slots("full", [41])
    eng.kv[0][0][41] ^= 0xFF
    eng.kv[1][1][40, 0] ^= 4
    eng.forward(eng.batch(row=2, prefix=0, tokens=[9], slots=[12], rid="b"))  # HEAD runs slice two (32-63)
    live.add(12)
    found = {(v.slot, v.reasons) for v in eng.canary.violations()}
    flip = (40, FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    if release:
        assert found == {flip}
        eng.forward(eng.batch(row=2, prefix=1, tokens=[3], slots=[13], rid="b"))  # the next pass starts
        assert eng.canary.sweeper.pass_report() == {"full": {"live": 3, "verified": 3}}  # 41 left the pass's total
    else:  # the engine's reuse is reported as corruption: what release_slots is for
        assert flip in found and (41, FailReason.VERIFY_REAL_KV_HASH_MISMATCH) in found


def test_release_of_a_slot_already_swept_in_the_pass_keeps_the_count(manual):
    eng = _engine(manual, {10, 11, 40, 41})
    eng.canary.release_slots("full", torch.tensor([10, 10, 0, 64]))  # duplicates, padding and the trash row: harmless
    eng.forward(eng.batch(row=2, prefix=0, tokens=[9], slots=[12], rid="b"))
    eng.forward(eng.batch(row=2, prefix=1, tokens=[3], slots=[13], rid="b"))
    assert eng.canary.violations() == []
    assert eng.canary.sweeper.pass_report() == {"full": {"live": 4, "verified": 4}}  # 10 was verified before release


def test_release_names_a_known_group(manual):
    eng = _engine(manual, {10})
    with pytest.raises(KvCanaryValueError, match="^kv-canary: no group 'swa'"):
        eng.canary.release_slots("swa", [1])
