"""Timing jitter in the runtime (docs/design.md §4.9): the options, their checks and environment variables; the
counts in `Canary.stats()`; jitter off (or never firing) leaves every buffer and count as without it; the twins and
the Triton kernels (interpreter) count the same stalls over a whole simulated run; detection is unchanged."""
from __future__ import annotations

import pytest
import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.runtime import CanaryConfig
from kvcanary.runtime.counters import LaunchCounters

from .conftest import make_sim, warm_sim

SIM = dict(num_slots=256, max_requests=8, max_context=64)


# ---------------------------------------------------------------------------------------------- options


def test_off_by_default():
    c = CanaryConfig()
    assert (c.jitter_fire_prob, c.jitter_max_cycles, c.jitter_seed) == (0.0, 2000, 0)
    assert c.jitter is False


def test_environment_variables():
    env = {"KVCANARY_JITTER_FIRE_PROB": "0.01", "KVCANARY_JITTER_MAX_CYCLES": "500", "KVCANARY_JITTER_SEED": "-7"}
    c = CanaryConfig.from_env(env)
    assert (c.jitter_fire_prob, c.jitter_max_cycles, c.jitter_seed) == (0.01, 500, -7) and c.jitter
    assert CanaryConfig.from_env({"KVCANARY_JITTER_FIRE_PROB": "1"}).jitter_fire_prob == 1.0
    assert CanaryConfig(jitter_fire_prob=1).jitter_fire_prob == 1.0 and isinstance(CanaryConfig(jitter_fire_prob=1).jitter_fire_prob, float)


@pytest.mark.parametrize("kwargs, message", [
    (dict(jitter_fire_prob=-0.1), "kv-canary: jitter_fire_prob must be a number in [0, 1], got -0.1"),
    (dict(jitter_fire_prob=1.01), "kv-canary: jitter_fire_prob must be a number in [0, 1], got 1.01"),
    (dict(jitter_fire_prob=float("nan")), "kv-canary: jitter_fire_prob must be a number in [0, 1], got nan"),
    (dict(jitter_fire_prob="0.1"), "kv-canary: jitter_fire_prob must be a number in [0, 1], got '0.1'"),
    (dict(jitter_fire_prob=True), "kv-canary: jitter_fire_prob must be a number in [0, 1], got True"),
    (dict(jitter_max_cycles=0), "kv-canary: jitter_max_cycles must be an integer in [1, 2147483647], got 0"),
    (dict(jitter_max_cycles=2**31), "kv-canary: jitter_max_cycles must be an integer in [1, 2147483647]"),
    (dict(jitter_max_cycles=10.0), "kv-canary: jitter_max_cycles must be an integer in [1, 2147483647], got 10.0"),
    (dict(jitter_seed="x"), "kv-canary: jitter_seed must be an integer, got 'x'"),
    (dict(jitter_fire_prob=0.1, mode="none"),
     "kv-canary: jitter_fire_prob > 0 needs the canary on (mode 'log' or 'raise'); mode 'none' runs no kernel to stall"),
])
def test_bad_values(kwargs, message):
    with pytest.raises(KvCanaryValueError) as err:
        CanaryConfig(**kwargs)
    assert str(err.value).startswith(message)


def test_mode_none_with_jitter_off_is_fine_and_bad_env_names_the_variable():
    assert CanaryConfig(mode="none", jitter_max_cycles=5, jitter_seed=3).jitter is False
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: KVCANARY_JITTER_FIRE_PROB \(jitter_fire_prob\) must be a number"):
        CanaryConfig.from_env({"KVCANARY_JITTER_FIRE_PROB": "often"})
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: KVCANARY_JITTER_MAX_CYCLES \(jitter_max_cycles\) must be"):
        CanaryConfig.from_env({"KVCANARY_JITTER_MAX_CYCLES": "0"})
    with pytest.raises(KvCanaryTypeError, match="did you mean 'jitter_seed'"):
        CanaryConfig().with_options(jitter_sed=1)


# --------------------------------------------------------------------------------------------- counts


def _run(steps=12, seed=0, **options):
    engine, canary = make_sim(canary_options=dict(sweep_interval=4, **options), **SIM)
    warm_sim(engine, steps=steps, seed=seed)
    return engine, canary


def test_stats_count_stalls_and_cycles():
    _, canary = _run(jitter_fire_prob=0.2, jitter_max_cycles=1000, jitter_seed=5)
    s = canary.stats()
    entries = sum(s.slots_written.values()) + s.slots_verified["head"] + s.slots_verified["tail"]
    assert 0 < s.jitter_stalls < entries
    assert s.jitter_stalls <= s.jitter_cycles <= 1000 * s.jitter_stalls
    assert f"jitter_stalls={s.jitter_stalls} jitter_cycles={s.jitter_cycles}" in s.line()
    assert s.violations == 0
    always = _run(jitter_fire_prob=1.0, jitter_seed=5)[1].stats()
    assert always.jitter_stalls > s.jitter_stalls  # every HEAD / TAIL entry with a slot


