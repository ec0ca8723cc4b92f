"""Clean-workload fuzzing: configurations drawn at random from what an engine accepts, each run
unchecked and then with the canary in ``raise`` mode; the canary must stay silent, leave the tokens
unchanged and check every forward the engine ran. A random subset also runs a *faulted twin* (one
flipped K/V byte in a slot the next forward reads, or one redirected read, canary in ``log`` mode)
that must be caught against the request that read it — silence must not come from blindness.

An engine module (`kvcanary.faults.fuzz.sim`, ``.transformers``, ``.vllm``) exposes

* ``sample_config(rng: random.Random) -> dict`` — a JSON-ready configuration;
* ``run_config(config: dict, *, seed: int, faulted: bool) -> dict`` — one `outcome` dict.

Configuration ``k`` of a campaign seeded ``S`` on engine ``E`` is drawn from
``random.Random(f"{E}:{S}:{k}")`` (`config_rng`); so ``--seed S --first-seed k --configs 1`` re-runs
exactly that configuration (`reproducer`).
"""
from __future__ import annotations

import json
import os
import platform
import random
import time
import traceback
from importlib import import_module
from typing import Callable, Optional

from kvcanary.errors import KvCanaryValueError

ENGINES = ("transformers", "sim", "vllm")
FAULT_RATE = 1 / 3  # share of configurations that also run a faulted twin
OUTCOME_KEYS = ("engine", "seed", "config", "violations", "false_positive", "tokens_identical", "engine_forwards",
                "checked_forwards", "fault", "error", "engine_error", "seconds", "reproducer")
BENCH = "bench/fuzz_clean.py"


def outcome(engine: str, seed: int, config: dict, **fields: object) -> dict:
    """An outcome dict with every `OUTCOME_KEYS` key (missing ones at their neutral value); extra keys
    (``first_violations``, ``index``, counters) are kept."""
    out: dict = {"engine": engine, "seed": seed, "config": config, "violations": 0, "false_positive": False,
                 "tokens_identical": False, "engine_forwards": 0, "checked_forwards": 0, "fault": None,
                 "error": None, "engine_error": None, "seconds": 0.0, "reproducer": ""}
    out.update(fields)
    return out


def fault_result(kind: str, *, fired: bool, caught: Optional[bool] = None, right_request: Optional[bool] = None,
                 **detail: object) -> dict:
    """The ``fault`` entry of an outcome. ``fired``: the injector found a target (a twin whose workload offered
    none proves nothing and is not counted as missed); ``caught``: a violation with an expected reason named the
    injected slot or request; ``right_request``: the first such violation was charged to the injected request."""
    return {"kind": kind, "fired": fired, "caught": caught, "right_request": right_request, **detail}


def failure_reasons(o: dict) -> list[str]:
    """Why an outcome fails (empty: it passed)."""
    why = []
    if o.get("error"):
        why.append("error")
    if o.get("engine_error"):  # the engine failed without the canary too: not the canary's finding, still not a pass
        why.append("engine_error")
    if o.get("false_positive") or o.get("violations"):
        why.append("false_positive")
    if o.get("tokens_identical") is False or (o.get("tokens_identical") is None and not o.get("engine_error")):
        why.append("tokens_differ")  # None with an engine error: the unchecked run gave nothing to compare with
    if o.get("engine_forwards") != o.get("checked_forwards"):
        why.append("unchecked_forwards")
    f = o.get("fault")
    if f and f.get("fired") and not (f.get("caught") and f.get("right_request")):
        why.append("fault_missed" if not f.get("caught") else "fault_wrong_request")
    return why


def config_rng(engine: str, seed: int, index: int) -> random.Random:
    """The generator configuration ``index`` of campaign ``seed`` on ``engine`` is drawn from."""
    return random.Random(f"{engine}:{seed}:{index}")


def run_seed(seed: int, index: int) -> int:
    """The seed `run_config` gets for configuration ``index`` of campaign ``seed`` (models, prompts, sampling)."""
    return seed * 100_000 + index


