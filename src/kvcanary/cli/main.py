"""``kvcanary`` command line: ``kvcanary demo | campaign | replay | pd | report`` (``kvcanary -h``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional, Sequence

from kvcanary import __version__
from kvcanary.cli.paths import check_output_path  # noqa: F401  (re-exported)
from kvcanary.errors import KvCanaryValueError, is_kvcanary_message


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcanary", description="Catch KV-cache corruption in LLM inference engines.")
    parser.add_argument("--version", action="version", version=f"kvcanary {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="checked transformers continuous batching on tiny random models: a clean run, then injected faults",
    )
    demo.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    demo.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    demo.add_argument("--seed", type=int, default=0, help="seed for models, workload and fault injectors")
    demo.add_argument("--verbose", action="store_true", help="show the engine log and one log line per violation")
    demo.add_argument("--models", default="llama,qwen3_swa",
                      help="comma list of the embedded tiny random models: llama (full attention), "
                           "qwen3_swa (sliding window + full) (default both)")
    demo.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    demo.add_argument("--jsonl", metavar="PATH", help="transformers: append every violation as a JSON line to PATH "
                      "(read it with: kvcanary report PATH)")
    demo.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                      help="transformers continuous batching (default) or vLLM (needs the vLLM venv: scripts/setup_vllm.sh)")
    demo.add_argument("--processes", action="store_true",
                      help="vllm: vLLM's default engine-core + worker processes (batches then depend on timing)")
    pd = sub.add_parser("pd", help="two-process prefill -> decode KV transfer, checked on receipt (clean + faulted)")
    pd.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    pd.add_argument("--seed", type=int, default=0, help="seed for prompts and engines")
    pd.add_argument("--max-new", type=int, default=6, help="tokens to decode per request")
    pd.add_argument("--backend", default=None, help="torch.distributed backend: gloo or nccl (default: nccl with 2 GPUs, else gloo)")
    from kvcanary.cli import campaign, replay, report

    campaign.add_parser(sub)
    replay.add_parser(sub)
    report.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None, *, demo_runner: Optional[Callable[..., dict]] = None) -> int:
    """Run the ``kvcanary`` command line on ``argv`` (default ``sys.argv[1:]``); returns the exit code.
    ``demo_runner``: what ``kvcanary demo`` (transformers) runs once its arguments are checked, called with
    `kvcanary.cli.demo.run_demo`'s keywords and returning its result (default: that function)."""
    args = _parser().parse_args(argv)
    if args.command == "demo" and args.engine == "vllm":
        return _demo_vllm(args)
    if args.command == "demo":
        try:
            check_output_path("--json", args.json)  # before the run, not after it
            check_output_path("--jsonl", args.jsonl)
            from kvcanary.cli.demo import check_models, format_table, run_demo
            from kvcanary.engines.transformers_cb.attach import check_device

            models = check_models(m for m in args.models.split(",") if m)
            check_device(args.device)
            result = (demo_runner or run_demo)(device=args.device, seed=args.seed, models=models, verbose=args.verbose,
                              progress=None if args.no_progress else _progress("demo"), jsonl_path=args.jsonl)
        except Exception as exc:
            return _usage_error(exc)
        _emit(format_table(result), result, args.json)
        if args.jsonl:
            print(f"violations appended to {args.jsonl} (kvcanary report {args.jsonl})")
        clean_ok = result["clean"]["violations"] == 0
        return 0 if clean_ok and all(f["caught"] for f in result["faults"]) else 1
    if args.command == "pd":
        try:
            from kvcanary.cli.pd import main as pd_main

            return pd_main(args)
        except Exception as exc:
            return _usage_error(exc)
    if args.command in ("campaign", "replay", "report"):
        from kvcanary.cli import campaign, replay, report

        try:
            return {"campaign": campaign, "replay": replay, "report": report}[args.command].run(args)
        except Exception as exc:
            return _usage_error(exc)
    return 2


def _usage_error(exc: Exception) -> int:
    """kvcanary's own errors (by type; older call sites by their ``kv-canary:`` text) become one stderr
    line and exit code 2; anything else propagates."""
    if not is_kvcanary_message(exc):
        raise exc
    print(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, file=sys.stderr)
    return 2


def _emit(table: str, result: dict, json_path: Optional[str]) -> None:
    """Print a run's table; write its result as JSON when asked (and say where)."""
    print(table)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
        print(f"wrote {json_path}")


def _progress(command: str):
    """A progress sink: one timestamped line per phase on stderr (the table goes to stdout)."""
    import time

    t0 = time.perf_counter()

    def say(line: str) -> None:
        print(f"kvcanary {command} [{time.perf_counter() - t0:5.0f} s] {line}", file=sys.stderr, flush=True)

    return say


def _demo_vllm(args) -> int:
    """``kvcanary demo --engine vllm`` (kvcanary.cli.demo_vllm)."""
    try:
        check_output_path("--json", args.json)
        from kvcanary.cli.demo_vllm import format_table, run_demo

        if args.models != "llama,qwen3_swa" and args.models != "llama":
            raise KvCanaryValueError("kv-canary: --models: the vLLM demo runs one model, llama")
        if args.jsonl:
            raise KvCanaryValueError("kv-canary: --jsonl: the vLLM demo keeps its workers' JSON lines in a temporary "
                                     "directory; use the transformers demo, or jsonl_path in kv_transfer_config")
        result = run_demo(seed=args.seed, processes=args.processes,
                          progress=None if args.no_progress else _progress("demo"))
    except Exception as exc:
        return _usage_error(exc)
    _emit(format_table(result), result, args.json)
    clean_ok = result["clean"]["violations"] == 0 and result["models"]["llama"]["clean"]["outputs_identical"]
    return 0 if clean_ok and all(f["caught"] for f in result["faults"]) else 1


if __name__ == "__main__":
    sys.exit(main())
