"""`Canary.close` sweeps every live slot once more before it closes (when the sweep is on)."""
import pytest
import torch

from kvcanary.ops import FailReason
from kvcanary.runtime import CanaryViolationError


def _damaged(manual, **options):
    eng = manual(**options)
    eng.canary.set_live_slots_provider(lambda: {"full": torch.tensor([10, 11, 12])})
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6, 7], slots=[10, 11, 12]))
    eng.kv[0][1][11, 20] ^= 2  # layer 0 V, past the 16 bytes reads hash: only the sweep's deep records see it
    return eng


def test_close_reports_damage_no_read_or_slice_reached(manual):
    eng = _damaged(manual, sweep_interval=64)
    stats = eng.canary.close()
    assert stats.sweeps == 1
    vs = eng.canary.violations()
    assert vs and {(v.slot, v.phase, v.reasons) for v in vs} == {(11, "sweep", FailReason.VERIFY_REAL_KV_HASH_MISMATCH)}


@pytest.mark.parametrize("options,final", [({"sweep_interval": 64}, False), ({"sweep_interval": 0}, True)])
def test_no_final_sweep_when_asked_or_when_the_sweep_is_off(manual, options, final):
    eng = _damaged(manual, **options)
    assert eng.canary.close(final_sweep=final).sweeps == 0 and eng.canary.violations() == []


def test_raise_mode_raises_after_closing(manual):
    eng = _damaged(manual, sweep_interval=64, mode="raise")
    with pytest.raises(CanaryViolationError) as info:
        eng.canary.close()
    assert {v.slot for v in info.value.violations} == {11}
    assert eng.canary.close().sweeps == 1  # closed: idempotent, no second sweep


def test_a_failing_provider_does_not_fail_close(manual):
    eng = _damaged(manual, sweep_interval=64, mode="raise")
    eng.canary.set_live_slots_provider(lambda: 1 / 0)
    assert eng.canary.close().sweeps == 0 and eng.canary.coverage()["canary_errors"] == 1