def reproducer(engine: str, seed: int, index: int, extra: str = "") -> str:
    """A one-line shell command that re-runs exactly configuration ``index`` of campaign ``seed``."""
    line = f"PYTHONPATH=src python {BENCH} --engine {engine} --seed {seed} --first-seed {index} --configs 1"
    return f"{line} {extra}".rstrip()


def draw(engine: str, module, seed: int, index: int, fault_rate: float = FAULT_RATE) -> tuple[dict, bool]:
    """(configuration, faulted?) of ``index`` in campaign ``seed``."""
    rng = config_rng(engine, seed, index)
    config = module.sample_config(rng)
    return config, rng.random() < fault_rate


def engine_module(engine: str):
    if engine not in ENGINES:
        raise KvCanaryValueError(f"kv-canary: unknown fuzz engine {engine!r} (known: {', '.join(ENGINES)})")
    return import_module(f"kvcanary.faults.fuzz.{engine}")


def run_one(engine: str, module, seed: int, index: int, *, fault_rate: float = FAULT_RATE,
            extra: str = "", faulted: Optional[bool] = None, **run_kw: object) -> dict:
    """Draw configuration ``index`` of campaign ``seed`` and run it; an exception escaping the engine module
    becomes the outcome's ``error`` (with the config and reproducer kept)."""
    config, drawn = draw(engine, module, seed, index, fault_rate)
    faulted = drawn if faulted is None else faulted
    t0 = time.perf_counter()
    try:
        o = module.run_config(config, seed=run_seed(seed, index), faulted=faulted, **run_kw)
    except Exception as exc:  # noqa: BLE001 — a fuzzer reports, it does not stop
        o = outcome(engine, run_seed(seed, index), config,
                    error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
    o["seconds"] = round(time.perf_counter() - t0, 3)
    o["index"] = index
    o["reproducer"] = reproducer(engine, seed, index, extra)
    o["failed"] = failure_reasons(o)
    return o


def machine() -> dict:
    """Where a campaign ran: host name, CPU, core count, Python, and torch / transformers versions."""
    out = {"node": platform.node(), "processor": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover
        pass
    for dist in ("transformers", "vllm"):
        try:
            from importlib import metadata

            out[dist] = metadata.version(dist)
        except Exception:  # noqa: BLE001 — not installed in this venv
            out[dist] = None
    return out


def summarize(engine: str, seed: int, outcomes: list[dict], *, first: int, seconds: float) -> dict:
    """The campaign's JSON summary: totals, faulted-twin counts, failures with their reproducers, outcomes."""
    twins = [o["fault"] for o in outcomes if o.get("fault")]
    fired = [f for f in twins if f.get("fired")]
    failures = [o for o in outcomes if o["failed"]]
    by_reason: dict[str, int] = {}
    for o in failures:
        for why in o["failed"]:
            by_reason[why] = by_reason.get(why, 0) + 1
    return {
        "engine": engine, "seed": seed, "first_seed": first, "configs": len(outcomes), "machine": machine(),
        "seconds": round(seconds, 1),
        "passed": len(outcomes) - len(failures), "failed": len(failures), "failed_by_reason": by_reason,
        "false_positives": sum(bool(o["false_positive"] or o["violations"]) for o in outcomes),
        "tokens_differ": sum("tokens_differ" in o["failed"] for o in outcomes),
        "forwards_unchecked": sum(o["engine_forwards"] != o["checked_forwards"] for o in outcomes),
        "errors": sum(bool(o["error"]) for o in outcomes),
        "engine_forwards": sum(o["engine_forwards"] for o in outcomes),
        "faulted": {"twins": len(twins), "fired": len(fired), "caught": sum(bool(f.get("caught")) for f in fired),
                    "right_request": sum(bool(f.get("caught") and f.get("right_request")) for f in fired),
                    "by_kind": _by_kind(fired)},
        "failures": [{"index": o["index"], "failed": o["failed"], "reproducer": o["reproducer"],
                      "error": (o["error"] or o.get("engine_error") or "").splitlines()[0] or None,
                      "first_violations": o.get("first_violations", [])[:3], "config": o["config"]}
                     for o in failures],
        "outcomes": outcomes,
    }


def _by_kind(fired: list[dict]) -> dict:
    out: dict = {}
    for f in fired:
        c = out.setdefault(f["kind"], {"fired": 0, "caught": 0, "right_request": 0})
        c["fired"] += 1
        c["caught"] += bool(f.get("caught"))
        c["right_request"] += bool(f.get("caught") and f.get("right_request"))
    return out


def run_campaign(engine: str, *, seed: int, configs: int, first: int = 0, out: Optional[str] = None,
                 fault_rate: float = FAULT_RATE, progress: bool = True, extra: str = "",
                 max_seconds: Optional[float] = None, on_outcome: Optional[Callable[[dict], None]] = None,
                 **run_kw: object) -> dict:
    """Run configurations ``first .. first + configs - 1`` of campaign ``seed``; write the JSON summary to
    ``out`` (rewritten after every configuration, so a cut campaign keeps what it ran). ``max_seconds``: start
    no configuration after this much wall time (the summary says ``stopped_early``)."""
    module = engine_module(engine)
    outcomes: list[dict] = []
    t0 = time.perf_counter()
    indices = range(first, first + configs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=configs, desc=f"fuzz {engine}", unit="config")
    summary: dict = {}
    stopped = False
    for index in indices:
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            stopped = True
            break
        o = run_one(engine, module, seed, index, fault_rate=fault_rate, extra=extra, **run_kw)
        outcomes.append(o)
        if on_outcome is not None:
            on_outcome(o)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(failed=sum(bool(x["failed"]) for x in outcomes))
        summary = summarize(engine, seed, outcomes, first=first, seconds=time.perf_counter() - t0)
        if out:
            write_json(out, summary)
    if bar is not None:
        bar.close()
    summary["stopped_early"] = stopped
    summary["configs_requested"] = configs
    if out:
        write_json(out, summary)
    return summary


def write_json(path: str, summary: dict) -> None:
    """The summary indented, its ``outcomes`` one compact line each (valid JSON either way)."""
    head = {k: v for k, v in summary.items() if k != "outcomes"}
    text = json.dumps(head, indent=1, default=str)[:-2]
    lines = ",\n".join(json.dumps(o, separators=(",", ":"), default=str) for o in summary.get("outcomes", []))
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f'{text},\n "outcomes": [\n{lines}\n ]\n}}\n')
    os.replace(tmp, path)


def format_table(summary: dict) -> str:
    """A short table: totals, faulted twins, and one reproducer line per failing configuration."""
    s, f = summary, summary["faulted"]
    cut = f" (of {s['configs_requested']}: time budget reached)" if s.get("stopped_early") else ""
    lines = [
        f"fuzz {s['engine']} seed {s['seed']}: {s['configs']} configs{cut} in {s['seconds']} s on {s['machine']['node']}",
        f"{'passed':>8} {'failed':>7} {'false+':>7} {'tokens!=':>9} {'unchecked':>10} {'errors':>7} {'forwards':>9}",
        f"{s['passed']:>8} {s['failed']:>7} {s['false_positives']:>7} {s['tokens_differ']:>9} "
        f"{s['forwards_unchecked']:>10} {s['errors']:>7} {s['engine_forwards']:>9}",
        f"faulted twins: {f['twins']} drawn, {f['fired']} fired, {f['caught']} caught, "
        f"{f['right_request']} against the right request",
    ]
    for kind, c in sorted(f["by_kind"].items()):
        lines.append(f"  {kind}: {c['caught']}/{c['fired']} caught, {c['right_request']} right request")
    for fail in s["failures"]:
        lines.append(f"FAIL [{','.join(fail['failed'])}] {fail['reproducer']}")
        if fail["error"]:
            lines.append(f"     {fail['error'][:200]}")
        for v in fail["first_violations"][:2]:
            lines.append(f"     {v[:200]}")
    return "\n".join(lines)


def describe_violation(v) -> str:
    """One line for a `Violation` (reason, launch tag, group, slot, request, step)."""
    return (f"step {v.step} {v.reason_label} tag {v.launch_tag.name} group {v.group} slot {v.slot} "
            f"request {v.request_id}")
