"""`kvcanary campaign`: seeded fault injection with per-fault accounting and a clean twin.

    kvcanary campaign --engine sim --seed 0 --faults all --per-class 20 --real-kv partial --out DIR

writes ``DIR/report.json`` (``{"classes": {CLASS: {injected, detected, missed, expected_detectable,
detected_expected, median_latency_forwards, collateral_reasons, detected_by, why_not}}, "clean":
{forwards, violations}, "config": ..., "ledger": [...]}``), ``DIR/report.md`` (the table) and
``DIR/detection.png`` (per-class chart). Exit status 0 when the clean twin is silent and every
injection the configuration can see was detected, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Optional

from kvcanary.errors import KvCanaryValueError
from kvcanary.faults.accounting import summarize
from kvcanary.faults.ledger import FAULT_CLASSES

COLUMNS = ("injected", "detected", "missed", "expected_detectable", "detected_expected")


def add_parser(sub) -> None:
    p = sub.add_parser("campaign", help="seeded fault injection, every injection accounted (report.json/md/png)")
    p.add_argument("--engine", choices=("sim", "transformers"), default="sim",
                   help=f"sim: the simulated paged-KV engine ({len(FAULT_CLASSES)} classes); transformers: tiny models on the CPU (6)")
    p.add_argument("--seed", type=int, default=0, help="seed for engines, workloads and injectors (default 0)")
    p.add_argument("--faults", default="all", help="all, or a comma list of fault classes (--faults list names them)")
    p.add_argument("--per-class", type=int, default=20, help="injections per class (default 20)")
    p.add_argument("--real-kv", default="partial", choices=("none", "partial", "all"),
                   help="real-KV fingerprints: none, partial (the --real-kv-layers) or all layers (default partial)")
    p.add_argument("--real-kv-layers", default="0,-1", help="hashed layers, indices into a group's layers (sim)")
    p.add_argument("--no-oracle", action="store_true", help="sample at random (sim) / greedily (transformers): no write-input oracle")
    p.add_argument("--deep-fingerprints", action=argparse.BooleanOptionalAction, default=True,
                   help="sim: also fingerprint every byte of every layer, checked by the sweep (default on)")
    p.add_argument("--out", required=True, help="output directory (created; an existing file is refused)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def known_classes(engine: str) -> tuple[str, ...]:
    if engine == "sim":
        return tuple(FAULT_CLASSES)
    from kvcanary.faults.tf_campaign import TF_CLASSES

    return tuple(TF_CLASSES)


def check_args(args) -> list[str]:
    """Every argument, before any engine starts; returns the fault classes to run."""
    if args.per_class < 1:
        raise KvCanaryValueError(f"kv-canary: --per-class must be >= 1, got {args.per_class}")
    known = known_classes(args.engine)
    faults = list(known) if args.faults == "all" else [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in known]
    if unknown or not faults:
        raise KvCanaryValueError(f"kv-canary: --faults: unknown fault class(es) {', '.join(unknown) or '(none given)'} "
                                 f"for --engine {args.engine}; known: all, {', '.join(known)}")
    try:
        layers = tuple(int(x) for x in args.real_kv_layers.split(","))
    except ValueError:
        raise KvCanaryValueError(f"kv-canary: --real-kv-layers must be a comma list of integers, got "
                                 f"{args.real_kv_layers!r}") from None
    if not layers:
        raise KvCanaryValueError("kv-canary: --real-kv-layers is empty")
    check_out_dir(args.out)
    return faults


def check_out_dir(out: str) -> None:
    """``out`` is a directory, or can be made one: not a file, and its nearest existing parent is writable."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise KvCanaryValueError(f"kv-canary: --out {out!r} exists and is not a directory")
    probe = os.path.abspath(out)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise KvCanaryValueError(f"kv-canary: --out {out!r}: {probe!r} is not a writable directory")


def _bar(total: int, enabled: bool):
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="injections", unit="fault")
    return bar, lambda: bar.update(1)


def shortfall(classes: dict, per_class: int, engine: str, max_tries: Optional[int]) -> dict[str, str]:
    """class -> why it has fewer injections than asked (none when every class reached ``per_class``)."""
    tries = f" in {max_tries} forwards" if max_tries else ""
    out = {}
    for name, c in classes.items():
        missing = per_class - c["injected"]
        if missing > 0:
            out[name] = (f"{c['injected']} of {per_class} injected: {missing} attempt(s) found no target for this "
                         f"class{tries} of the {engine} engine (no slot or request in the state the fault needs); "
                         f"they injected nothing and are not counted")
    return out