def test_same_seed_same_stalls_other_seed_other_stalls():
    a = _run(jitter_fire_prob=0.3, jitter_seed=1)[1].stats()
    b = _run(jitter_fire_prob=0.3, jitter_seed=1)[1].stats()
    c = _run(jitter_fire_prob=0.3, jitter_seed=2)[1].stats()
    assert (a.jitter_stalls, a.jitter_cycles) == (b.jitter_stalls, b.jitter_cycles)
    assert (a.jitter_stalls, a.jitter_cycles) != (c.jitter_stalls, c.jitter_cycles)


def _state(canary) -> dict:
    """Every canary buffer, the slot records, the launch counters (without the jitter row) and the stats."""
    out = {}
    for name, g in canary.groups.items():
        for i, buf in enumerate(g.buffers()):
            out[f"{name}.buf{i}"] = buf.clone()
        out[f"{name}.records"] = torch.stack([g.records.position, g.records.prev_slot, g.records.step,
                                              g.records.owner]).clone()
    table = canary.launch_counters.table
    out["counters"] = table[: LaunchCounters.JITTER_ROW].clone()
    out["jitter_row"] = table[LaunchCounters.JITTER_ROW].clone()
    return out


@pytest.mark.parametrize("options", [dict(), dict(jitter_fire_prob=0.0, jitter_seed=9), dict(jitter_fire_prob=1.0),
                                     dict(jitter_fire_prob=0.01, jitter_max_cycles=7)])
def test_jitter_changes_no_byte_and_no_check(options):
    """On or off, the buffers, records, launch counters, violations and stats are those of a run without it; off or
    at probability 0 the jitter counters stay 0."""
    _, plain = _run(seed=3)
    _, other = _run(seed=3, **options)
    a, b = _state(plain), _state(other)
    for key in a:
        if key != "jitter_row":
            assert torch.equal(a[key], b[key]), key
    sa, sb = plain.stats(), other.stats()
    assert sa.jitter_stalls == sa.jitter_cycles == 0 and not bool(a["jitter_row"].any())
    if not options.get("jitter_fire_prob"):
        assert sb.jitter_stalls == sb.jitter_cycles == 0 and not bool(b["jitter_row"].any())
        assert other.launches.jitter is None
    assert {k: v for k, v in vars(sa).items() if not k.startswith("jitter") and k != "memory_bytes"} == \
        {k: v for k, v in vars(sb).items() if not k.startswith("jitter") and k != "memory_bytes"}


def test_detection_is_unchanged_with_jitter():
    """A flipped KV bit is reported the same with and without jitter (CPU: the twins, nothing waits)."""
    from kvcanary.engines.sim import SimWorkload
    from kvcanary.faults.sim_hooks import flip_kv_bit

    found = []
    for options in (dict(), dict(jitter_fire_prob=0.5, jitter_seed=4)):
        engine, canary = _run(seed=4, **options)
        victim = next(r for r in engine.running if r.num_computed > 8)
        flip_kv_bit(engine, "full", victim.full_slots[2], side="k", byte=0, bit=1)
        engine.run(4, SimWorkload(seed=4, arrival_prob=0.0, abort_prob=0.0))
        found.append([v.log_line() for v in canary.violations()])
    assert found[0] and found[0] == found[1]


def test_kernels_and_twins_count_the_same_stalls_over_a_run(all_triton):
    """The whole per-forward path on the Triton launchers (interpreter) against the twins: same stalls, same cycles."""
    from kvcanary.ops.dispatch import selected_backend

    counts = []
    for backend in ("torch", "triton"):
        with selected_backend(backend):
            _, canary = _run(steps=5, jitter_fire_prob=0.2, jitter_seed=3)
            s = canary.stats()
        counts.append((s.jitter_stalls, s.jitter_cycles, s.violations))
    assert counts[0] == counts[1] and counts[0][0] > 0


def test_attach_takes_the_options():
    """`kvcanary.attach` passes the jitter options through (transformers continuous batching on the CPU)."""
    pytest.importorskip("transformers")
    import kvcanary
    from kvcanary.cli.demo import generate, tiny_model, workload
    from tests.conftest import quiet_loggers

    llama = tiny_model("llama", torch.device("cpu"), seed=0)
    with quiet_loggers("ContinuousBatchingLogger", "kvcanary"):
        with kvcanary.attach(llama, mode="log", jitter_fire_prob=0.3, jitter_seed=2) as handle:
            generate(llama, workload()[:2], max_new_tokens=3)
            sessions = handle.stats()
    assert sum(s.jitter_stalls for s in sessions) > 0 and handle.counters()["total"] == 0
    with pytest.raises(KvCanaryValueError, match="^kv-canary: jitter_fire_prob must be a number in"):
        kvcanary.attach(llama, mode="log", jitter_fire_prob=2.0)


def test_jitter_splits_no_variant_by_a_runtime_value(all_triton):
    """With jitter on, the per-forward kernels still compile one variant per geometry: the jitter's pointers (a view
    into the polled counters among them) are not specialised on alignment and the tags not on value."""
    from tests.triton_variants import record_variants, runtime_only_differences

    engine, canary = make_sim(canary_options=dict(sweep_interval=4, jitter_fire_prob=0.1), **SIM)
    with record_variants() as variants:
        warm_sim(engine, steps=6)
    assert canary.stats().jitter_stalls > 0
    assert variants["_verify_kernel"] and variants["_write_small_kernel"]
    for name, keys in variants.items():
        assert not runtime_only_differences(keys), f"{name}: variants split by a runtime value or an alignment"
