"""Shared by the vLLM engine tests: one engine run per process (`kvcanary.faults.vllm_workload`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def run_workload(mode: str, tmp_path_factory, *extra: str, runner: str = "default") -> dict:
    """``python -m kvcanary.faults.vllm_workload MODE ...`` in a fresh process; its JSON result. ``runner="v2"``: on
    vLLM's V2 model runner on the CPU, vLLM's Triton kernels interpreted (`v2_runner_cpu`)."""
    work = tmp_path_factory.mktemp(f"vllm-{mode}")
    out = work / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    command = [sys.executable, "-m", "kvcanary.faults.vllm_workload"]
    if runner == "v2":
        env.update(VLLM_USE_V2_MODEL_RUNNER="1", TRITON_INTERPRET="1")
        command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "v2_runner_cpu.py")]
    proc = subprocess.run([*command, mode, str(work), str(out), *extra], env=env, capture_output=True, text=True,
                          timeout=420)
    dump = os.environ.get("KVC_WORKLOAD_DUMP")  # a folder: each run's result and stderr kept there (device calls)
    if dump:
        os.makedirs(dump, exist_ok=True)
        stem = os.path.join(dump, f"{mode}-{'_'.join(a.strip('-') for a in extra)[:80] or 'default'}")
        with open(stem + ".stderr.txt", "w") as f:
            f.write(proc.stderr[-200_000:])
        if out.exists():
            with open(stem + ".json", "w") as f:
                f.write(out.read_text())
    if proc.returncode != 0:
        pytest.fail(f"engine run {mode!r} {extra} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def run_experiment(what: str, tmp_path_factory, *extra: str, timeout: int = 900) -> dict:
    """``python -m kvcanary.faults.vllm_experiments WHAT WORKDIR OUT.json ...`` in a fresh process; its JSON result."""
    work = tmp_path_factory.mktemp(f"vllm-{what}")
    out = work / f"{what}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run([sys.executable, "-m", "kvcanary.faults.vllm_experiments", what, str(work), str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{what} runs failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def ci_config(seed: int) -> dict:
    """The vLLM fuzzer's configuration for CI seed ``seed``, trimmed to four requests of at most 8 new tokens."""
    import random

    from kvcanary.faults.fuzz import vllm as fuzz

    config = fuzz.sample_config(random.Random(f"vllm-ci:{seed}"))
    config["requests"] = [dict(r, max_tokens=min(r["max_tokens"], 8)) for r in config["requests"][:4]]
    config["aborts"] = [a for a in config["aborts"] if a[0] < 4]
    return config


def assert_clean_outcome(o: dict) -> None:
    """A fuzzer outcome: no error, silent, identical tokens, every forward checked; a fired fault caught against the
    right request."""
    assert o["error"] is None, f"{o['error']}\n{o['reproducer']}"
    assert o["violations"] == 0 and not o["false_positive"], f"{o['first_violations']}\n{o['reproducer']}"
    assert o["tokens_identical"], o["reproducer"]
    assert o["engine_forwards"] == o["checked_forwards"] > 0, o["reproducer"]
    if o["fault"] and o["fault"]["fired"]:
        assert o["fault"]["caught"] and o["fault"]["right_request"], f"{o['fault']}\n{o['reproducer']}"


def head_filled(desc):
    """``desc`` (a `WorkerView.describe` result) after what the runtime's HEAD does with its groups' `BlockTable` and
    `RewriteCounter` (the same op, `launch_block_table_slots_kernel` to each row's length, and the written-slot marks),
    for unit tests that read the view's tables without a canary."""
    seq = (desc.prefix_lens + desc.extend_lens).to(torch.int64)
    from kvcanary.ops.paged import launch_block_table_slots_kernel, launch_mark_written_slots_kernel

    for gb in desc.groups.values():
        if gb.block_table is not None:
            bt = gb.block_table
            launch_block_table_slots_kernel(block_table=bt.table, rows=desc.req_pool_indices.to(torch.int64), seq_lens=seq,
                                            block_size=bt.block_size, width=None, table_out=gb.req_to_token,
                                            drop_null=bt.drop_null)
        if gb.rewrites is not None:
            launch_mark_written_slots_kernel(slots=gb.out_cache_loc, ever_written=gb.rewrites.ever_written,
                                             rewritten=gb.rewrites.rewritten)
    return desc


def detection(injection: dict, violations: list[dict]) -> list[dict]:
    """Violations at the injection's forward, charged to the injected request, with an expected reason."""
    return [v for v in violations
            if v["step"] == injection["forward"] and v["request_id"] == injection["request_id"]
            and set(v["fail_reason"].split("+")) & set(injection["expected"])]


def assert_both_faults_caught(faulted: dict) -> None:
    """The default fault plan's run (`kvcanary.faults.vllm_workload.FAULT_PLAN`): the redirected entry caught by HEAD
    on the block read instead, the flipped bit by TAIL on its slot, both against the injected request in the forward
    they were injected into, nothing before it, and the users' process sees it (metrics, verdicts)."""
    from kvcanary.faults.vllm_workload import BLOCK_SIZE

    ledger = {e["name"]: e for e in faulted["ledger"]}
    assert set(ledger) == {"redirect_block_table", "flip_cached_block_byte"}
    violations = faulted["violations"]
    redirect = ledger["redirect_block_table"]
    hits = detection(redirect, violations)
    assert any(v["launch_tag"] == "HEAD_K_FULL" for v in hits)  # HEAD, from the table the forward read
    # the block read instead (and the chain link out of it, into the next block of the request)
    assert redirect["slot"] // BLOCK_SIZE in {v["slot"] // BLOCK_SIZE for v in hits if "verify_position" in v["fail_reason"]}
    flip = ledger["flip_cached_block_byte"]
    hits = detection(flip, violations)
    assert {v["slot"] for v in hits if v["launch_tag"].startswith("TAIL_K")} == {flip["slot"]}
    # before the first injection the run is clean
    first = min(e["forward"] for e in faulted["ledger"])
    assert not [v for v in violations if v["step"] < first]
    # the user's process sees it: metrics and the injected requests' verdicts
    assert faulted["metrics"]["kv_canary_violations"] == len(violations) > 0
    by_id = dict(zip(faulted["request_ids"], faulted["verdicts"]))
    for e in (redirect, flip):
        parent = e["request_id"].split("-")[0]
        verdict = by_id.get(parent) or next(v for rid, v in by_id.items() if e["request_id"].endswith(rid))
        assert verdict["violations"] > 0
