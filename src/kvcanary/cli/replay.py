"""`kvcanary replay --bug NAME|all [--json PATH]`: re-enact publicly reported kinds of KV bugs on
the simulated engine (`kvcanary.faults.replay`) and say, per bug, where it was injected and whether
the canary caught it (reason, forward, request) — with the clean twin's violation count.

Exit status 0 when every bug expected to be caught was caught, against the right request, and every
clean twin was silent; 1 otherwise.
"""
from __future__ import annotations

import json
import logging


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="re-enact real KV-corruption bugs on the simulated engine, each with a clean twin")
    p.add_argument("--bug", default="all", help="a bug mode name, a comma list, or all (see --list)")
    p.add_argument("--list", action="store_true", help="list the bug modes and exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real-kv", default="partial", choices=("none", "partial", "all"))
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def run(args) -> int:
    from kvcanary.faults.replay import BUG_MODES, run_replay

    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    if args.list:
        for m in BUG_MODES.values():
            print(f"{m.name:34s} {m.source}")
        return 0
    names = list(BUG_MODES) if args.bug == "all" else [b for b in args.bug.split(",") if b]
    results = [run_replay(n, seed=args.seed, real_kv_hash=args.real_kv).to_json() for n in names]
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    ok = all(r["caught"] == r["expect_caught"] and r["clean"]["violations"] == 0 for r in results)
    return 0 if ok else 1


def format_table(results: list[dict]) -> str:
    lines = [f"{'bug':<34} {'caught':<7} {'forward':>7} {'latency':>7}  {'request':<10} reasons"]
    for r in results:
        caught = "yes" if r["caught"] else ("no (exp.)" if not r["expect_caught"] else "NO")
        fwd = "-" if r["forward"] is None else str(r["forward"])
        lat = "-" if r["latency_forwards"] is None else f"{r['latency_forwards']} fwd"
        lines.append(f"{r['bug']:<34} {caught:<7} {fwd:>7} {lat:>7}  {str(r['request']):<10} "
                     f"{'+'.join(r['reasons']) or '-'}  [clean twin: {r['clean']['violations']} in "
                     f"{r['clean']['forwards']} fwd]")
        inj = r["injected"]
        where = (f"forward {inj['step']}, {inj['group']} slot {inj['slot']}, position {inj['position']}, "
                 f"request {inj['request_id']}: {inj['detail']}") if inj else "not injected (no target)"
        lines.append(f"    mode: {r['mechanism']}; injected at {where}")
    return "\n".join(lines)
