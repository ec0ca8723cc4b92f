"""`kvcanary demo`: a checked transformers continuous-batching run, clean and with injected faults.

Embedded default (no download, no tokenizer — token ids only), on whatever device is available:

* a tiny randomly initialised Llama (2 layers, full attention, prefix sharing on), and
* a tiny Qwen3 with sliding-window layers (``layer_types`` = sliding, full, sliding, full).

Workload: shared system prompts, user turns of different lengths, more requests than the engine
runs at once, a small cache — so blocks are freed, cached, reused (prefix hits) and prompts are
chunked. Each model runs clean first (no violations expected), then once per fault:

* ``flip_shared_block_byte`` — one bit of a cached shared prefix block's K bytes flips just before a
  request reuses it (expected: ``verify_real_kv_hash`` against that request);
* ``redirect_read`` — one cached position of one request is read from another live slot
  (expected: ``verify_position`` / ``verify_chain_hash`` against that request).

Faults (`kvcanary.faults.transformers`) are forward pre-hooks run *before* the canary's
(``prepend=True``), with their own seeded generator and a ledger of what they did where; the canary
never knows about them.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from kvcanary.cli.tables import fault_lines
from kvcanary.engines.transformers_cb.attach import attach
from kvcanary.errors import KvCanaryValueError
from kvcanary.faults.transformers import FlipSharedBlockByte, RedirectRead, match  # noqa: F401  (demo's injectors)

from kvcanary.faults.tf_workload import PAGE_SIZE, SLIDING_WINDOW, generate, tiny_model, workload  # noqa: F401


def _injected(injector, inj) -> dict:
    """The demo's ledger record of one injection (its JSON shape predates `kvcanary.faults`)."""
    return {"name": injector.name, "step": inj.step, "group": inj.group, "slot": inj.slot,
            "request_id": inj.request_id, "expected": inj.expected, "detail": inj.detail}


# ---- the demo ------------------------------------------------------------------------------------
def _summary(handle) -> dict:
    stats = handle.stats()
    counters = handle.counters()
    by_phase: dict = {}
    for s in stats:
        for phase, n in s.slots_verified.items():
            by_phase[phase] = by_phase.get(phase, 0) + int(n)
    return {"forwards": handle.forwards, "slots_verified": sum(by_phase.values()), "slots_verified_by_phase": by_phase,
            "violations": int(counters.get("total", 0)), "by_reason": dict(counters.get("by_reason", {}))}


MODELS = ("llama", "qwen3_swa")


def check_models(models) -> tuple[str, ...]:
    """``models`` (names) as a tuple, each one of `MODELS`."""
    models = tuple(models)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise KvCanaryValueError(f"kv-canary: unknown demo model {', '.join(map(repr, unknown))} (--models: a comma "
                                 f"list of {', '.join(MODELS)}: tiny random models, embedded)")
    return models


def run_demo(*, device: Optional[str] = None, seed: int = 0, models=MODELS,
             verbose: bool = False, progress: Optional[Callable[[str], None]] = None,
             jsonl_path: Optional[str] = None) -> dict:
    """Run the demo; returns the JSON-ready result (see `kvcanary.cli.main`). Unless ``verbose``, the
    engine's log and the canary's per-violation log lines are kept quiet (the table reports them).
    ``progress(line)`` is called before each generation run. ``jsonl_path``: every checked run appends its
    violations there as JSON lines (the canary's ``jsonl_path`` sink; ``kvcanary report`` reads it)."""
    sink = {} if jsonl_path is None else {"jsonl_path": jsonl_path}
    models = check_models(models)
    say = progress or (lambda line: None)
    if not verbose:
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        logging.getLogger("kvcanary").setLevel(logging.ERROR)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    prompts = workload(seed)
    result: dict = {"device": str(dev), "seed": seed, "versions": versions(),
                    "models": {}, "clean": {"forwards": 0, "slots_verified": 0, "violations": 0},
                    "faults": []}
    t0 = time.perf_counter()
    for kind in models:
        model = tiny_model(kind, dev, seed)
        say(f"{kind}: reference run (no canary) ...")
        reference = generate(model, prompts)
        say(f"{kind}: clean run with the canary ...")
        with attach(model, mode="log", sweep_interval=8, readable_per_step=0, **sink) as handle:
            checked = generate(model, prompts)
        clean = _summary(handle)
        clean["outputs_identical"] = checked == reference
        result["models"][kind] = {"clean": clean}
        for key in ("forwards", "slots_verified", "violations"):
            result["clean"][key] += clean[key]

        faults = [FlipSharedBlockByte(seed=seed), RedirectRead(group="full", seed=seed)] if kind == "llama" else \
            [RedirectRead(group="swa", seed=seed)]
        for injector in faults:
            say(f"{kind}: run with fault {injector.name} ...")
            injector.install(model)
            try:
                with attach(model, mode="log", sweep_interval=8, readable_per_step=0, **sink) as handle:
                    generate(model, prompts)
            finally:
                injector.remove()
            violations = handle.violations()
            for inj in injector.ledger:
                found = match(inj, violations)
                result["faults"].append({
                    "name": f"{kind}/{injector.name}" + (f"[{inj.group}]" if injector.name == "redirect_read" else ""),
                    "caught": found is not None, "reasons": found["reasons"] if found else [],
                    "request": found["request"] if found else None,
                    "latency_forwards": found["latency_forwards"] if found else None,
                    "injected": _injected(injector, inj), "violations_in_run": len(violations),
                })
            if not injector.ledger:
                result["faults"].append({"name": f"{kind}/{injector.name}", "caught": False, "reasons": [],
                                         "request": None, "latency_forwards": None,
                                         "injected": None, "violations_in_run": len(violations)})
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def versions() -> dict:
    """What produced a result: kvcanary, python, torch, transformers, triton (when installed), CUDA."""
    import platform
    from importlib import metadata

    import kvcanary

    out = {"kvcanary": kvcanary.__version__, "python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "triton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["cuda"] = torch.version.cuda
    return out


def format_table(result: dict) -> str:
    lines = [f"kvcanary demo on {result['device']} ({result['seconds']} s)", ""]
    lines.append(f"{'model':<11} {'forwards':>8} {'slots verified':>15} {'violations':>10}  outputs identical")
    for kind, r in result["models"].items():
        c = r["clean"]
        lines.append(f"{kind:<11} {c['forwards']:>8} {c['slots_verified']:>15} {c['violations']:>10}  "
                     f"{'yes' if c['outputs_identical'] else 'NO'}")
        for reason, n in sorted(c["by_reason"].items()):
            lines.append(f"{'':<11}   {reason}: {n}")
    lines += ["", *fault_lines(result["faults"], request_width=8, forward_key="step")]
    return "\n".join(lines)
