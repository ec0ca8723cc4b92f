"""Does timing jitter surface a race? Detection rate of an unordered side-stream write, with jitter off and on.

The race (an engine bug of the "block freed while the step before still reads it" class): on the simulated engine's
decode step, right after the canary's HEAD, the engine writes into a slot the step reads — on a side stream that
waits only for HEAD, sleeps ``delay`` GPU cycles (the write's own latency), then flips a byte the slot's real-KV
fingerprint covers. Nothing orders that write before or after the step's reads. The canary's TAIL verify re-reads
every read position after the forward; it sees the flip only if the write lands before TAIL reads that slot. After
the step the byte is put back (the slot's next owner rewrites it legitimately), so a race the TAIL verify misses
leaves no trace. Jitter stalls some of TAIL verify's programs (the reader) before they read: a write still in
flight can land first, so the race shows up as a violation more often.

Per delay and fire probability: ``trials`` seeded decode steps (the draws follow the device step), the fraction
whose flipped slot was reported (the rest passed unseen), and the same schedule with a write of identical bytes
(the clean twin: any violation there is a false alarm). ``jitter_max_cycles`` sets the longest stall.

    python bench/jitter_race.py [--trials 200] [--delays 0,2000,8000,32000] [--probs 0,0.01,0.1] [--max-cycles 50000]

On a machine without CUDA it says so and exits 0 (there is no second stream to race with), unless ``--cpu-smoke``:
then it runs the same code with the side write made synchronous (always landed first: every trial caught, which
checks the plumbing, not the race).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys

import torch


def decode_engine(bs: int, ctx: int, prob: float, max_cycles: int, device: str):
    """(engine, canary, decode batch) of ``bs`` requests with ``ctx`` cached tokens each, jitter at ``prob``."""
    from kvcanary.engines.sim import SimConfig, SimEngine
    from kvcanary.runtime import Canary, CanaryConfig

    sc = SimConfig(num_slots=bs * (ctx + 160) + 8, max_requests=bs + 1, max_context=ctx + 160, chunk_size=ctx,
                   max_batch_tokens=max(ctx, 8192), max_running=bs, num_layers=4, kv_bytes=256, seed=0, device=device)
    cfg = CanaryConfig(sweep_interval=0, health_interval=0, readable_per_step=0, jitter_fire_prob=prob,
                       jitter_max_cycles=max_cycles, jitter_seed=7)
    canary = Canary(cfg, groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                    max_batch_tokens=sc.max_batch_tokens, device=device)
    engine = SimEngine(sc, canary)
    for i in range(bs):
        engine.add_request([1 + (7 * i + j) % 31000 for j in range(ctx)], max_new=150, rid=f"b{i}")
    batch = engine.step()
    while batch is None or batch.forward_kind != "decode":
        batch = engine.step()
    return engine, canary, batch


def trials(engine, canary, batch, *, delay: int, n: int, flip: int, seed: int, sync_write: bool) -> tuple[int, int]:
    """(trials whose flipped slot was reported, violations seen in all) over ``n`` decode steps."""
    rng = random.Random(seed)
    g = batch.groups["full"]
    rows = batch.req_pool_indices.tolist()
    prefix = batch.prefix_lens.tolist()
    k0 = engine.kv[("full", 0)][0]  # layer 0's K: the partial real-KV hash reads its first 16 bytes
    side = torch.cuda.Stream() if k0.is_cuda else None
    ids = list(batch.request_ids)
    caught = 0
    seen_before = len(canary.violations())
    for _ in range(n):
        i = rng.randrange(len(rows))
        slot = int(g.req_to_token[rows[i], rng.randrange(prefix[i])])
        byte = rng.randrange(16)
        canary.begin_step(request_ids=ids, forward_kind="decode")
        canary.stage(batch)
        canary.launch_head()
        if side is not None and not sync_write:
            head_done = torch.cuda.Event()
            head_done.record()
            with torch.cuda.stream(side):
                side.wait_event(head_done)  # after HEAD, unordered with everything after it
                if delay:
                    torch.cuda._sleep(delay)
                k0[slot, byte] ^= flip
        else:
            k0[slot, byte] ^= flip
        canary.launch_tail()
        canary.end_step()
        if side is not None:
            torch.cuda.synchronize()
        k0[slot, byte] ^= flip  # the slot's next owner rewrites it: no trace left
        vs = canary.violations()
        new, seen_before = vs[seen_before:], len(vs)
        caught += any(v.slot == slot for v in new)
    return caught, len(canary.violations())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--delays", default="0,2000,8000,32000", help="side write latency in GPU cycles, comma list")
    ap.add_argument("--probs", default="0,0.01,0.1", help="jitter fire probabilities (0 = off), comma list")
    ap.add_argument("--max-cycles", type=int, default=50_000, help="CanaryConfig.jitter_max_cycles")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--cpu-smoke", action="store_true", help="run on the CPU with synchronous writes (plumbing only)")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    logging.getLogger("kvcanary").setLevel(logging.ERROR)  # the violations are the measurement, not log lines
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("# jitter_race: needs a CUDA GPU (a second stream to race with). Nothing run.")
        return 0
    device = "cuda" if cuda else "cpu"
    machine = torch.cuda.get_device_name() if cuda else "cpu (smoke: synchronous writes)"
    print(f"# kvcanary jitter race: unordered side-stream write after HEAD into a read slot, caught by TAIL verify?")
    print(f"#   simulated engine bs={args.bs} ctx={args.ctx}, {args.trials} trials per cell, jitter_max_cycles="
          f"{args.max_cycles}; machine: {machine}; torch {torch.__version__}")
    print(f"{'delay cyc':>9} {'prob':>6} {'caught':>7} {'rate':>6} {'clean viol':>10} {'stalls/step':>11}")
    rows = []
    for prob in [float(p) for p in args.probs.split(",")]:
        engine, canary, batch = decode_engine(args.bs, args.ctx, prob, args.max_cycles, device)
        for delay in [int(d) for d in args.delays.split(",")]:
            before = canary.stats()
            caught, _ = trials(engine, canary, batch, delay=delay, n=args.trials, flip=0x5A, seed=delay,
                               sync_write=not cuda)
            mid = canary.stats()
            _, total = trials(engine, canary, batch, delay=delay, n=args.trials, flip=0, seed=delay, sync_write=not cuda)
            clean = canary.stats().violations - mid.violations
            steps = max(mid.forwards - before.forwards, 1)
            row = dict(delay=delay, prob=prob, trials=args.trials, caught=caught, rate=caught / args.trials,
                       clean_violations=clean, stalls_per_step=(mid.jitter_stalls - before.jitter_stalls) / steps)
            rows.append(row)
            print(f"{delay:>9} {'off' if prob == 0 else f'{prob:g}':>6} {caught:>7} {row['rate']:>6.2f} {clean:>10} "
                  f"{row['stalls_per_step']:>11.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
