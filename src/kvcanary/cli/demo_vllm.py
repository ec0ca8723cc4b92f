"""`kvcanary demo --engine vllm`: the canary in a vLLM engine, clean and with injected faults.

Same table as the transformers demo. Three engine runs of one workload on a tiny random Llama
(`kvcanary.faults.vllm_workload`: prefix hits, chunked prefill, preemption and eviction in a
cramped KV cache), each in a fresh process: without the canary (reference outputs), with it (clean),
and with it plus the fault-injecting connector, which fires two faults in the worker:

* ``redirect_block_table`` — one block-table entry of a running request points at another of its
  blocks for one forward (expected: ``verify_position`` against that request, before the forward);
* ``flip_cached_block_byte`` — one bit of a cached prefix block's K bytes flips just before a new
  request reuses the block (expected: ``verify_real_kv_hash`` against that request).

Needs the vLLM venv (``bash scripts/setup_vllm.sh``; then ``.venv-vllm/bin/kvcanary demo --engine vllm``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

from kvcanary.cli.tables import fault_lines
from kvcanary.errors import KvCanaryRuntimeError

def _run(mode: str, workdir: str, seed: int, processes: bool) -> dict:
    out = os.path.join(workdir, f"{mode}.result.json")
    cmd = [sys.executable, "-m", "kvcanary.faults.vllm_workload", mode, workdir, out, "--seed", str(seed)]
    if processes:
        cmd.append("--processes")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KvCanaryRuntimeError(f"kv-canary: the vLLM {mode} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out, encoding="utf-8") as fh:
        return json.load(fh)


def match(injection: dict, violations: list[dict]) -> Optional[dict]:
    """The first violation detecting ``injection``: at or after its forward, on its slot or charged to
    its request, with an expected reason (at the earliest step, one charged to the request wins)."""
    hits = []
    for v in violations:
        labels = set(v["fail_reason"].split("+"))
        if v["step"] < injection["forward"] or not labels & set(injection["expected"]):
            continue
        if v["slot"] == injection["slot"] or v["request_id"] == injection["request_id"]:
            hits.append((v["step"], v["request_id"] != injection["request_id"], v, labels))
    if not hits:
        return None
    step, _, v, labels = min(hits, key=lambda h: (h[0], h[1]))
    return {"reasons": sorted(labels), "request": v["request_id"], "latency_forwards": step - injection["forward"],
            "step": step, "tag": v["launch_tag"]}


def _summary(run: dict) -> dict:
    m = run["metrics"]
    return {"forwards": m.get("kv_canary_forwards", 0), "slots_verified": m.get("kv_canary_slots_verified", 0),
            "violations": m.get("kv_canary_violations", 0), "by_reason": dict(m.get("by_reason", {})),
            "prefix_hits": m.get("kv_canary_prefix_hits", 0), "chunked_prefills": m.get("kv_canary_chunked_prefills", 0),
            "preemptions": m.get("num_preemptions", 0), "slots_reused": m.get("kv_canary_slots_reused", 0)}


RUNS = (("ref", "without the canary (reference outputs)"), ("clean", "with the canary"),
        ("faults", "with the canary and two injected faults"))


def run_demo(*, seed: int = 0, processes: bool = False, workdir: Optional[str] = None,
             progress: Optional[Callable[[str], None]] = None) -> dict:
    """Run the three engines; the JSON-ready result (`format_table` prints it). ``progress(line)`` is
    called before each run and after it (each takes about a minute on a small CPU)."""
    from kvcanary.engines.vllm import check_vllm_version

    version = check_vllm_version()
    t0 = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = workdir or tmp
        for k, (mode, what) in enumerate(RUNS, 1):
            if progress is not None:
                progress(f"vLLM run {k}/{len(RUNS)}: {what} ...")
            t = time.perf_counter()
            runs.append(_run(mode, work, seed, processes))
            if progress is not None:
                progress(f"vLLM run {k}/{len(RUNS)} done in {time.perf_counter() - t:.0f} s")
    device = _device()
    return summarize(*runs, engine=f"vllm {version} ({device})", processes=processes,
                     seconds=round(time.perf_counter() - t0, 2), device=device)


def _device() -> str:
    """``cuda`` where vLLM runs on a GPU (its defaults there: CUDA graphs, FlashAttention), else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def summarize(reference: dict, clean: dict, faulted: dict, *, engine: str, processes: bool, seconds: float,
              device: str = "cpu") -> dict:
    """The demo result from the three runs' outputs (`kvcanary.faults.vllm_workload.run_engine`)."""
    summary = _summary(clean)
    summary["outputs_identical"] = clean["tokens"] == reference["tokens"]
    result = {"engine": engine, "device": device, "processes": processes,
              "models": {"llama": {"clean": summary}},
              "clean": {k: summary[k] for k in ("forwards", "slots_verified", "violations")}, "faults": []}
    violations = faulted["violations"]
    for inj in faulted["ledger"]:
        found = match(inj, violations)
        result["faults"].append({
            "name": f"llama/{inj['name']}", "caught": found is not None,
            "reasons": found["reasons"] if found else [], "request": found["request"] if found else None,
            "latency_forwards": found["latency_forwards"] if found else None, "injected": inj,
            "violations_in_run": len(violations),
        })
    fired = {inj["name"] for inj in faulted["ledger"]}
    for name in ("redirect_block_table", "flip_cached_block_byte"):
        if name not in fired:
            result["faults"].append({"name": f"llama/{name}", "caught": False, "reasons": [], "request": None,
                                     "latency_forwards": None, "injected": None, "violations_in_run": len(violations)})
    result["seconds"] = seconds
    return result


def format_table(result: dict) -> str:
    lines = [f"kvcanary demo on {result['engine']}, {'engine-core + worker processes' if result['processes'] else 'one process (engine core stepped in-process)'} "
             f"({result['seconds']} s)", ""]
    lines.append(f"{'model':<11} {'forwards':>8} {'slots verified':>15} {'violations':>10}  outputs identical")
    for kind, r in result["models"].items():
        c = r["clean"]
        lines.append(f"{kind:<11} {c['forwards']:>8} {c['slots_verified']:>15} {c['violations']:>10}  "
                     f"{'yes' if c['outputs_identical'] else 'NO'}")
        lines.append(f"{'':<11}   prefix hits {c['prefix_hits']}, chunked prefills {c['chunked_prefills']}, "
                     f"preemptions {c['preemptions']}, slots reused {c['slots_reused']}")
        for reason, n in sorted(c["by_reason"].items()):
            lines.append(f"{'':<11}   {reason}: {n}")
    lines += ["", *fault_lines(result["faults"], request_width=12, forward_key="forward")]
    return "\n".join(lines)
