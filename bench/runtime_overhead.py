"""Canary time per decode step on the simulated engine, against batch size and context length.

Each case fills ``bs`` requests with ``ctx`` cached tokens (pools and tables on the device), then replays
that decode step's BatchDescription through the canary — begin_step + stage + plan + HEAD verify/write +
TAIL verify/write (PARTIAL hashing of the first and last layer's K and V, the default) + row stamps + one
rotating sweep slice + the non-blocking drain poll — ``reps`` times back to back and divides the wall
time (one synchronize at the end: host and device work overlap as they do in serving). ``host us`` is the
Python time of those calls alone (the device work is asynchronous); ``device us`` (CUDA) is the device time
alone: a sleep kernel holds the stream while the host enqueues 3 steps (fewer than the staging ring's pinned
mirrors, so the host never waits on the held stream), then CUDA events time their execution; 20 such rounds.
``--host-phases`` adds the host time of each public call of a forward, and bare costs of a few CUDA calls.
``--ablate`` runs the last grid case again with one part off at a time (the sweep slice, the token checks, real-KV
hashing), so each part's share of the step shows as a difference in wall and device time, gaps included.
On CUDA two variants: ``eager`` (every launch from Python) and ``graphs`` (`Canary.capture_graphs`: HEAD /
TAIL / sweep replayed as CUDA graphs).
The engine's own forward is not run: this is the canary's cost alone.

    python bench/runtime_overhead.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Optional

import torch

from kvcanary.engines.sim import SimConfig, SimEngine
from kvcanary.runtime import Canary, CanaryConfig
from kvcanary.runtime.staging import MIRRORS

TARGET_US = 100.0  # docs/design.md §7 / issue 8: bs 64 x 4 k decode step, host + device, on the H200


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


ABLATIONS = (  # --ablate: CanaryConfig overrides, one part of the per-forward work off each
    ("no sweep slice", {"sweep_interval": 0}),
    ("no token checks", {"verify_token": False, "write_input_assert": False}),
    ("real_kv_hash=none", {"real_kv_hash": "none"}),
)
WARMUP_S = 3.0  # CUDA: seconds of steps before timing


def case(bs: int, ctx: int, *, device: str, graphs: bool, reps: int, profile: int = 0, deep: bool = False,
         kernel_profile: int = 0, host_phases: bool = False, overrides: Optional[dict] = None) -> dict:
    sc = SimConfig(num_slots=bs * (ctx + 160) + 8, max_requests=bs + 1, max_context=ctx + 160, chunk_size=ctx,
                   max_batch_tokens=max(ctx, 8192), max_running=bs, num_layers=4, kv_bytes=256, seed=0, device=device)
    cfg = dict(sweep_interval=64, health_interval=0, readable_per_step=0, deep_fingerprints=deep) | (overrides or {})
    canary = Canary(CanaryConfig(**cfg),
                    groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                    max_batch_tokens=sc.max_batch_tokens, device=device)
    engine = SimEngine(sc, canary)
    for i in range(bs):
        engine.add_request([1 + (7 * i + j) % 31000 for j in range(ctx)], max_new=120, rid=f"b{i}")  # none finishes while timed
    batch = engine.step()
    while batch is None or batch.forward_kind != "decode":
        batch = engine.step()
    if graphs:
        canary.capture_graphs()

    def step() -> None:
        canary.before_forward(batch)
        canary.after_forward()

    # warm-up by time, not count: runs 18 and 22 timed 64x4k as the first case of a fresh process after 5 steps
    # (GPU at idle clocks) and got ~400 us where run 17, third case, got 218
    t_warm = time.perf_counter()
    while True:
        for _ in range(5):
            step()
        _sync()
        if device != "cuda" or time.perf_counter() - t_warm >= WARMUP_S:
            break
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        step()
        host += time.perf_counter() - t
    _sync()
    wall = time.perf_counter() - t0
    device_us = None
    if device == "cuda":  # device time alone: a sleep kernel holds the stream while the host enqueues n steps
        # n < the staging ring's pinned mirrors: with more, the host waits for a mirror the held stream has not
        # released and the events time host-paced steps (the 598.9 us of run 35 with n = 30 and 4 mirrors)
        n, rounds, total = MIRRORS - 1, 20, 0.0
        for _ in range(rounds):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2 * n * (host / reps * 1e6) * 2000) + 2_000_000)  # cycles (~2 per ns): 2x the host time
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(n):
                step()
            e1.record()
            torch.cuda.synchronize()
            total += e0.elapsed_time(e1) * 1e3
        device_us = total / (n * rounds)
    if host_phases:
        print(host_phase_table(canary, batch, bs, ctx, graphs))
    if kernel_profile and device == "cuda":  # where the device time goes: every kernel / copy, summed over n steps
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        n = 20
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        busy = sum(getattr(e, key) for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / n
        print(f"# torch.profiler, {bs} x {ctx} {'graphs' if graphs else 'eager'}, {n} steps: device busy "
              f"{busy:.1f} us per step (kernels + copies, gaps excluded); top {kernel_profile} by device time:")
        print(events.table(sort_by=key, row_limit=kernel_profile, max_name_column_width=60))
    if profile:  # where the host time goes (after the timed loop: cProfile slows what it watches)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(reps):
            step()
        prof.disable()
        _sync()
        print(f"# cProfile, {bs} x {ctx} {'graphs' if graphs else 'eager'}, {reps} steps, top {profile} by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    counters = canary.counters()
    assert counters["total"] == 0, counters
    return dict(bs=bs, ctx=ctx, variant="graphs" if graphs else "eager", entries=bs * ctx,
                us=wall / reps * 1e6, host_us=host / reps * 1e6, device_us=device_us,
                checked=counters["checked_forwards"], forwards=canary.step, upload_waits=canary.static.upload_waits,
                mib=canary.memory_bytes() / 2**20)


def host_phase_table(canary: Canary, batch, bs: int, ctx: int, graphs: bool, steps: int = 400) -> str:
    """Host time per call of each phase of a forward (the public calls `before_forward` / `after_forward` make),
    perf_counter_ns around each, ``steps`` steps after the timed loop; plus bare costs for comparison."""
    names = ("begin_step", "stage", "launch_head", "launch_tail", "end_step")
    tot = dict.fromkeys(names, 0)
    clock = time.perf_counter_ns
    rows = batch.req_pool_indices
    waits0 = canary.static.upload_waits
    for _ in range(steps):
        t0 = clock()
        canary.begin_step(request_ids=batch.request_ids, request_rows=rows if rows.device.type == "cpu" else None,
                          forward_kind=batch.forward_kind)
        t1 = clock()
        canary.stage(batch)
        t2 = clock()
        canary.launch_head()
        t3 = clock()
        canary.launch_tail()
        t4 = clock()
        canary.end_step()
        t5 = clock()
        for name, a, b in zip(names, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            tot[name] += b - a
    _sync()
    waits = canary.static.upload_waits - waits0  # stages that waited for the device (their wait lands in "stage")
    bare = {}
    if torch.cuda.is_available():
        graph, x = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda")
        with torch.cuda.graph(graph):
            x.add_(1)
        for label, fn in (("empty-ish graph replay (1 node)", graph.replay), ("tensor fill_", lambda: x.fill_(3)),
                          ("torch.cuda.current_stream()", torch.cuda.current_stream),
                          ("is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)):
            for _ in range(50):
                fn()
            t = clock()
            for _ in range(steps):
                fn()
            bare[label] = (clock() - t) / steps / 1e3
        _sync()
    out = [f"# host phases, {bs} x {ctx} {'graphs' if graphs else 'eager'}, {steps} steps (us per call):"]
    out += [f"#   {name:<12} {tot[name] / steps / 1e3:7.1f}" for name in names]
    out.append(f"#   {'sum':<12} {sum(tot.values()) / steps / 1e3:7.1f}")
    out.append(f"#   (stage includes {waits} waits of {steps} for a pinned mirror the device had not released)")
    out += [f"#   bare: {label:<34} {us:6.2f}" for label, us in bare.items()]
    return "\n".join(out)


def _reps(bs: int, ctx: int, cuda: bool) -> int:
    """Timed steps of a case: 200 on CUDA; fewer on the CPU, fewest for large cases."""
    return 200 if cuda else (20 if bs * ctx > 50_000 else 50)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--deep-fingerprints", action="store_true", help="CanaryConfig(deep_fingerprints=True)")
    ap.add_argument("--grid", help="cases as BSxCTX,... (default: the preset grid)")
    ap.add_argument("--variants", default="both", choices=["both", "graphs", "eager"], help="CUDA variants to run")
    ap.add_argument("--kernel-profile", type=int, default=0, help="CUDA: print the top N device ops (torch.profiler)")
    ap.add_argument("--host-phases", action="store_true", help="print host us per phase of a forward (and bare costs)")
    ap.add_argument("--profile", type=int, default=0, help="print the top N host functions (cProfile) of each case")
    ap.add_argument("--ablate", action="store_true",
                    help="then the last grid case again with one part off at a time (sweep, token checks, real-KV hashing)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    grid = [(1, 256), (8, 1024), (64, 4096)] if args.quick else [(1, 256), (8, 1024), (32, 4096), (64, 4096)]
    if args.grid:
        grid = [tuple(int(v) for v in c.split("x")) for c in args.grid.split(",")]
    machine = torch.cuda.get_device_name() if cuda else (
        f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} torch threads")
    print("# kvcanary runtime: canary time per decode step (simulated engine, mode=log, real_kv_hash=partial,")
    print("#   first+last layer K/V = 4 sources of 256 B/token, sweep slice every forward, drain poll"
          + (", deep fingerprints)" if args.deep_fingerprints else ")"))
    print(f"# machine: {machine}; torch {torch.__version__}; python {sys.version.split()[0]}")
    print(f"{'bs':>4} {'ctx':>6} {'variant':>7} {'entries':>8} {'us/step':>9} {'host us':>8} {'device us':>9} {'checked':>8} "
          f"{'MiB':>7}")
    rows = []
    for bs, ctx in grid:
        variants = {"both": (True, False), "graphs": (True,), "eager": (False,)}[args.variants]
        for graphs in (variants if cuda else (False,)):
            r = case(bs, ctx, device=device, graphs=graphs, reps=_reps(bs, ctx, cuda), profile=args.profile, deep=args.deep_fingerprints,
                     kernel_profile=args.kernel_profile, host_phases=args.host_phases)
            rows.append(r)
            dev_us = f"{r['device_us']:>9.1f}" if r["device_us"] is not None else f"{'-':>9}"
            print(f"{r['bs']:>4} {r['ctx']:>6} {r['variant']:>7} {r['entries']:>8} {r['us']:>9.1f} {r['host_us']:>8.1f} {dev_us} "
                  f"{r['checked']:>4}/{r['forwards']:<3} {r['mib']:>7.1f}", flush=True)
    if args.ablate:  # one part of the per-forward work off at a time: what each costs in the step, gaps included
        bs, ctx = grid[-1]
        graphs = cuda and args.variants != "eager"
        full = next((r for r in rows if (r["bs"], r["ctx"], r["variant"]) == (bs, ctx, "graphs" if graphs else "eager")),
                    None)
        print(f"# ablations, {bs} x {ctx} {'graphs' if graphs else 'eager'}: one part off at a time (us per step; "
              "delta against the row above with everything on)")
        for label, overrides in ABLATIONS:
            r = case(bs, ctx, device=device, graphs=graphs, reps=_reps(bs, ctx, cuda), deep=args.deep_fingerprints,
                     overrides=overrides)
            r["ablation"] = label
            rows.append(r)
            d_wall = f"{r['us'] - full['us']:+7.1f}" if full else "-"
            d_dev = (f"{r['device_us'] - full['device_us']:+7.1f}" if full and r["device_us"] is not None
                     and full["device_us"] is not None else "-")
            dev_us = f"{r['device_us']:.1f}" if r["device_us"] is not None else "-"
            print(f"#   {label:<26} us/step {r['us']:7.1f} ({d_wall})  host {r['host_us']:7.1f}  device {dev_us} ({d_dev})",
                  flush=True)
    target = [r for r in rows if (r["bs"], r["ctx"]) == (64, 4096) and "ablation" not in r]
    if target and cuda:
        best = min(target, key=lambda r: r["us"])
        print(f"# bs 64 x 4k decode step: {best['us']:.1f} us ({best['variant']}), target <= {TARGET_US:.0f} us: "
              f"{'met' if best['us'] <= TARGET_US else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
