"""Clean-workload fuzzer: N random configurations of one engine, each run unchecked and then with the
canary in ``raise`` mode (0 violations, identical tokens, every engine forward checked), a third of them
with a faulted twin that must be caught against the right request (`kvcanary.faults.fuzz`).

    PYTHONPATH=src python bench/fuzz_clean.py --engine sim --configs 1000 --seed 0 --out bench/fuzz_clean.sim.json
    PYTHONPATH=src python bench/fuzz_clean.py --engine transformers --configs 20 --seed 0
    PYTHONPATH=src python bench/fuzz_clean.py --engine transformers --device cuda --cuda-graphs --configs 100 \
        --max-seconds 420 --out bench/fuzz_clean.transformers.gpu.json
    PYTHONPATH=src python bench/fuzz_clean.py --engine transformers --cuda-graphs --dry --configs 2   # CPU dry form

Configuration k of seed S is re-run alone by ``--seed S --first-seed k --configs 1`` (each failing
configuration prints that line). Exit status 1 when any configuration failed.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from kvcanary.faults.fuzz import ENGINES, FAULT_RATE, format_table, run_campaign


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=ENGINES, required=True)
    ap.add_argument("--configs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="campaign seed (which configurations are drawn)")
    ap.add_argument("--first-seed", type=int, default=0, help="index of the first configuration of the campaign")
    ap.add_argument("--out", default=None, help="JSON summary path (rewritten after every configuration)")
    ap.add_argument("--fault-rate", type=float, default=FAULT_RATE, help="share of configurations with a faulted twin")
    ap.add_argument("--device", default="cpu", help="transformers only: cpu or cuda")
    ap.add_argument("--cuda-graphs", action="store_true", help="transformers only: use_cuda_graph=True")
    ap.add_argument("--dry", action="store_true",
                    help="transformers --cuda-graphs without CUDA: pad batches and run the warmup as in graph mode, "
                         "driven from the compute_batch wrapper, everything but the capture")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no configuration after this much wall time (the summary says stopped_early)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="print the summary line only")
    ap.add_argument("--verbose", action="store_true", help="keep the engine's and the canary's logs")
    args = ap.parse_args(argv)
    if not args.verbose:
        logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    run_kw: dict = {}
    extra = ""
    if args.engine == "transformers":
        run_kw = dict(device=args.device, cuda_graphs=args.cuda_graphs, dry_graphs=args.dry)
        extra = " ".join(x for x in (f"--device {args.device}" if args.device != "cpu" else "",
                                     "--cuda-graphs" if args.cuda_graphs else "", "--dry" if args.dry else "") if x)
    elif args.device != "cpu" or args.cuda_graphs:
        ap.error("--device / --cuda-graphs apply to --engine transformers only")
    summary = run_campaign(args.engine, seed=args.seed, configs=args.configs, first=args.first_seed, out=args.out,
                           fault_rate=args.fault_rate, progress=not args.no_progress, extra=extra,
                           max_seconds=args.max_seconds, **run_kw)
    if args.quiet:
        print(json.dumps({k: summary[k] for k in ("engine", "configs", "passed", "failed", "false_positives")}))
    else:
        print(format_table(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
