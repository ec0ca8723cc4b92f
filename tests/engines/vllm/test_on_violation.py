"""``on_violation``: what vLLM does about corrupted KV once the canary finds it (the tiny workload's two faults: a
redirected block-table entry and a flipped bit in a cached block).

* ``abort`` — the requests holding the corrupted blocks finish with ``finish_reason == "error"``, the engine serves
  every other request to the end;
* ``recompute`` — they recompute the corrupted blocks and finish normally;
* ``log`` (default) and ``raise`` are covered by test_engine.py.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import run_workload  # noqa: E402

from kvcanary.engines.vllm import kv_transfer_config  # noqa: E402
from kvcanary.faults.vllm import faulted_kv_transfer_config  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_workload("ref", tmp_path_factory)


@pytest.fixture(scope="module")
def aborted(tmp_path_factory):
    return run_workload("faults", tmp_path_factory, "--on-violation", "abort")


@pytest.fixture(scope="module")
def recomputed(tmp_path_factory):
    return run_workload("faults", tmp_path_factory, "--on-violation", "recompute")


def _injected(run: dict) -> set[int]:
    """Indices (submission order) of the requests the faults were injected into."""
    out = set()
    for e in run["ledger"]:
        out |= {i for i, rid in enumerate(run["request_ids"]) if e["request_id"] in (rid, ) or e["request_id"].split("-")[0] == rid}
    return out


def test_kv_transfer_config_sets_vllms_failure_policy():
    assert kv_transfer_config(on_violation="abort")["kv_load_failure_policy"] == "fail"
    assert kv_transfer_config(on_violation="recompute")["kv_load_failure_policy"] == "recompute"
    assert "kv_load_failure_policy" not in kv_transfer_config()
    faulted = faulted_kv_transfer_config([{"name": "redirect_block_table"}], on_violation="abort")
    assert faulted["kv_load_failure_policy"] == "fail"


def test_abort_fails_the_requests_that_read_corrupted_kv_and_serves_the_rest(reference, aborted):
    assert {e["name"] for e in aborted["ledger"]} == {"redirect_block_table", "flip_cached_block_byte"}
    injected = _injected(aborted)
    assert len(injected) == 2
    errored = {i for i, reasons in enumerate(aborted["finish_reasons"]) if "error" in reasons}
    assert injected <= errored
    # the reason: the canary's violations of that request (log, JSON lines, metrics; vLLM attaches no
    # kv_transfer_params to an output that finished with an error, so there is no per-request verdict there)
    for e in aborted["ledger"]:
        assert any(v["request_id"] == e["request_id"] for v in aborted["violations"])
    # the engine kept serving: every other request ran to its length, as in the run without faults
    for i, reasons in enumerate(aborted["finish_reasons"]):
        if i not in errored:
            assert reasons == reference["finish_reasons"][i] == ["length"] * len(reasons)
            assert [len(t) for t in aborted["tokens"][i]] == [len(t) for t in reference["tokens"][i]]
    assert len(errored) < len(aborted["finish_reasons"]) // 2


def test_recompute_reruns_the_corrupted_blocks_and_every_request_finishes(reference, recomputed):
    assert {e["name"] for e in recomputed["ledger"]} == {"redirect_block_table", "flip_cached_block_byte"}
    assert recomputed["metrics"]["kv_canary_violations"] > 0
    assert all(r == ["length"] * len(r) for r in recomputed["finish_reasons"])
    for i in _injected(recomputed):
        assert recomputed["verdicts"][i]["violations"] > 0
    # detection in the forward that read the corrupted KV (on the CPU violations drain every step): vLLM drops that
    # step's token and recomputes the blocks, so every output is the one of the run without faults
    assert recomputed["tokens"] == reference["tokens"]


def test_on_violation_is_validated():
    from kvcanary.engines.vllm.connector import canary_options

    class Ktc:
        def __init__(self, extra):
            self.kv_connector_extra_config = {"kvcanary": extra}

    with pytest.raises(ValueError, match="^kv-canary: vLLM option on_violation must be one of"):
        canary_options(Ktc({"on_violation": "ignore"}))
    with pytest.raises(ValueError, match="contradict"):
        canary_options(Ktc({"on_violation": "abort", "mode": "raise"}))
    config, adapter = canary_options(Ktc({"on_violation": "raise"}))
    assert config.mode == "raise" and adapter["on_violation"] == "raise"


def test_boolean_adapter_options_are_validated():
    from kvcanary.engines.vllm.connector import canary_options

    class Ktc:
        def __init__(self, extra):
            self.kv_connector_extra_config = {"kvcanary": extra}

    for key in ("capture_canary", "check_after_forward"):
        with pytest.raises(ValueError, match=f"^kv-canary: vLLM option {key} must be true or false, got 'no'"):
            canary_options(Ktc({key: "no"}))
        config, adapter = canary_options(Ktc({key: False}))
        assert adapter[key] is False and not hasattr(config, key)