def run(args) -> int:
    faults = check_args(args)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    max_tries = None
    if args.engine == "sim":
        from kvcanary.faults.sim_campaign import SimCampaignConfig, run_sim_campaign

        cfg = SimCampaignConfig(seed=args.seed, per_class=args.per_class, real_kv_hash=args.real_kv,
                                deep_fingerprints=args.deep_fingerprints,
                                real_kv_layers=tuple(int(x) for x in args.real_kv_layers.split(",")),
                                oracle=not args.no_oracle)
        max_tries = cfg.max_tries
        bar, tick = _bar(len(faults) * args.per_class, not args.no_progress)
        try:
            runs = run_sim_campaign(faults, cfg, progress=tick)
        finally:
            if bar is not None:
                bar.close()
        outcomes = [o for r in runs for o in r.outcomes]
        clean = {"forwards": sum(r.clean_forwards for r in runs), "violations": sum(r.clean_violations for r in runs)}
        config = {"engine": "sim", "seed": cfg.seed, "per_class": cfg.per_class, "real_kv_hash": cfg.real_kv_hash,
                  "real_kv_layers": list(cfg.real_kv_layers), "sweep_interval": cfg.sweep_interval,
                  "window_forwards": cfg.window, "token_oracle": cfg.oracle, "deep_fingerprints": cfg.deep_fingerprints,
                  "forwards": sum(r.forwards for r in runs)}
    else:
        from kvcanary.faults.tf_campaign import run_tf_campaign

        bar, tick = _bar(len(faults) * args.per_class, not args.no_progress)
        try:
            _, outcomes, clean = run_tf_campaign(faults, seed=args.seed, per_class=args.per_class,
                                                 real_kv_hash=args.real_kv, oracle=not args.no_oracle, progress=tick)
        finally:
            if bar is not None:
                bar.close()
        config = {"engine": "transformers", "seed": args.seed, "per_class": args.per_class,
                  "real_kv_hash": args.real_kv, "models": "kvcanary.cli.demo tiny_model (CPU)",
                  "token_oracle": not args.no_oracle}
    classes = summarize(outcomes, key=lambda o: o.injection.fault + ("" if o.injection.group == "full" or
                                                                        args.engine == "sim" else f"[{o.injection.group}]"))
    if args.engine == "sim":  # a class with no injection at all still gets its row (and its shortfall)
        for name in faults:
            classes.setdefault(name, _empty_class())
    report = {"classes": classes, "clean": clean, "config": config,
              "shortfall": shortfall(classes, args.per_class, args.engine, max_tries),
              "seconds": round(time.perf_counter() - t0, 1),
              "ledger": [dict(o.injection.to_json(), detected=o.detected, latency_forwards=o.latency_forwards,
                              detected_by=list(o.detected_by), attributed_to=o.request_id) for o in outcomes]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.json"), "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    md = format_markdown(report)
    with open(os.path.join(args.out, "report.md"), "w") as fh:
        fh.write(md + "\n")
    png = plot(report, os.path.join(args.out, "detection.png"))
    print(md)
    print(f"\nwrote {os.path.join(args.out, 'report.json')}, report.md" + (", detection.png" if png else ""))
    ok = clean["violations"] == 0 and all(c["detected_expected"] == c["expected_detectable"] for c in classes.values())
    return 0 if ok else 1


def _empty_class() -> dict:
    return {"injected": 0, "detected": 0, "missed": 0, "expected_detectable": 0, "detected_expected": 0,
            "wrong_request": 0, "median_latency_forwards": None, "collateral_reasons": {}, "detected_by": {}, "why_not": []}


def format_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"# kvcanary campaign: {cfg['engine']} engine, seed {cfg['seed']}, real_kv_hash={cfg['real_kv_hash']}", "",
             "| class | injected | detected | missed | expected detectable | detected of those | median latency (fwd) "
             "| detected by | collateral |", "|---|---|---|---|---|---|---|---|---|"]
    for name, c in report["classes"].items():
        by = ", ".join(f"{k} {v}" for k, v in sorted(c["detected_by"].items())) or "-"
        col = ", ".join(f"{k} {v}" for k, v in sorted(c["collateral_reasons"].items())) or "-"
        lat = "-" if c["median_latency_forwards"] is None else c["median_latency_forwards"]
        lines.append(f"| {name} | {c['injected']} | {c['detected']} | {c['missed']} | {c['expected_detectable']} | "
                     f"{c['detected_expected']} | {lat} | {by} | {col} |")
    lines += ["", f"clean twin: {report['clean']['forwards']} forwards, {report['clean']['violations']} violations"]
    if report.get("shortfall"):
        lines += ["", f"fewer injections than asked ({cfg['per_class']} per class):"]
        lines += [f"- {n}: {why}" for n, why in report["shortfall"].items()]
    notes = [(n, w) for n, c in report["classes"].items() for w in c["why_not"]]
    if notes:
        lines += ["", "not expected detectable with this configuration:"]
        lines += [f"- {n}: {w}" for n, w in notes[:24]]
    return "\n".join(lines)


def plot(report: dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot extra is optional
        return None
    names = list(report["classes"])
    c = report["classes"]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names) + 2) + 2, 4))
    x = range(len(names))
    ax.bar([i - 0.27 for i in x], [c[n]["injected"] for n in names], 0.27, label="injected")
    ax.bar(x, [c[n]["expected_detectable"] for n in names], 0.27, label="expected detectable")
    ax.bar([i + 0.27 for i in x], [c[n]["detected"] for n in names], 0.27, label="detected")
    ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("injections")
    cfg = report["config"]
    ax.set_title(f"{cfg['engine']}: detection per fault class (real_kv_hash={cfg['real_kv_hash']})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the bars, never on them
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
