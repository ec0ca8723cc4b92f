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
    p.add_argument("--engine", choices=("sim", "transformers"), default="sim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", default="all", help="all, or a comma list of fault classes")
    p.add_argument("--per-class", type=int, default=20, help="injections per class")
    p.add_argument("--real-kv", default="partial", choices=("none", "partial", "all"),
                   help="real-KV fingerprint mode (sim: also --real-kv-layers)")
    p.add_argument("--real-kv-layers", default="0,-1", help="hashed layers, indices into a group's layers (sim)")
    p.add_argument("--no-oracle", action="store_true", help="sample at random (sim) / greedily (transformers): no write-input oracle")
    p.add_argument("--deep-fingerprints", action=argparse.BooleanOptionalAction, default=True,
                   help="sim: also fingerprint every byte of every layer, checked by the sweep (default on)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-progress", action="store_true")


def _bar(total: int, enabled: bool):
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="injections", unit="fault")
    return bar, lambda: bar.update(1)


def run(args) -> int:
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    if args.per_class < 1:
        raise KvCanaryValueError(f"kv-canary: --per-class must be >= 1, got {args.per_class}")
    if args.engine == "sim":
        from kvcanary.faults.sim_campaign import SimCampaignConfig, run_sim_campaign

        faults = list(FAULT_CLASSES) if args.faults == "all" else [f for f in args.faults.split(",") if f]
        cfg = SimCampaignConfig(seed=args.seed, per_class=args.per_class, real_kv_hash=args.real_kv,
                                deep_fingerprints=args.deep_fingerprints,
                                real_kv_layers=tuple(int(x) for x in args.real_kv_layers.split(",")),
                                oracle=not args.no_oracle)
        bar, tick = _bar(len(faults) * args.per_class, not args.no_progress)
        runs = run_sim_campaign(faults, cfg, progress=tick)
        outcomes = [o for r in runs for o in r.outcomes]
        clean = {"forwards": sum(r.clean_forwards for r in runs), "violations": sum(r.clean_violations for r in runs)}
        config = {"engine": "sim", "seed": cfg.seed, "per_class": cfg.per_class, "real_kv_hash": cfg.real_kv_hash,
                  "real_kv_layers": list(cfg.real_kv_layers), "sweep_interval": cfg.sweep_interval,
                  "window_forwards": cfg.window, "token_oracle": cfg.oracle, "deep_fingerprints": cfg.deep_fingerprints,
                  "forwards": sum(r.forwards for r in runs)}
    else:
        from kvcanary.faults.tf_campaign import TF_CLASSES, run_tf_campaign

        faults = list(TF_CLASSES) if args.faults == "all" else [f for f in args.faults.split(",") if f]
        bar, tick = _bar(len(faults) * args.per_class, not args.no_progress)
        _, outcomes, clean = run_tf_campaign(faults, seed=args.seed, per_class=args.per_class,
                                             real_kv_hash=args.real_kv, oracle=not args.no_oracle, progress=tick)
        config = {"engine": "transformers", "seed": args.seed, "per_class": args.per_class,
                  "real_kv_hash": args.real_kv, "models": "kvcanary.cli.demo tiny_model (CPU)",
                  "token_oracle": not args.no_oracle}
    if bar is not None:
        bar.close()
    classes = summarize(outcomes, key=lambda o: o.injection.fault + ("" if o.injection.group == "full" or
                                                                        args.engine == "sim" else f"[{o.injection.group}]"))
    report = {"classes": classes, "clean": clean, "config": config,
              "seconds": round(time.perf_counter() - t0, 1),
              "ledger": [dict(o.injection.to_json(), detected=o.detected, latency_forwards=o.latency_forwards,
                              detected_by=list(o.detected_by), attributed_to=o.request_id) for o in outcomes]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.json"), "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    md = format_markdown(report)
    with open(os.path.join(args.out, "report.md"), "w") as fh:
        fh.write(md + "\n")
    plot(report, os.path.join(args.out, "detection.png"))
    print(md)
    ok = clean["violations"] == 0 and all(c["detected_expected"] == c["expected_detectable"] for c in classes.values())
    return 0 if ok else 1


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
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names) + 2), 4))
    x = range(len(names))
    ax.bar([i - 0.27 for i in x], [c[n]["injected"] for n in names], 0.27, label="injected")
    ax.bar(x, [c[n]["expected_detectable"] for n in names], 0.27, label="expected detectable")
    ax.bar([i + 0.27 for i in x], [c[n]["detected"] for n in names], 0.27, label="detected")
    ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("injections")
    cfg = report["config"]
    ax.set_title(f"{cfg['engine']}: detection per fault class (real_kv_hash={cfg['real_kv_hash']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
