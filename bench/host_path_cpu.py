"""The runtime's per-forward host path alone, on the CPU: a diagnostic for host-side changes between device runs.

The simulated engine's 64 x 4 k decode step (as `runtime_overhead.py`) goes through `before_forward` /
`after_forward` with the device work taken out: the canary's graph replays are no-ops, the batch takes the
host-upload route (pinned mirrors + one upload on CUDA; plain host copies here) and the drain runs its
asynchronous protocol with events that are always complete. What is left is the Python and CPU torch work a
forward costs the host: staging, the step log, the drain's looks, the sweep's pass starts (with the engine's
live-slot provider). CUDA calls cost more on the H200's host (docs/lab/NOTES.md run 39: a bare ``fill_`` 8.7 µs
against 1.3 here), so compare CPU figures with CPU figures only; they are not the ≤ 100 µs target.

    python bench/host_path_cpu.py [--bs 64] [--ctx 4096] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import types

import torch

from kvcanary.engines.sim import SimConfig, SimEngine
from kvcanary.runtime import Canary, CanaryConfig
from kvcanary.runtime.drain import ViolationDrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime_overhead import host_phase_table  # noqa: E402  (one bench's helper, shared)


class _DoneEvent:
    """A CUDA event stand-in whose work is always complete."""

    def record(self, *_stream) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _NoReplay:
    def replay(self) -> None:
        pass


def host_only_canary(bs: int, ctx: int):
    """A decode batch of ``bs`` x ``ctx`` on the simulated engine, and its canary with the device work taken out."""
    sc = SimConfig(num_slots=bs * (ctx + 160) + 8, max_requests=bs + 1, max_context=ctx + 160, chunk_size=ctx,
                   max_batch_tokens=max(ctx, 8192), max_running=bs, num_layers=4, kv_bytes=16, seed=0, device="cpu")
    canary = Canary(CanaryConfig(sweep_interval=64, health_interval=0, readable_per_step=0, real_kv_hash="none"),
                    groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                    max_batch_tokens=sc.max_batch_tokens, device="cpu")
    engine = SimEngine(sc, canary)
    for i in range(bs):
        engine.add_request([1 + (7 * i + j) % 31000 for j in range(ctx)], max_new=120, rid=f"b{i}")
    batch = engine.step()
    while batch is None or batch.forward_kind != "decode":
        batch = engine.step()
    canary.drain = ViolationDrain(canary.rings, synchronous=False, polled=canary.polled, asynchronous=True,
                                  event=_DoneEvent, interval=canary.config.drain_interval)
    canary.static.host_upload = True
    replays = types.SimpleNamespace(head=_NoReplay(), tail=_NoReplay(), stamps=_NoReplay(), head_sweep=_NoReplay())
    canary._graphs = types.SimpleNamespace(pick=lambda *_: replays, sweep=_NoReplay())  # replays cost nothing here
    return canary, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of 640 forwards (10 sweep passes) each")
    args = ap.parse_args()
    canary, batch = host_only_canary(args.bs, args.ctx)

    def forward() -> None:
        canary.before_forward(batch)
        canary.after_forward()

    for _ in range(128):
        forward()
    rounds = []
    for _ in range(args.rounds):
        t = time.perf_counter_ns()
        for _ in range(640):
            forward()
        rounds.append((time.perf_counter_ns() - t) / 640 / 1e3)
    print(f"# kvcanary host path alone (device work taken out), {args.bs} x {args.ctx} decode step, simulated engine")
    print(f"# machine: {os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}); torch {torch.__version__}; "
          f"python {sys.version.split()[0]}")
    print(f"host us per forward, {args.rounds} rounds of 640: " + " ".join(f"{r:.1f}" for r in rounds)
          + f"  (best {min(rounds):.1f})")
    print(host_phase_table(canary, batch, args.bs, args.ctx, graphs=True, steps=640))


if __name__ == "__main__":
    main()
