"""Canary time per forward on the simulated engine, against batch size and context length.

Each case fills ``bs`` requests with ``ctx`` cached tokens, then times the canary's work for one
decode step (stage + plan + HEAD verify/write + TAIL verify/write, PARTIAL hashing of the first
and last layer's K and V — the default config) by replaying that step's BatchDescription; a
sweep over every live slot is timed too. Runs on CUDA when available (same script), else CPU.

    python bench/runtime_overhead.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from tqdm import tqdm

from kvcanary.engines.sim import SimConfig, SimEngine
from kvcanary.runtime import Canary, CanaryConfig


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn, reps: int) -> float:
    fn()
    _sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def case(bs: int, ctx: int, reps: int) -> dict:
    sc = SimConfig(num_slots=bs * (ctx + 40) + 8, max_requests=bs + 1, max_context=ctx + 40, chunk_size=ctx,
                   max_batch_tokens=max(ctx, 8192), max_running=bs, num_layers=4, kv_bytes=256, seed=0)
    canary = Canary(CanaryConfig(sweep_interval=0, health_interval=0, readable_per_step=0),
                    groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context)
    engine = SimEngine(sc, canary)
    for i in range(bs):
        engine.add_request([1 + (7 * i + j) % 31000 for j in range(ctx)], max_new=32, rid=f"b{i}")  # none finishes while timed
    batch = engine.step()
    while batch is None or batch.forward_kind != "decode":
        batch = engine.step()

    def step() -> None:
        canary.before_forward(batch)
        canary.after_forward()

    ms = _median_ms(step, reps)
    live = engine.live_slots()
    sweep_ms = _median_ms(lambda: canary.sweep(live), max(3, reps // 3))
    assert canary.counters()["total"] == 0
    group = canary.groups["full"]
    return dict(bs=bs, ctx=ctx, entries=bs * ctx, ms=ms, sweep_ms=sweep_ms, live=int(live["full"].numel()),
                per_slot=group.memory_bytes() / group.num_slots, total_mib=canary.memory_bytes() / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid")
    args = ap.parse_args()
    batches = (1, 8) if args.quick else (1, 8, 32)
    contexts = (256, 1024) if args.quick else (256, 1024, 4096)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else (
        f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), "
        f"{torch.get_num_threads()} torch threads")
    print(f"# kvcanary runtime overhead (simulated engine, decode step, mode=log, real_kv_hash=partial,")
    print(f"#   layers first+last K/V = 4 sources of 256 B/token)")
    print(f"# machine: {device}; torch {torch.__version__}; python {sys.version.split()[0]}")
    print(f"{'bs':>4} {'ctx':>6} {'verify entries':>14} {'canary ms/step':>15} {'us/entry':>9} "
          f"{'sweep ms':>9} {'live slots':>10} {'B/slot':>7} {'canary MiB':>10}")
    rows = []
    for bs in tqdm(batches, desc="batch sizes", file=sys.stderr):
        for ctx in contexts:
            r = case(bs, ctx, reps=5 if bs * ctx > 50_000 else 10)
            rows.append(r)
            print(f"{r['bs']:>4} {r['ctx']:>6} {r['entries']:>14} {r['ms']:>15.2f} {r['ms'] * 1e3 / r['entries']:>9.3f} "
                  f"{r['sweep_ms']:>9.2f} {r['live']:>10} {r['per_slot']:>7.0f} {r['total_mib']:>10.2f}", flush=True)
    print("# B/slot: HEAD + TAIL_K + TAIL_V records (32 B each) + write-time slot records (32 B), per group slot;")
    print("# canary MiB adds verify plans sized from the engine limits and the violation rings.")


if __name__ == "__main__":
    main()
