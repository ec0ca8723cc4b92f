"""What timing jitter (docs/design.md §4.9) adds to the canary's per-forward device work: HEAD and TAIL time per decode
step on the simulated engine, with jitter off and at a few fire probabilities.

Each case fills ``bs`` requests with ``ctx`` cached tokens on the GPU, then replays that decode step through the
canary's split API (``begin_step``, ``stage``, ``launch_head``, ``launch_tail``, ``end_step``) with CUDA events around
``launch_head`` and ``launch_tail``. The device time is measured as `bench/runtime_overhead.py` does: a sleep kernel
holds the stream while the host enqueues a few steps, so the events time the device work alone, not the host's pace.
The sweep is off (``sweep_interval=0``: the slice never stalls, and it would blur the HEAD number); real-KV hashing
is the default (PARTIAL, first and last layer). ``--graphs`` replays the canary's own CUDA graphs instead of eager
launches (the draws read the device step, so a replayed graph stalls other entries each step).

Columns: jitter fire probability (``off`` = ``jitter_fire_prob=0``, the kernels compiled without the jitter branch),
HEAD and TAIL device us per step, their sum, the added time against ``off`` (us and %), stalls and stall cycles
drawn per step (`CanaryStats.jitter_stalls` / ``jitter_cycles``), and the wall time per step (host + device).

    python bench/jitter_cost.py [--quick] [--graphs] [--max-cycles N] [--json PATH]

On a machine without CUDA the same cases run on the torch twins, whose stalls really wait on the host (1 ns per
cycle, ``kvcanary.ops.reference.jitter``): HEAD and TAIL are timed with the host clock (the twins are synchronous),
so the columns are host microseconds, not GPU time. ``--graphs`` needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

PROBS = (0.0, 0.001, 0.01, 0.1)
WARMUP_S = 3.0


def case(bs: int, ctx: int, prob: float, *, max_cycles: int, graphs: bool, rounds: int, device: str = "cuda") -> dict:
    from kvcanary.engines.sim import SimConfig, SimEngine
    from kvcanary.runtime import Canary, CanaryConfig
    from kvcanary.runtime.staging import MIRRORS

    sc = SimConfig(num_slots=bs * (ctx + 160) + 8, max_requests=bs + 1, max_context=ctx + 160, chunk_size=ctx,
                   max_batch_tokens=max(ctx, 8192), max_running=bs, num_layers=4, kv_bytes=256, seed=0, device=device)
    cfg = CanaryConfig(sweep_interval=0, health_interval=0, readable_per_step=0, jitter_fire_prob=prob,
                       jitter_max_cycles=max_cycles, jitter_seed=1)
    canary = Canary(cfg, groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                    max_batch_tokens=sc.max_batch_tokens, device=device)
    engine = SimEngine(sc, canary)
    for i in range(bs):
        engine.add_request([1 + (7 * i + j) % 31000 for j in range(ctx)], max_new=120, rid=f"b{i}")
    batch = engine.step()
    while batch is None or batch.forward_kind != "decode":
        batch = engine.step()
    if graphs:
        canary.capture_graphs()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = list(batch.request_ids)

    def step(events=None) -> None:
        canary.begin_step(request_ids=ids, forward_kind="decode")
        canary.stage(batch)
        if events is not None:
            events[0].record()
        canary.launch_head()
        if events is not None:
            events[1].record()
        canary.launch_tail()
        if events is not None:
            events[2].record()
        canary.end_step()

    t_warm = time.perf_counter()
    while time.perf_counter() - t_warm < WARMUP_S:
        for _ in range(5):
            step()
        sync()
    before = canary.stats()
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    sync()
    wall_us = (time.perf_counter() - t0) / reps * 1e6
    n = MIRRORS - 1  # steps enqueued behind the sleep kernel (fewer than the staging mirrors: the host never waits)
    head = tail = 0.0
    if device == "cpu":  # the twins run synchronously on the host: host time is the work (stalls included)
        n = 10
        for _ in range(rounds * n):
            canary.begin_step(request_ids=ids, forward_kind="decode")
            canary.stage(batch)
            t1 = time.perf_counter()
            canary.launch_head()
            t2 = time.perf_counter()
            canary.launch_tail()
            t3 = time.perf_counter()
            canary.end_step()
            head, tail = head + (t2 - t1) * 1e6, tail + (t3 - t2) * 1e6
    for _ in range(rounds if device == "cuda" else 0):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4 * n * wall_us * 2000) + 2_000_000)  # ~2 cycles per ns: longer than the host enqueue
        marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]
        for ev in marks:
            step(ev)
        torch.cuda.synchronize()
        for e0, e1, e2 in marks:
            head += e0.elapsed_time(e1) * 1e3
            tail += e1.elapsed_time(e2) * 1e3
    after = canary.stats()
    steps = after.forwards - before.forwards
    assert after.violations == 0, after.line()
    return dict(bs=bs, ctx=ctx, prob=prob, max_cycles=max_cycles, variant="graphs" if graphs else "eager",
                head_us=head / (n * rounds), tail_us=tail / (n * rounds), wall_us=wall_us,
                stalls_per_step=(after.jitter_stalls - before.jitter_stalls) / steps,
                cycles_per_step=(after.jitter_cycles - before.jitter_cycles) / steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small and one large case")
    ap.add_argument("--graphs", action="store_true", help="replay the canary's own CUDA graphs (default: eager launches)")
    ap.add_argument("--max-cycles", type=int, default=2000, help="CanaryConfig.jitter_max_cycles (default 2000)")
    ap.add_argument("--probs", default=",".join(str(p) for p in PROBS), help="fire probabilities (0 = off), comma list")
    ap.add_argument("--grid", help="cases as BSxCTX,... (default: 8x1024, 64x4096)")
    ap.add_argument("--rounds", type=int, default=20, help="sleep-held rounds per case for the device time")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--machine", default="host CPU", help="what to call the machine on the CPU path (cores, load)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.graphs:
        print("# jitter_cost: --graphs needs a CUDA GPU. Nothing run.")
        return 0
    probs = [float(p) for p in args.probs.split(",")]
    grid = [(8, 1024), (64, 4096)] if not args.quick else [(1, 256), (64, 4096)]
    if args.grid:
        grid = [tuple(int(v) for v in c.split("x")) for c in args.grid.split(",")]
    machine = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({args.machine})"
    variant = "graphs" if args.graphs else "eager"
    print(f"# kvcanary timing jitter: HEAD / TAIL {'device' if device == 'cuda' else 'host (torch twins)'} time per decode step (simulated engine, {variant}, sweep off,")
    print(f"#   real_kv_hash=partial, jitter_max_cycles={args.max_cycles}); machine: {machine}; torch {torch.__version__}; "
          f"python {sys.version.split()[0]}")
    print(f"{'bs':>4} {'ctx':>6} {'prob':>6} {'head us':>8} {'tail us':>8} {'sum us':>8} {'added us':>9} {'added %':>8} "
          f"{'stalls/step':>11} {'cycles/step':>12} {'wall us':>8}")
    rows = []
    for bs, ctx in grid:
        base = None
        for prob in probs:
            r = case(bs, ctx, prob, max_cycles=args.max_cycles, graphs=args.graphs, rounds=args.rounds, device=device)
            rows.append(r)
            total = r["head_us"] + r["tail_us"]
            if base is None and prob == 0.0:
                base = total
            added = f"{total - base:>+9.1f} {100 * (total - base) / base:>+7.1f}%" if base else f"{'-':>9} {'-':>8}"
            print(f"{bs:>4} {ctx:>6} {'off' if prob == 0 else f'{prob:g}':>6} {r['head_us']:>8.1f} {r['tail_us']:>8.1f} "
                  f"{total:>8.1f} {added} {r['stalls_per_step']:>11.1f} {r['cycles_per_step']:>12.0f} {r['wall_us']:>8.1f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
