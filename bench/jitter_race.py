"""Does timing jitter surface a race? Detection rate of an unordered KV write, with jitter off and on.

The race (an engine bug of the "block freed while the step before still reads it" class): on the simulated engine's
decode step, right after the canary's HEAD, the engine writes into a slot the step reads, with nothing ordering that
write before or after the step's reads. It lands ``delay`` after HEAD (the write's own latency) and flips a byte
the slot's real-KV fingerprint covers. The canary's TAIL verify re-reads every read position after the forward; it
sees the flip only if the write lands before TAIL reads that slot. After the step the byte is put back (the slot's
next owner rewrites it legitimately), so a race the TAIL verify misses leaves no trace. Jitter stalls the TAIL
verify (the reader) before it reads: a write still in flight can land first, so the race shows up more often.

* CUDA: the write runs on a side stream that waits only for HEAD, sleeps ``delay`` GPU cycles
  (``torch.cuda._sleep``), then flips the byte; the jitter spins some of TAIL verify's programs on the SM clock.
* CPU (no CUDA): the write is a host thread started after HEAD (standing in for an engine's asynchronous KV copy or
  offload thread, unordered with the step) that waits ``delay`` microseconds (`host_stall`, GIL released), then
  flips the byte; the main thread goes on to TAIL and joins the thread after the step. The torch twins stall the
  calling thread before they read, for the longest fired draw at 1 ns per cycle
  (`kvcanary.ops.reference.jitter.HOST_NS_PER_CYCLE`), so ``--max-cycles 2000000`` is up to 2 ms.

Per delay and fire probability: ``trials`` seeded decode steps (the draws follow the device step), the fraction
whose flipped slot was reported (the rest passed unseen), and the same schedule with a write of identical bytes
(the clean twin: any violation there is a false alarm). ``jitter_max_cycles`` sets the longest stall.

    python bench/jitter_race.py [--trials 200] [--delays ...] [--probs 0,0.01,0.1] [--max-cycles ...]

Defaults follow the device: CUDA delays 0,2000,8000,32000 cycles, max cycles 50000, bs 16, ctx 512; CPU delays
0,200,1000,3000 µs, max cycles 2000000 (2 ms), bs 4, ctx 256 (the CPU twins are about a thousand times slower).
``--cpu-smoke``: on the CPU, make the write synchronous instead (always landed first: every trial caught, which
checks the plumbing, not the race).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import threading
import time

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


def trials(engine, canary, batch, *, delay: int, n: int, flip: int, seed: int, race: str) -> tuple[int, float]:
    """(trials whose flipped slot was reported, median ms from the end of HEAD to the end of the step) over ``n``
    decode steps. ``race``: "stream" (CUDA side stream, ``delay`` in cycles), "thread" (host thread, ``delay`` in
    µs) or "sync" (the write done before TAIL, ``delay`` ignored)."""
    from kvcanary.ops.reference.jitter import host_stall

    rng = random.Random(seed)
    g = batch.groups["full"]
    rows = batch.req_pool_indices.tolist()
    prefix = batch.prefix_lens.tolist()
    k0 = engine.kv[("full", 0)][0]  # layer 0's K: the partial real-KV hash reads its first 16 bytes
    side = torch.cuda.Stream() if race == "stream" else None
    ids = list(batch.request_ids)
    caught = 0
    step_ms = []
    seen_before = len(canary.violations())

    def late_write(slot: int, byte: int) -> None:
        host_stall(delay * 1000)
        k0[slot, byte] ^= flip

    for _ in range(n):
        i = rng.randrange(len(rows))
        slot = int(g.req_to_token[rows[i], rng.randrange(prefix[i])])
        byte = rng.randrange(16)
        canary.begin_step(request_ids=ids, forward_kind="decode")
        canary.stage(batch)
        canary.launch_head()
        t0 = time.perf_counter()
        writer = None
        if race == "stream":
            head_done = torch.cuda.Event()
            head_done.record()
            with torch.cuda.stream(side):
                side.wait_event(head_done)  # after HEAD, unordered with everything after it
                if delay:
                    torch.cuda._sleep(delay)
                k0[slot, byte] ^= flip
        elif race == "thread":
            writer = threading.Thread(target=late_write, args=(slot, byte), daemon=True)
            writer.start()  # after HEAD, unordered with everything after it
        else:
            k0[slot, byte] ^= flip
        canary.launch_tail()
        canary.end_step()
        if side is not None:
            torch.cuda.synchronize()
        if writer is not None:
            writer.join()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        k0[slot, byte] ^= flip  # the slot's next owner rewrites it: no trace left
        vs = canary.violations()
        new, seen_before = vs[seen_before:], len(vs)
        caught += any(v.slot == slot for v in new)
    return caught, statistics.median(step_ms)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--delays", help="write latency, comma list: GPU cycles on CUDA, microseconds on the CPU")
    ap.add_argument("--probs", default="0,0.01,0.1", help="jitter fire probabilities (0 = off), comma list")
    ap.add_argument("--max-cycles", type=int, help="CanaryConfig.jitter_max_cycles (CPU: 1 cycle = 1 ns)")
    ap.add_argument("--bs", type=int)
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--cpu-smoke", action="store_true", help="on the CPU, synchronous writes (plumbing only)")
    ap.add_argument("--machine", default="", help="a note on the machine, printed and stored in the JSON")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    logging.getLogger("kvcanary").setLevel(logging.ERROR)  # the violations are the measurement, not log lines
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    race = "stream" if cuda else ("sync" if args.cpu_smoke else "thread")
    delays = args.delays or ("0,2000,8000,32000" if cuda else "0,200,1000,3000")
    max_cycles = args.max_cycles or (50_000 if cuda else 2_000_000)
    bs, ctx = args.bs or (16 if cuda else 4), args.ctx or (512 if cuda else 256)
    unit = "cyc" if cuda else "us"
    machine = torch.cuda.get_device_name() if cuda else "cpu"
    if args.machine:
        machine = f"{machine} ({args.machine})"
    what = {"stream": "unordered side-stream write", "thread": "unordered host-thread write",
            "sync": "synchronous write (smoke: plumbing only)"}[race]
    print(f"# kvcanary jitter race: {what} after HEAD into a read slot, caught by TAIL verify?")
    print(f"#   simulated engine bs={bs} ctx={ctx}, {args.trials} trials per cell, jitter_max_cycles={max_cycles}"
          + ("" if cuda else f" (CPU: 1 cycle = 1 ns, up to {max_cycles / 1000:g} us)")
          + f"; machine: {machine}; torch {torch.__version__}")
    delay_is = {"stream": "GPU cycles the side stream sleeps after HEAD before it flips",
                "thread": "microseconds the writer thread waits after HEAD before it flips",
                "sync": "ignored (the flip is done before TAIL)"}[race]
    print(f"#   delay: {delay_is}; step ms: median wall time from the end of HEAD to the end of the step")
    print(f"{'delay ' + unit:>9} {'prob':>6} {'caught':>7} {'rate':>6} {'clean viol':>10} {'stalls/step':>11} "
          f"{'step ms':>8}")
    rows = []
    for prob in [float(p) for p in args.probs.split(",")]:
        engine, canary, batch = decode_engine(bs, ctx, prob, max_cycles, device)
        for delay in [int(d) for d in delays.split(",")]:
            before = canary.stats()
            caught, step_ms = trials(engine, canary, batch, delay=delay, n=args.trials, flip=0x5A, seed=delay,
                                     race=race)
            mid = canary.stats()
            trials(engine, canary, batch, delay=delay, n=args.trials, flip=0, seed=delay, race=race)
            clean = canary.stats().violations - mid.violations
            steps = max(mid.forwards - before.forwards, 1)
            row = dict(delay=delay, delay_unit=unit, prob=prob, trials=args.trials, caught=caught,
                       rate=caught / args.trials, clean_violations=clean,
                       stalls_per_step=(mid.jitter_stalls - before.jitter_stalls) / steps, step_ms=step_ms)
            rows.append(row)
            print(f"{delay:>9} {'off' if prob == 0 else f'{prob:g}':>6} {caught:>7} {row['rate']:>6.2f} {clean:>10} "
                  f"{row['stalls_per_step']:>11.1f} {step_ms:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "torch": torch.__version__, "race": race, "bs": bs, "ctx": ctx,
                       "max_cycles": max_cycles, "delay_unit": unit, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
