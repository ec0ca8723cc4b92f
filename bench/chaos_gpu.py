"""The fail-safe chaos run on a CUDA machine: transformers continuous batching (tiny random Llama) with the engine's
CUDA graphs (``use_cuda_graph=True``) and with the canary's own graphs (eager engine), the canary's internals made
to fail at seeded points; plus a CUDA machine without a working Triton ("Triton unavailable": ``import triton``
fails; "Triton cannot compile": ``CC`` names no compiler and Triton's cache is empty), each in a child process.

Checked per case: tokens identical to the canary-off run of the same mode, no request lost, no violation,
counters honest (``checked_forwards < engine_forwards`` once forwards ran after the failure), the calling thread
back on its stream, torch's CUDA generator usable outside capture, and ``generate_batch`` without the canary still
serving afterwards. Without Triton: ``attach`` refuses with a ``kv-canary:`` message naming the cause, or (opted in)
runs eagerly on the twins; an engine with CUDA graphs is refused on that path.

    PYTHONPATH=src python bench/chaos_gpu.py [--cases 6] [--seed 1] [--budget-s 240]

Prints a table; writes ``$OUT/chaos_gpu.json`` when ``OUT`` is set. ``--cpu-smoke``: the eager cases on the CPU
(no graphs, no children), to check the script itself on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

if os.environ.get("KVCANARY_TEST_BLOCK_TRITON") == "1":  # child "triton_missing": import triton fails
    sys.modules["triton"] = None  # type: ignore[assignment]

import torch  # noqa: E402

POINTS = {  # name -> (target, stage); see tests/chaos_support.py
    "stage": ("kvcanary.runtime.staging:StaticBatch.stage", "forward"),
    "head": ("kvcanary.runtime.launch:ForwardLaunches.head", "forward"),
    "write_op": ("kvcanary.runtime.launch:launch_canary_write_kernels", "forward"),
    "verify_op": ("kvcanary.runtime.launch:launch_canary_verify_kernels", "forward"),
    "tail": ("kvcanary.runtime.launch:ForwardLaunches.tail", "forward"),
    "sweep_slice": ("kvcanary.runtime.sweep:Sweeper.slice_device", "sweep"),
    "drain": ("kvcanary.runtime.drain:ViolationDrain.end_step", "drain"),
    "describe": ("kvcanary.engines.transformers_cb.forward_view:ForwardTranslator.describe", "adapter"),
    "own_capture": ("kvcanary.runtime.graphs:CanaryGraphs._capture", "capture"),
    "sweep_capture": ("kvcanary.runtime.canary:capture_sweep_slice", "capture"),
}
HOST_READ = "host_read_in_capture"  # a launch that reads the device on the host while captured: capture invalidated


def _generate(model, prompts, *, graphs: bool):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcanary.cli.demo import PAGE_SIZE

    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=40, max_batch_tokens=64, max_requests_per_batch=4,
                                  use_cuda_graph=graphs, use_async_batching=False)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


def _inject(mp, name: str, at_call: int, when: str):
    """Like tests/chaos_support.inject; ``HOST_READ`` makes the HEAD launches read the device while captured."""
    import importlib

    from kvcanary.runtime.cuda_host import capturing

    target = POINTS["head"][0] if name == HOST_READ else POINTS[name][0]
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    original = getattr(owner, attr)
    state = {"calls": 0, "fired": False}

    def wrapper(*args, **kwargs):
        if name == HOST_READ:
            if capturing():
                state["calls"] += 1
                if state["calls"] == at_call:
                    state["fired"] = True
                    torch.zeros(1, device="cuda").item()  # forbidden inside a capture
            return original(*args, **kwargs)
        state["calls"] += 1
        if state["calls"] != at_call:
            return original(*args, **kwargs)
        state["fired"] = True
        if when == "after":
            original(*args, **kwargs)
        raise RuntimeError(f"chaos: {name}#{at_call}/{when}")

    if isinstance(owner, type) and isinstance(owner.__dict__.get(attr), staticmethod):
        wrapper = staticmethod(wrapper)  # type: ignore[assignment]
    mp.setattr(owner, attr, wrapper)
    return state


def _after_checks(model, prompts, ref, graphs: bool) -> dict:
    """The process still serves: the thread's stream, the CUDA generator outside capture, generate_batch."""
    out = {}
    if torch.cuda.is_available():
        out["stream_restored"] = torch.cuda.current_stream() == torch.cuda.default_stream()
        try:
            torch.rand(4, device="cuda").sum().item()
            out["rng_ok"] = True
        except Exception as exc:  # noqa: BLE001
            out["rng_ok"] = False
            out["rng_error"] = str(exc)[:200]
    try:
        out["serves_after"] = _generate(model, prompts, graphs=graphs) == ref
    except Exception as exc:  # noqa: BLE001
        out["serves_after"] = False
        out["serves_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def chaos_cases(model, prompts, refs, *, modes, n: int, seed: int, deadline: float) -> list[dict]:
    from _pytest.monkeypatch import MonkeyPatch

    from kvcanary.engines.transformers_cb import attach
    from kvcanary.errors import KvCanaryError

    rng = random.Random(seed)
    rows = []
    for mode_name, graphs in modes:
        # the clean run first: every forward checked
        handle = attach(model, mode="log", sweep_interval=4)
        with handle:
            clean = _generate(model, prompts, graphs=graphs)
        c = handle.counters()
        rows.append(dict(engine=f"tf/{mode_name}", mode="log", case="none", fired=False,
                         same=clean == refs[graphs], engine_forwards=c["engine_forwards"],
                         checked=c["checked_forwards"], unchecked=c["unchecked_forwards"],
                         suspended=c.get("last_suspension") is not None, errors=len(handle.errors),
                         **_after_checks(model, prompts, refs[graphs], graphs)))
        names = [k for k in POINTS if not (k == "own_capture" and graphs) and not (k == "sweep_capture" and not graphs)]
        names.append(HOST_READ)
        picks = [(rng.choice(names), rng.randint(1, 6), rng.choice(("before", "after"))) for _ in range(n)]
        if HOST_READ not in [p[0] for p in picks]:
            picks[-1] = (HOST_READ, 1, "before")
        for i, (name, at_call, when) in enumerate(picks + [(picks[0][0], picks[0][1], "raise")]):
            if time.monotonic() > deadline:
                rows.append(dict(engine=f"tf/{mode_name}", mode="-", case=f"{name}: skipped (time budget)"))
                continue
            raise_mode = when == "raise"
            mp = MonkeyPatch()
            state = _inject(mp, name, at_call, "before" if raise_mode else when)
            row = dict(engine=f"tf/{mode_name}", mode="raise" if raise_mode else "log", case=f"{name}#{at_call}/{when}")
            try:
                handle = attach(model, mode="raise" if raise_mode else "log", sweep_interval=4)
                raised = None
                try:
                    with handle:
                        out = _generate(model, prompts, graphs=graphs)
                except KvCanaryError as exc:
                    raised, out = exc, None
                c = handle.counters()
                row.update(fired=state["fired"], same=None if raise_mode else out == refs[graphs],
                           engine_forwards=c["engine_forwards"], checked=c["checked_forwards"],
                           unchecked=c["unchecked_forwards"], suspended=bool(c.get("suspended") or c["canary_errors"]),
                           errors=len(handle.errors), raised=str(raised)[:160] if raised else None)
            except Exception as exc:  # noqa: BLE001 — a case that breaks the script is itself a finding
                row.update(fired=state["fired"], crash=f"{type(exc).__name__}: {str(exc)[:300]}",
                           trace=traceback.format_exc()[-1500:])
            finally:
                mp.undo()
            row.update(_after_checks(model, prompts, refs[graphs], graphs))
            row["ok"] = _ok(row)
            rows.append(row)
    return rows


def _ok(row: dict) -> bool:
    if "crash" in row or not row.get("serves_after", False) or row.get("rng_ok") is False \
            or row.get("stream_restored") is False:
        return False
    if row["mode"] == "raise":
        return bool(row.get("raised")) or not row.get("fired")
    if not row.get("same") or row.get("errors"):
        return False
    if row.get("fired"):
        return row["checked"] < row["engine_forwards"] or row["unchecked"] > 0
    return row["checked"] == row["engine_forwards"]


# ---- children: a CUDA machine without a working Triton ------------------------------------------------------
def child(kind: str) -> dict:
    """Run in a child process whose Triton is broken (``kind``): attach refuses, or degrades when opted in."""
    from kvcanary.cli.demo import tiny_model, workload
    from kvcanary.engines.transformers_cb import attach
    from kvcanary.errors import KvCanaryError

    logging.getLogger("kvcanary").setLevel(logging.WARNING)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("kvcanary").addHandler(Keep())
    model = tiny_model("llama", torch.device("cuda"), seed=0)
    prompts = workload(seed=1, num_requests=6)
    out: dict = {"kind": kind}
    ref_eager = _generate(model, prompts, graphs=False)
    ref_graphs = _generate(model, prompts, graphs=True)
    try:
        attach(model, mode="log").detach()
        out["refused_at_attach"] = False
    except KvCanaryError as exc:
        out["refused_at_attach"] = True
        out["refusal"] = str(exc)
    with attach(model, mode="log", allow_eager_fallback=True) as handle:
        got = _generate(model, prompts, graphs=False)
    c = handle.counters()
    out["fallback_eager"] = dict(same=got == ref_eager, engine_forwards=c["engine_forwards"],
                                 checked=c["checked_forwards"], device_path=c.get("device_path"),
                                 errors=len(handle.errors), violations=c["total"],
                                 warnings=sum("eager fallback" in w for w in warnings))
    handle = attach(model, mode="log", allow_eager_fallback=True)
    with handle:
        got = _generate(model, prompts, graphs=True)
    c = handle.counters()
    out["fallback_engine_graphs_log"] = dict(same=got == ref_graphs, engine_forwards=c["engine_forwards"],
                                             checked=c["checked_forwards"], suspended=c.get("last_suspension"),
                                             canary_errors=c["canary_errors"])
    try:
        with attach(model, mode="raise", allow_eager_fallback=True):
            _generate(model, prompts, graphs=True)
        out["fallback_engine_graphs_raise"] = "not refused"
    except KvCanaryError as exc:
        out["fallback_engine_graphs_raise"] = str(exc)[:300]
    out["serves_after"] = _generate(model, prompts, graphs=True) == ref_graphs
    out["ok"] = bool(out["refused_at_attach"] and out["refusal"].startswith("kv-canary:")
                     and out["fallback_eager"]["same"] and out["fallback_eager"]["device_path"] == "eager_fallback"
                     and out["fallback_eager"]["checked"] == out["fallback_eager"]["engine_forwards"] > 0
                     and out["fallback_eager"]["warnings"] == 1
                     and out["fallback_engine_graphs_log"]["same"]
                     and "needs CUDA graphs" in str(out["fallback_engine_graphs_log"]["suspended"])
                     and "needs CUDA graphs" in out["fallback_engine_graphs_raise"] and out["serves_after"])
    return out


def run_child(kind: str, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    if kind == "triton_missing":
        env["KVCANARY_TEST_BLOCK_TRITON"] = "1"
    else:  # triton_compile: no compiler for Triton's launcher, and nothing cached to skip the build
        env["CC"] = "/nonexistent/cc"
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvcanary-empty-triton-cache-")
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", kind], env=env, capture_output=True, text=True,
                              timeout=max(10.0, timeout))
    except subprocess.TimeoutExpired:
        return {"kind": kind, "ok": False, "error": "timed out"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("CHILD "):
            return json.loads(line[len("CHILD "):])
    return {"kind": kind, "ok": False, "error": f"rc={proc.returncode}: {proc.stderr[-2000:]}"}


def table(rows: list[dict]) -> str:
    cols = ("engine", "mode", "case", "fired", "same", "engine_forwards", "checked", "unchecked", "suspended",
            "serves_after", "stream_restored", "rng_ok", "ok")
    cells = [[str(r.get(c, "-")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=6, help="chaos cases per mode (plus one in raise mode)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this")
    ap.add_argument("--child", choices=("triton_missing", "triton_compile"))
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.child:
        print("CHILD " + json.dumps(child(args.child)), flush=True)
        return 0
    start = time.monotonic()
    from kvcanary.cli.demo import tiny_model, workload

    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("chaos_gpu: needs a CUDA device (or --cpu-smoke)")
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    model = tiny_model("llama", device, seed=0)
    prompts = workload(seed=1, num_requests=6)
    modes = [("engine_graphs", True), ("own_graphs", False)] if cuda else [("eager", False)]
    refs = {graphs: _generate(model, prompts, graphs=graphs) for _, graphs in modes}
    children = []
    if cuda:  # first, while the budget is whole: each child compiles nothing of the canary
        for kind in ("triton_missing", "triton_compile"):
            children.append(run_child(kind, timeout=90))
    rows = chaos_cases(model, prompts, refs, modes=modes, n=args.cases, seed=args.seed,
                       deadline=start + args.budget_s)
    print(table(rows))
    for c in children:
        print(f"\nno working Triton ({c['kind']}): ok={c.get('ok')}")
        for key in ("refusal", "fallback_eager", "fallback_engine_graphs_log", "fallback_engine_graphs_raise",
                    "serves_after", "error"):
            if key in c:
                print(f"  {key}: {c[key]}")
    ok = all(r.get("ok", True) for r in rows) and all(c.get("ok") for c in children)
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                  seconds=round(time.monotonic() - start, 1), ok=ok, rows=rows, children=children)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "chaos_gpu.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nchaos_gpu: ok={ok} in {result['seconds']} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
