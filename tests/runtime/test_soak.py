"""Clean soaks: long mixed workloads on the simulated engine report nothing, and the sweep
verifies every live slot."""
import pytest

from kvcanary.engines.sim import SimWorkload

from tests.runtime.conftest import make_sim


@pytest.mark.parametrize(
    "sim_options, steps",
    [
        (dict(seed=11, num_slots=1024, max_context=128, max_running=8), 1500),
        (dict(seed=12, sliding_window=24, num_slots=1024, swa_num_slots=256, max_context=128, max_running=8), 1000),
    ],
    ids=["full", "sliding_window"],
)
def test_clean_soak_reports_nothing_and_verifies_every_live_slot(sim_options, steps):
    engine, canary = make_sim(canary_options=dict(sweep_interval=50, health_interval=25), **sim_options)
    engine.run(steps, SimWorkload(seed=sim_options["seed"], abort_prob=0.03))
    # the workload exercised what it should
    assert engine.cache_hit_tokens > 0 and engine.evicted_blocks > 0 and engine.aborted > 0 and engine.finished > 0
    if engine.config.sliding_window:
        assert engine.retracted > 0 and engine.swa_alloc.num_free > 0
    report = canary.sweep()
    stats = canary.close()
    assert stats.violations == 0, canary.violations()[:5]
    assert canary.counters()["total"] == 0 and stats.health_stalls == 0
    assert report.complete and all(n > 0 for n in report.live.values())
    assert report.unrecorded == {g: 0 for g in report.live}
    # rotating sweep: one pass per 50 forwards, each verifying every slot live at its start; a pass is counted at
    # the end of the step that ran its last slice (the next pass's live set is taken there)
    assert stats.forwards == steps and stats.sweep_passes == steps // 50
    assert all(p["live"] > 0 and p["verified"] == p["live"] for p in stats.last_pass.values()), stats.last_pass
    assert stats.slots_verified["head"] > 0 and stats.slots_verified["tail"] > 0
    assert stats.slots_verified["sweep"] >= sum(report.live.values())
