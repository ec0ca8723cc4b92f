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
    p.add_argument("--seed", type=int, default=0, help="seed for the engine, workload and bug (default 0)")
    p.add_argument("--real-kv", default="partial", choices=("none", "partial", "all"),
                   help="real-KV fingerprints: none, partial (first and last layer) or all layers (default partial)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def check_args(args, modes) -> list[str]:
    """The bug names to run, every argument checked before the first one runs."""
    from kvcanary.cli.main import check_output_path
    from kvcanary.errors import KvCanaryValueError

    names = list(modes) if args.bug == "all" else [b for b in args.bug.split(",") if b]
    unknown = [b for b in names if b not in modes]
    if unknown or not names:
        raise KvCanaryValueError(f"kv-canary: --bug: unknown bug mode(s) {', '.join(unknown) or '(none given)'}; "
                                 f"known: all, {', '.join(modes)} (kvcanary replay --list)")
    check_output_path("--json", args.json)
    return names


def run(args) -> int:
    from kvcanary.faults.replay import BUG_MODES, run_replay

    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    if args.list:
        for m in BUG_MODES.values():
            print(f"{m.name:34s} {m.source}")
        return 0
    names = check_args(args, BUG_MODES)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(names), desc="replays", unit="bug")
    results = []
    try:
        for n in names:
            if bar is not None:
                bar.set_postfix_str(n)
            results.append(run_replay(n, seed=args.seed, real_kv_hash=args.real_kv).to_json())
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
        print(f"wrote {args.json}")
    ok = all(r["caught"] == r["expect_caught"] and r["clean"]["violations"] == 0 for r in results)
    return 0 if ok else 1


def caught_label(r: dict) -> str:
    return "yes" if r["caught"] else ("no (exp.)" if not r["expect_caught"] else "NO")


def format_table(results: list[dict]) -> str:
    head = ("bug", "caught", "forward", "latency", "request", "reasons", "clean twin")
    rows = [head]
    for r in results:
        rows.append((r["bug"], caught_label(r), "-" if r["forward"] is None else str(r["forward"]),
                     "-" if r["latency_forwards"] is None else f"{r['latency_forwards']} fwd", str(r["request"]),
                     "+".join(r["reasons"]) or "-",
                     f"{r['clean']['violations']} in {r['clean']['forwards']} fwd"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    right = {2, 3}
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            continue
        r = results[k - 1]
        inj = r["injected"]
        where = (f"forward {inj['step']}, {inj['group']} slot {inj['slot']}, position {inj['position']}, "
                 f"request {inj['request_id']}: {inj['detail']}") if inj else "not injected (no target)"
        lines.append(f"    mode: {r['mechanism']}; injected at {where}")
    caught = sum(r["caught"] for r in results)
    expected = sum(r["expect_caught"] for r in results)
    lines.append(f"{caught} of {len(results)} caught ({expected} expected); clean twins: "
                 f"{sum(r['clean']['violations'] for r in results)} violations")
    return "\n".join(lines)
