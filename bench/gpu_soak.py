"""Soak: as many simulated forwards as a time budget allows, canary on, zero violations expected.

Two simulated engines run back to back: full attention, and full + sliding
window (own slot space, full->swa LUT). Small pools force prefix-cache eviction and retraction; the
workload shares system prompts (prefix hits) and aborts requests. The canary runs in ``log`` mode with
PARTIAL hashing, a rotating sweep (a full pass every ``--sweep-interval`` forwards) and, on CUDA, its
per-forward work captured in CUDA graphs. At the end an explicit sweep verifies every live slot.

    python bench/gpu_soak.py [--seconds 420] [--json PATH]

``--seconds`` is the wall budget of the whole run, set-up included (Triton compiles and graph captures take
~50-65 s per engine on an H200): after its set-up each engine runs for an equal share of what is left, so a
stage limit a little above ``--seconds`` never cuts the last engine before its summary (run 21 lost one so).
"""
from __future__ import annotations

import argparse
import json
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


def soak(name: str, budget_end: float, share: float, *, device: str, graphs: bool, sweep_interval: int, seed: int,
         deep: bool = False) -> dict:
    """Run engine ``name`` for ``share`` of the time left before ``budget_end`` (perf_counter) after its set-up."""
    t_setup = time.perf_counter()
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
    bar = tqdm(desc=f"soak {name}", unit="fwd", file=sys.stderr, mininterval=5)
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
        engine=name, setup_s=setup_s, deep_fingerprints=deep, forwards=engine.forwards, seconds=elapsed, forwards_per_s=engine.forwards / elapsed,
        violations=counters["total"], checked_forwards=counters["checked_forwards"],
        sweep_passes=stats.sweep_passes, last_pass=stats.last_pass, final_sweep_live=report.live,
        final_sweep_verified=report.verified, final_sweep_complete=report.complete,
        slots_verified=stats.slots_verified, slots_written=stats.slots_written, sweep_stale=stats.sweep_stale,
        prefix_hit_tokens=engine.cache_hit_tokens, evicted_blocks=engine.evicted_blocks,
        retracted=engine.retracted, aborted=engine.aborted, finished=engine.finished, graphs=graphs,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=420.0,
                    help="wall budget of the whole run, set-up included, shared by the two engines")
    ap.add_argument("--sweep-interval", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--deep-fingerprints", action="store_true", help="CanaryConfig(deep_fingerprints=True)")
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    graphs = cuda and not args.no_graphs
    machine = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"# kvcanary soak on the simulated engine: {machine}, torch {torch.__version__}, graphs={graphs}")
    rows = []
    budget_end = time.perf_counter() + args.seconds
    for i, name in enumerate(ENGINES):  # each row printed as soon as it is known (a cut-short run still reports)
        r = soak(name, budget_end, 1.0 / (len(ENGINES) - i), device=device, graphs=graphs,
                 sweep_interval=args.sweep_interval, seed=args.seed, deep=args.deep_fingerprints)
        rows.append(r)
        print(f"# {name}: {r['forwards']} forwards in {r['seconds']:.1f} s ({r['forwards_per_s']:.0f}/s) after "
              f"{r['setup_s']:.1f} s of setup; violations {r['violations']}; final sweep complete: "
              f"{r['final_sweep_complete']}", flush=True)
    print(f"{'engine':>15} {'forwards':>9} {'fwd/s':>7} {'viol':>5} {'checked':>9} {'passes':>6} "
          f"{'final sweep live/verified':>26} {'hits':>7} {'evict':>6} {'retract':>7} {'abort':>6}")
    for r in rows:
        live = "+".join(str(v) for v in r["final_sweep_live"].values())
        ver = "+".join(str(v) for v in r["final_sweep_verified"].values())
        print(f"{r['engine']:>15} {r['forwards']:>9} {r['forwards_per_s']:>7.0f} {r['violations']:>5} "
              f"{r['checked_forwards']:>9} {r['sweep_passes']:>6} {live + ' / ' + ver:>26} {r['prefix_hit_tokens']:>7} "
              f"{r['evicted_blocks']:>6} {r['retracted']:>7} {r['aborted']:>6}")
    total = sum(r["forwards"] for r in rows)
    print(f"# total {total} forwards, {sum(r['violations'] for r in rows)} violations")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
