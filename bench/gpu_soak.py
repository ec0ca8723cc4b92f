"""Soak: as many simulated forwards as a time budget allows, canary on, zero violations expected.

Two simulated engines: full attention, and full + sliding window (own slot space, full->swa LUT). By
default they run back to back in this process; ``--workers N`` runs N processes at once instead (worker i runs
engine i mod 2 with seed ``seed + i // 2``), each with its own canary on the same device and the whole budget.
Measured on one H200 (docs/lab/NOTES.md runs 25-26), N processes sharing the GPU ran *slower in total* than one
process alone (4 workers: 150 forwards/s together against 379/s for one), so the default stays one process. Small pools force prefix-cache eviction and retraction; the
workload shares system prompts (prefix hits) and aborts requests. The canary runs in ``log`` mode with
PARTIAL hashing, a rotating sweep (a full pass every ``--sweep-interval`` forwards) and, on CUDA, its
per-forward work captured in CUDA graphs. At the end an explicit sweep verifies every live slot.

    python bench/gpu_soak.py [--seconds 420] [--workers N] [--json PATH]

``--seconds`` is the wall budget of the whole run, set-up included (Triton compiles and graph captures take
~50-65 s per engine on an H200): after its set-up each engine runs for an equal share of what is left, so a
stage limit a little above ``--seconds`` never cuts the last engine before its summary (run 21 lost one so).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

import torch
from tqdm import tqdm

from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload
from kvcanary.runtime import Canary, CanaryConfig

ENGINES = {
    "full": dict(num_slots=4096, max_requests=48, max_context=512, chunk_size=64, max_batch_tokens=256,
                 max_running=24, block_size=8),
    "sliding_window": dict(num_slots=4096, swa_num_slots=1024, sliding_window=48, max_requests=48, max_context=512,
                           chunk_size=64, max_batch_tokens=256, max_running=24, block_size=8),
}


def soak(name: str, deadline: float, share: float, *, device: str, graphs: bool, sweep_interval: int, seed: int,
         deep: bool = False) -> dict:
    """Run engine ``name`` for ``share`` of the time left before ``deadline`` (``time.time()``, so that child
    processes share it) after its set-up."""
    t_setup = time.perf_counter()
    budget_end = t_setup + (deadline - time.time())
    sc = SimConfig(**ENGINES[name], seed=seed, device=device)
    canary = Canary(CanaryConfig(mode="log", sweep_interval=sweep_interval, health_interval=64, readable_per_step=0,
                                 deep_fingerprints=deep),
                    groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                    max_batch_tokens=sc.max_batch_tokens, device=device)
    engine = SimEngine(sc, canary)
    stream = SimWorkload(seed=seed, abort_prob=0.03, new_tokens=(1, 120)).stream(sc.max_context)
    while engine.step() is None:  # one forward first: graphs read the engine's tables
        for prompt, new in next(stream):
            engine.add_request(prompt, new)
    if graphs:
        canary.capture_graphs()
    rng = engine.rng
    start = time.perf_counter()
    setup_s = start - t_setup
    seconds = max(0.0, (budget_end - start) * share)
    bar = tqdm(desc=f"soak {name} seed {seed}", unit="fwd", file=sys.stderr, mininterval=5)
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            for prompt, new in next(stream):
                engine.add_request(prompt, new)
            if engine.running and rng.random() < 0.03:
                engine.abort(rng.choice(engine.running))
            engine.step()
        bar.update(100)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    bar.close()
    report = canary.sweep()
    stats = canary.close()
    counters = canary.counters()
    return dict(
        engine=name, seed=seed, setup_s=setup_s, deep_fingerprints=deep, forwards=engine.forwards, seconds=elapsed, forwards_per_s=engine.forwards / elapsed,
        violations=counters["total"], checked_forwards=counters["checked_forwards"],
        sweep_passes=stats.sweep_passes, last_pass=stats.last_pass, final_sweep_live=report.live,
        final_sweep_verified=report.verified, final_sweep_complete=report.complete,
        slots_verified=stats.slots_verified, slots_written=stats.slots_written, sweep_stale=stats.sweep_stale,
        prefix_hit_tokens=engine.cache_hit_tokens, evicted_blocks=engine.evicted_blocks,
        retracted=engine.retracted, aborted=engine.aborted, finished=engine.finished, graphs=graphs,
    )


def _worker(kwargs: dict, results) -> None:
    """One soak in a child process; its row (or its error) goes back through ``results``."""
    try:
        results.put(soak(**kwargs))
    except BaseException as exc:  # reported by the parent, never lost
        results.put({"engine": kwargs["name"], "seed": kwargs["seed"], "error": f"{type(exc).__name__}: {exc}"})


def _print_row(r: dict) -> None:
    if "error" in r:
        print(f"# {r['engine']} seed {r['seed']}: FAILED: {r['error']}", flush=True)
        return
    print(f"# {r['engine']} seed {r['seed']}: {r['forwards']} forwards in {r['seconds']:.1f} s ({r['forwards_per_s']:.0f}/s) "
          f"after {r['setup_s']:.1f} s of setup; violations {r['violations']}; final sweep complete: "
          f"{r['final_sweep_complete']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=420.0,
                    help="wall budget of the whole run, set-up included, shared by the two engines")
    ap.add_argument("--sweep-interval", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--deep-fingerprints", action="store_true", help="CanaryConfig(deep_fingerprints=True)")
    ap.add_argument("--workers", type=int, default=0,
                    help="run this many soak processes at once (engine i mod 2, seed + i // 2); 0: back to back here")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.workers < 0:
        ap.error("--workers must be >= 0")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    graphs = cuda and not args.no_graphs
    machine = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"# kvcanary soak on the simulated engine: {machine}, torch {torch.__version__}, graphs={graphs}")
    rows = []
    deadline = time.time() + args.seconds
    common = dict(device=device, graphs=graphs, sweep_interval=args.sweep_interval, deep=args.deep_fingerprints)
    names = list(ENGINES)
    if args.workers:
        ctx = mp.get_context("spawn")  # CUDA in children needs spawn
        results = ctx.Queue()
        procs = []
        for i in range(args.workers):
            kwargs = dict(name=names[i % len(names)], deadline=deadline, share=1.0, seed=args.seed + i // len(names),
                          **common)
            proc = ctx.Process(target=_worker, args=(kwargs, results))
            proc.start()
            procs.append(proc)
        for _ in procs:
            r = results.get()
            rows.append(r)
            _print_row(r)
        for proc in procs:
            proc.join()
    else:
        for i, name in enumerate(names):  # each row printed as soon as it is known (a cut-short run still reports)
            r = soak(name, deadline, 1.0 / (len(names) - i), seed=args.seed, **common)
            rows.append(r)
            _print_row(r)
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    print(f"{'engine':>15} {'seed':>4} {'forwards':>9} {'fwd/s':>7} {'viol':>5} {'checked':>9} {'passes':>6} "
          f"{'final sweep live/verified':>26} {'hits':>7} {'evict':>6} {'retract':>7} {'abort':>6}")
    for r in rows:
        live = "+".join(str(v) for v in r["final_sweep_live"].values())
        ver = "+".join(str(v) for v in r["final_sweep_verified"].values())
        print(f"{r['engine']:>15} {r['seed']:>4} {r['forwards']:>9} {r['forwards_per_s']:>7.0f} {r['violations']:>5} "
              f"{r['checked_forwards']:>9} {r['sweep_passes']:>6} {live + ' / ' + ver:>26} {r['prefix_hit_tokens']:>7} "
              f"{r['evicted_blocks']:>6} {r['retracted']:>7} {r['aborted']:>6}")
    total = sum(r["forwards"] for r in rows)
    print(f"# total {total} forwards, {sum(r['violations'] for r in rows)} violations"
          + (f"; {len(failed)} worker(s) FAILED" if failed else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "torch": torch.__version__, "workers": args.workers, "rows": rows,
                       "failed": failed}, f, indent=1)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
