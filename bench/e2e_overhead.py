"""End-to-end canary overhead on transformers continuous batching: decode step and prefill, graphs off/on.

One randomly initialised Llama-shaped model (default: the 1B shape — 16 layers, hidden 2048, 32 heads,
8 KV heads, bf16), one workload (default: 64 requests of 2-3 k random prompt tokens, 32 new tokens,
pages of 32), run back to back in one process under each configuration:

    baseline            no canary
    canary/default      kvcanary.attach(mode="log")     (PARTIAL fingerprints + deep fingerprints: the default)
    canary/partial      kvcanary.attach(mode="log", real_kv_hash="partial", deep_fingerprints=False)
    canary/none         kvcanary.attach(mode="log", real_kv_hash="none")      (no real-KV fingerprints)

each with CUDA graphs off and on (on: ``ContinuousBatchingConfig(use_cuda_graph=True)``; CUDA only).
Per configuration: the median decode-step time (an engine step whose requests all decode one token:
scheduling + input preparation + forward + sampling + the host copy of the outputs — what a user waits
for), the prefill time per prompt token (every other step, summed, over their query tokens), overhead
against the mean of the baseline runs of the same graph mode, whether the generated tokens equal the
baseline's, launches the Triton launchers handed to the torch twins (``twins``: should be 0), and the
canary's own host time per step (mean and median) (time inside the adapter's and runtime's entry points; with graphs off it
includes enqueueing the canary's kernels, with graphs on only the host half — the device half replays
inside the engine's graph). Steps are timed with ``time.perf_counter`` around the engine's own
``prepare_next_batch`` .. ``update_batch`` (the engine synchronises its compute stream in between).
A warm round runs every configuration once first (not reported: Triton compiles, allocator); then
``--repeats`` measured rounds interleave the configurations (baseline, default, partial, none, baseline, ...)
so drift hits them alike; step times are pooled over the rounds and the baselines' spread is printed. The
engine's decode step is bimodal from one ``generate_batch`` to the next (whole runs land ~10-20 % apart, with
or without the canary: docs/lab/NOTES.md runs 15 and 18), so each row also gives its best round (the lowest
per-round median) against the baseline's best round; ``decode med`` is the canary's host time on a decode
step (median), ``graphs`` the engine graphs captured with the canary inside.

    python bench/e2e_overhead.py --quick            # H200: ~4 minutes with model init
    python bench/e2e_overhead.py --tiny             # CPU smoke run (2 layers, 4 requests)
    python bench/e2e_overhead.py --json out.json    # also write the rows as JSON
    python bench/e2e_overhead.py --device-profile   # CUDA: + one profiled run per configuration
    python bench/e2e_overhead.py --drain-interval 16 --health-interval 0   # canary options for every configuration
    python bench/e2e_overhead.py --host-probe       # + a host-speed probe around each round, decode normalised by it

``--device-profile`` (CUDA) adds, after the measured rounds, one more run of every configuration under
torch.profiler: the device time of all kernels and copies, and of the canary's Triton kernels (by name), per
engine step. Wall-clock overheads of ~1 % sit inside the engine's own spread between runs; the canary
kernels' share of the device time does not depend on that spread (the canary's torch copies, a few per
step, are not in it: they carry aten names).

``--host-probe``: the engine's decode step is host-bound (its thread's CPU time equals the step's wall time), so a
round's decode time follows the host's speed, which moved by up to 30 % between rounds on the H200's host (run 49).
A fixed host workload (small torch CPU ops and Python containers, like an engine's scheduling) is timed on the same
cores before and after every round; each round's decode time is also given scaled by the median probe over its
probe, with the overhead of those scaled rounds and the correlation of decode with probe over all rounds. The probe
sees drift between rounds, not within one.

Assert-free: a configuration that fails prints its error in the table and the run goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import platform
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import torch
from twin_fallbacks import count_twin_fallbacks  # bench/twin_fallbacks.py

PRESETS = {
    "full": dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256,
                 requests=64, prompt_min=2048, prompt_max=3072, new_tokens=32, page_size=32, max_batch_tokens=8192),
    "quick": dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256,
                  requests=32, prompt_min=1024, prompt_max=1536, new_tokens=16, page_size=32, max_batch_tokens=4096),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256,
                 requests=4, prompt_min=48, prompt_max=80, new_tokens=4, page_size=16, max_batch_tokens=64),
}
CONFIGS = [("baseline", None), ("canary/default", "partial+deep"), ("canary/partial", "partial"),
           ("canary/none", "none")]


@dataclass
class StepLog:
    """Engine steps of one run: (decode?, query tokens, seconds)."""

    steps: list = field(default_factory=list)
    cpu_s: list = field(default_factory=list)  # CPU seconds of the engine thread within each step (thread_time)
    captured: list = field(default_factory=list)  # whether the engine captured a CUDA graph in each step
    step_entries: list = field(default_factory=list)  # canary host seconds by entry point, per step
    _entries: dict = field(default_factory=dict)
    _capturing: bool = False
    canary_s: float = 0.0  # host seconds inside the canary's entry points
    by_entry: dict = field(default_factory=dict)  # entry point -> host seconds
    canary_step_s: list = field(default_factory=list)  # canary host seconds within each engine step
    twin_fallbacks: int = 0
    _t0: float = 0.0
    _c0: float = 0.0
    _p0: float = 0.0


@contextlib.contextmanager
def timed_engine_steps(log: StepLog):
    """Time each engine step from ``prepare_next_batch`` to the end of ``update_batch`` (bench-only patch of
    the processor class, removed on exit)."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    prepare, update = ContinuousBatchProcessor.prepare_next_batch, ContinuousBatchProcessor.update_batch
    capture = ModelRunner._capture_graph

    def timed_prepare(self):
        log._t0, log._c0, log._p0 = time.perf_counter(), log.canary_s, time.thread_time()
        log._entries, log._capturing = {}, False
        return prepare(self)

    def counted_capture(self, *args, **kwargs):
        log._capturing = True
        return capture(self, *args, **kwargs)

    def timed_update(self):
        batch = list(self.inputs_and_outputs.requests_in_batch)
        out = update(self)
        dt = time.perf_counter() - log._t0
        log.cpu_s.append(time.thread_time() - log._p0)
        tokens = sum(fs.query_length for fs in batch)
        log.steps.append((all(fs.query_length == 1 for fs in batch), tokens, dt))
        log.canary_step_s.append(log.canary_s - log._c0)
        log.captured.append(log._capturing)
        log.step_entries.append(log._entries)
        return out

    ContinuousBatchProcessor.prepare_next_batch, ContinuousBatchProcessor.update_batch = timed_prepare, timed_update
    ModelRunner._capture_graph = counted_capture
    try:
        yield log
    finally:
        ContinuousBatchProcessor.prepare_next_batch, ContinuousBatchProcessor.update_batch = prepare, update
        ModelRunner._capture_graph = capture


@contextlib.contextmanager
def timed_canary(log: StepLog):
    """Accumulate host time inside the canary's per-forward entry points (bench-only patches)."""
    from kvcanary.engines.transformers_cb.forward_view import ForwardTranslator
    from kvcanary.runtime import Canary

    targets = [(ForwardTranslator, "host_step"), (ForwardTranslator, "describe")] + [
        (Canary, name) for name in ("begin_step", "stage", "launch_head", "launch_tail", "end_step")
    ]
    saved = [(cls, name, getattr(cls, name)) for cls, name in targets]
    depth = [0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                log.canary_s += dt
                log.by_entry[label] = log.by_entry.get(label, 0.0) + dt
                log._entries[label] = log._entries.get(label, 0.0) + dt
                depth[0] -= 1
        label = fn.__qualname__
        return wrapper

    for cls, name, fn in saved:
        setattr(cls, name, timed(fn))
    try:
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def build_model(args, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                         vocab_size=args.vocab, max_position_embeddings=max(4096, 2 * args.prompt_max),
                         attn_implementation=args.attn)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def make_prompts(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(1, args.vocab) for _ in range(rng.randrange(args.prompt_min, args.prompt_max + 1))]
            for _ in range(args.requests)]


def cb_config(args, graphs: bool):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    per_request = -(-(args.prompt_max + args.new_tokens) // args.page_size) + 1
    return ContinuousBatchingConfig(
        page_size=args.page_size, num_blocks=args.requests * per_request + 16, max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=args.requests, use_cuda_graph=graphs, use_async_batching=False,
    )


def run_one(model, prompts, args, graphs: bool, hash_mode) -> tuple[dict, StepLog]:
    from transformers import GenerationConfig

    import kvcanary

    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    log = StepLog()
    handle = None
    if hash_mode is not None:
        deep = hash_mode.endswith("+deep")
        tuned = {k: v for k in ("drain_interval", "health_interval") if (v := getattr(args, k, None)) is not None}
        handle = kvcanary.attach(model, mode="log", real_kv_hash=hash_mode.removesuffix("+deep"),
                                 deep_fingerprints=deep, sweep_interval=args.sweep_interval,
                                 max_requests=args.requests + 8, capture_canary=args.capture_canary == "on", **tuned)
    try:
        with timed_engine_steps(log), (timed_canary(log) if handle is not None else contextlib.nullcontext()):
            _sync()
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config(args, graphs),
                                       progress_bar=False)
            _sync()
    finally:
        if handle is not None:
            handle.detach()
    tokens = {rid: list(o.generated_tokens) for rid, o in out.items()}
    counters = handle.counters() if handle is not None else {}
    return {"tokens": tokens, "counters": counters, "errors": [repr(e) for e in (handle.errors if handle else [])]}, log


def canary_kernel_names() -> set[str]:
    """Names of the Triton kernels defined in the kvcanary modules loaded now (as the profiler shows them)."""
    names = set()
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("kvcanary."):
            continue
        for attr, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if attr.endswith("_kernel") and callable(fn):
                names.add(fn.__name__)
    return names


def device_profile(model, prompts, args, graphs: bool, hash_mode) -> dict:
    """One more run under torch.profiler (CUDA activity): device ms of every kernel and copy, and of the
    canary's Triton kernels, with the engine steps the run took."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, log = run_one(model, prompts, args, graphs, hash_mode)
    canary = canary_kernel_names()
    total = ours = 0.0
    by_name: dict = {}
    for ev in prof.key_averages():
        t = ev.self_device_time_total
        if t <= 0:
            continue
        total += t
        ms, calls = by_name.get(ev.key, (0.0, 0))
        by_name[ev.key] = (ms + t / 1e3, calls + ev.count)
        if ev.key in canary:
            ours += t
    steps = len(log.steps)
    return {"device_ms": total / 1e3, "canary_kernels_ms": ours / 1e3, "steps": steps,
            "canary_pct": ours / total * 100 if total else None,
            "canary_us_per_step": ours / steps if steps else None,
            "by_name_ms": by_name}


def grown_kernels(dp: dict, base: dict, top: int = 8) -> str:
    """The device ops whose total time grew most against the baseline's profiled run: ``name +ms (calls)``. Names
    the canary's own kernels and any engine / torch op whose device time the canary changed."""
    mine, theirs = dp.get("by_name_ms", {}), base.get("by_name_ms", {})
    diff = sorted(((ms - theirs.get(k, (0.0, 0))[0], k, n - theirs.get(k, (0.0, 0))[1])
                   for k, (ms, n) in mine.items()), reverse=True)[:top]
    return "; ".join(f"{k[:48]} {d:+.1f} ms ({c:+d} calls)" for d, k, c in diff if d > 0)


def pool(logs: list) -> StepLog:
    """One StepLog of several runs (steps concatenated, host time summed)."""
    out = StepLog(steps=[s for lg in logs for s in lg.steps], canary_s=sum(lg.canary_s for lg in logs),
                  cpu_s=[c for lg in logs for c in lg.cpu_s], captured=[c for lg in logs for c in lg.captured],
                  step_entries=[e for lg in logs for e in lg.step_entries])
    out.canary_step_s = [t for lg in logs for t in lg.canary_step_s]
    for lg in logs:
        for k, v in lg.by_entry.items():
            out.by_entry[k] = out.by_entry.get(k, 0.0) + v
    return out


def summarize(log: StepLog) -> dict:
    decode = [dt for is_decode, _, dt in log.steps if is_decode]
    prefill = [(tok, dt) for is_decode, tok, dt in log.steps if not is_decode]
    prefill_tokens = sum(t for t, _ in prefill)
    steps = len(log.steps)
    # decode steps that replayed an engine graph (or ran eagerly): what a long-running server sees per token
    captured = log.captured or [False] * steps
    replays = [i for i, (d, _, _) in enumerate(log.steps) if d and not captured[i]]
    entries = sorted({k for e in log.step_entries for k in e})
    return {
        "decode_steps_captured": len(decode) - len(replays),
        "decode_ms_replayed": statistics.median(log.steps[i][2] for i in replays) * 1e3 if replays else None,
        "canary_host_ms_replayed_median": (statistics.median(log.canary_step_s[i] for i in replays) * 1e3
                                           if replays and log.canary_step_s else None),
        "canary_host_ms_replayed_median_by_entry": ({k: statistics.median(log.step_entries[i].get(k, 0.0) for i in replays)
                                                     * 1e3 for k in entries} if replays and log.step_entries else {}),
        "steps": steps,
        "decode_steps": len(decode),
        "decode_ms": statistics.median(decode) * 1e3 if decode else None,
        "decode_cpu_ms": (statistics.median(c for (d, _, _), c in zip(log.steps, log.cpu_s) if d) * 1e3
                          if decode and log.cpu_s else None),
        "prefill_us_per_token": sum(dt for _, dt in prefill) / prefill_tokens * 1e6 if prefill_tokens else None,
        "canary_host_ms_per_step": log.canary_s / steps * 1e3 if steps and log.canary_s else None,
        "canary_host_ms_median": statistics.median(log.canary_step_s) * 1e3 if log.canary_step_s else None,
        "canary_host_ms_max": max(log.canary_step_s) * 1e3 if log.canary_step_s else None,
        "canary_host_ms_decode_median": (statistics.median(c for (d, _, _), c in zip(log.steps, log.canary_step_s) if d)
                                         * 1e3 if log.canary_step_s and decode else None),
        "canary_host_ms_per_step_by_entry": {k: v / steps * 1e3 for k, v in log.by_entry.items()} if steps else {},
    }


def host_probe(reps: int = 7, ops: int = 400) -> float:
    """Milliseconds of a fixed host workload (``ops`` x two small torch CPU ops and a small dict and sort): the median
    of ``reps`` timings."""
    x = torch.zeros(256, dtype=torch.int64)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(ops):
            x.add_(1)
            x[:64].sum()
            sorted({j: (j * i) % 7 for j in range(16)}.values())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def probe_normalise(rows: list[dict], probes: dict[str, list[float]]) -> Optional[float]:
    """Per row of one graph mode: ``per_round_probe_ms``, ``per_round_decode_ms_probe_scaled`` (decode x median
    probe / the round's probe), their mean ``decode_ms_probe_scaled`` and its overhead against the baseline's.
    Returns the correlation of decode with probe over all rounds (None when undefined)."""
    ref = statistics.median(v for vs in probes.values() for v in vs)
    pairs = []
    for row in rows:
        rounds, probe = row.get("per_round_decode_ms") or [], probes.get(row["config"], [])
        row["per_round_probe_ms"] = probe
        scaled = [d * ref / p for d, p in zip(rounds, probe) if d is not None]
        pairs += [(d, p) for d, p in zip(rounds, probe) if d is not None]
        row["per_round_decode_ms_probe_scaled"] = scaled
        row["decode_ms_probe_scaled"] = statistics.mean(scaled) if scaled else None
    base = next((r["decode_ms_probe_scaled"] for r in rows if r["config"] == "baseline"), None)
    for row in rows:
        row["decode_overhead_probe_scaled_pct"] = _pct(row["decode_ms_probe_scaled"], base)
    try:
        return statistics.correlation(*zip(*pairs)) if len(pairs) > 2 else None
    except statistics.StatisticsError:  # a constant series
        return None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _pct(x, base):
    return None if x is None or base is None or base == 0 else (x / base - 1) * 100


def _profile_line(dp: dict, baseline: bool, base_ms) -> str:
    if "error" in dp:
        return f"device profile: {dp['error']}"
    line = f"device profile, one run of {dp['steps']} steps: all kernels and copies {dp['device_ms']:.1f} ms"
    if baseline:
        return line
    extra = _pct(dp["device_ms"], base_ms)
    if extra is not None:
        line += f" ({extra:+.2f} % against the baseline's)"
    return line + (f"; canary Triton kernels {dp['canary_kernels_ms']:.1f} ms = {dp['canary_pct']:.2f} % of it, "
                   f"{dp['canary_us_per_step']:.0f} us per step")


def format_table(rows: list[dict], machine: str) -> str:
    head = (f"{'graphs':<6} {'config':<15} {'decode ms':>9} {'ovh %':>7} {'best rnd':>8} {'ovh %':>7} "
            f"{'prefill us/tok':>14} {'ovh %':>7} {'canary host ms/step':>19} {'median ms':>10} {'decode med':>10} "
            f"{'same tokens':>11} {'checked/engine':>14} {'graphs':>6} {'twins':>5}")
    lines = [f"kvcanary end-to-end overhead — {machine}", head, "-" * len(head)]

    def f(x, spec):
        width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 0)
        return format(x, spec) if x is not None else "-".rjust(width)

    for r in rows:
        if "error" in r:
            lines.append(f"{r['graphs']:<6} {r['config']:<15} ERROR {r['error']}")
            continue
        if "decode_ms" not in r:  # --repeats 0: only the warm round (and the device profile) ran
            lines.append(f"{r['graphs']:<6} {r['config']:<15} no measured rounds")
            continue
        cf = r["counters"]
        ce = f"{cf.get('checked_forwards', '-')}/{cf.get('engine_forwards', '-')}" if cf else "-"
        note = f"  canary error: {r['canary_errors'][0][:120]}" if r.get("canary_errors") else ""
        lines.append(
            f"{r['graphs']:<6} {r['config']:<15} {f(r['decode_ms'], '9.2f')} {f(r.get('decode_overhead_pct'), '+7.2f')} "
            f"{f(r.get('decode_ms_best_round'), '8.2f')} {f(r.get('decode_overhead_best_round_pct'), '+7.2f')} "
            f"{f(r['prefill_us_per_token'], '14.3f')} {f(r.get('prefill_overhead_pct'), '+7.2f')} "
            f"{f(r['canary_host_ms_per_step'], '19.3f')} {f(r.get('canary_host_ms_median'), '10.3f')} "
            f"{f(r.get('canary_host_ms_decode_median'), '10.3f')} "
            f"{str(r['same_tokens']):>11} {ce:>14} {str(cf.get('graphs_captured', '-')) if cf else '-':>6} "
            f"{r.get('twin_fallbacks', 0):>5}{note}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller workload (~4 min on an H200 with model init)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke preset")
    for key, value in PRESETS["full"].items():
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {value}")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa; flash_attention_2 if installed)")
    p.add_argument("--graphs", default=None, choices=["off", "on", "both"], help="default: both on CUDA, off on CPU")
    p.add_argument("--sweep-interval", type=int, default=64)
    p.add_argument("--drain-interval", type=int, default=None,
                   help="CanaryConfig.drain_interval for every canary configuration (default: the config's, 4)")
    p.add_argument("--health-interval", type=int, default=None,
                   help="CanaryConfig.health_interval for every canary configuration (default: the config's; 0 = off)")
    p.add_argument("--capture-canary", default="on", choices=["on", "off"],
                   help="graphs off: capture the canary's own HEAD/TAIL work in CUDA graphs (the adapter's default)")
    p.add_argument("--repeats", type=int, default=3,
                   help="measured rounds (each runs every configuration once); 0 with --device-profile: the profile alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(n.split("/")[-1] for n, _ in CONFIGS),
                   help="comma-separated subset of baseline,default,partial,none")
    p.add_argument("--host-probe", action="store_true",
                   help="time a fixed host workload around each round; decode also given scaled by it")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--device-profile", action="store_true",
                   help="CUDA: one more run per configuration under torch.profiler (device time, canary kernels' share)")
    args = p.parse_args(argv)
    preset = PRESETS["tiny" if args.tiny else "quick" if args.quick else "full"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    graph_modes = {"off": [False], "on": [True], "both": [False, True]}[args.graphs or ("both" if cuda else "off")]
    wanted = set(args.configs.split(",")) | {"baseline"}
    configs = [(n, h) for n, h in CONFIGS if n.split("/")[-1] in wanted]
    if not cuda:
        graph_modes = [False]
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)

    import transformers

    import kvcanary  # noqa: F401

    machine = (torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})")
    machine += f", torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"# {machine}; {vars(args)}", flush=True)
    t0 = time.perf_counter()
    model = build_model(args, device)
    prompts = make_prompts(args)
    print(f"# model ready in {time.perf_counter() - t0:.1f}s; {args.requests} prompts, "
          f"{sum(map(len, prompts))} prompt tokens", flush=True)

    rows = []
    for graphs in graph_modes:
        mode = "on" if graphs else "off"
        # warm round (not reported): every configuration once on the whole workload with few new tokens, so
        # Triton's compilations, the allocator and lazy imports are paid before anything is timed
        warm = argparse.Namespace(**{**vars(args), "new_tokens": 2})
        for name, hash_mode in configs:
            t = time.perf_counter()
            try:
                run_one(model, prompts, warm, graphs, hash_mode)
            except Exception:  # reported again by the measured rounds
                traceback.print_exc()
            _release()
            print(f"# {mode:>3} warm {name:<15} {time.perf_counter() - t:.1f}s", flush=True)
        # measured rounds, interleaved (baseline, partial, none, baseline, ...): drift hits every config alike
        logs: dict = {name: [] for name, _ in configs}
        results: dict = {}
        errors: dict = {}
        probes: dict = {name: [] for name, _ in configs}
        for r in range(args.repeats):
            for name, hash_mode in configs:
                probe = host_probe() if args.host_probe else None
                t = time.perf_counter()
                try:
                    (result, log), twins = count_twin_fallbacks(lambda: run_one(model, prompts, args, graphs, hash_mode))
                    log.twin_fallbacks = twins
                    logs[name].append(log)
                    results[name] = result
                    if probe is not None:  # one probe per measured round of this configuration
                        probes[name].append((probe + host_probe()) / 2)
                except Exception as exc:  # assert-free: report and go on
                    traceback.print_exc()
                    errors[name] = f"{type(exc).__name__}: {exc}"[:200]
                _release()
                print(f"# {mode:>3} round {r + 1} {name:<15} {time.perf_counter() - t:.1f}s", flush=True)
        base_runs = [summarize(lg) for lg in logs["baseline"]]
        base = {key: statistics.mean(b[key] for b in base_runs if b.get(key) is not None) if base_runs else None
                for key in ("decode_ms", "prefill_us_per_token")}
        base_tokens = results.get("baseline", {}).get("tokens")
        base_best = min((b["decode_ms"] for b in base_runs if b.get("decode_ms") is not None), default=None)
        for name, hash_mode in configs:
            row = {"graphs": mode, "config": name}
            if name in errors:
                row["error"] = errors[name]
            if logs[name]:
                row.update(summarize(pool(logs[name])))
                row["per_round_decode_ms"] = [summarize(lg)["decode_ms"] for lg in logs[name]]
                row["per_round_decode_cpu_ms"] = [summarize(lg)["decode_cpu_ms"] for lg in logs[name]]
                best = min((x for x in row["per_round_decode_ms"] if x is not None), default=None)
                row["decode_ms_best_round"] = best
                row["decode_overhead_best_round_pct"] = _pct(best, base_best)
                row["twin_fallbacks"] = sum(lg.twin_fallbacks for lg in logs[name])
                result = results[name]
                row["counters"] = {k: v for k, v in result["counters"].items() if not isinstance(v, dict)}
                row["canary_errors"] = result["errors"]
                row["same_tokens"] = result["tokens"] == base_tokens if base_tokens is not None else None
                row["decode_overhead_pct"] = _pct(row.get("decode_ms"), base["decode_ms"])
                row["prefill_overhead_pct"] = _pct(row.get("prefill_us_per_token"), base["prefill_us_per_token"])
            rows.append(row)
        if args.host_probe and any(probes.values()):
            r_probe = probe_normalise(rows[-len(configs):], probes)
            flat = [v for vs in probes.values() for v in vs]
            print(f"# {mode:>3} host probe between rounds: {min(flat):.2f}-{max(flat):.2f} ms "
                  f"({(max(flat) / min(flat) - 1) * 100:.2f} %); correlation of round decode with probe: "
                  + ("-" if r_probe is None else f"{r_probe:+.2f}"), flush=True)
        if args.device_profile and cuda:
            for row, (name, hash_mode) in zip(rows[-len(configs):], configs):
                try:
                    row["device_profile"] = device_profile(model, prompts, args, graphs, hash_mode)
                except Exception as exc:  # assert-free
                    traceback.print_exc()
                    row["device_profile"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                _release()
                print(f"# {mode:>3} profiled {name}", flush=True)
        if len(base_runs) > 1:
            d = [b["decode_ms"] for b in base_runs if b.get("decode_ms") is not None]
            print(f"# {mode:>3} baseline drift between rounds: decode {min(d):.2f}-{max(d):.2f} ms "
                  f"({(max(d) / min(d) - 1) * 100:.2f} %)", flush=True)

    print(format_table(rows, machine))
    for r in rows:
        if r.get("per_round_decode_ms"):
            print(f"  {r['graphs']:<3} {r['config']:<15} decode ms per round: "
                  + ", ".join(f"{x:.2f}" for x in r["per_round_decode_ms"] if x is not None)
                  + "  (engine thread CPU ms: "
                  + ", ".join(f"{x:.2f}" for x in r.get("per_round_decode_cpu_ms", []) if x is not None) + ")")
    for r in rows:
        if r.get("per_round_decode_ms_probe_scaled"):
            print(f"  {r['graphs']:<3} {r['config']:<15} decode ms per round scaled by the host probe: "
                  + ", ".join(f"{x:.2f}" for x in r["per_round_decode_ms_probe_scaled"])
                  + f"  (probe ms: {', '.join(f'{x:.2f}' for x in r['per_round_probe_ms'])}); mean "
                  + f"{r['decode_ms_probe_scaled']:.2f}, vs baseline "
                  + ("-" if r["decode_overhead_probe_scaled_pct"] is None else f"{r['decode_overhead_probe_scaled_pct']:+.2f} %"))
    for r in rows:
        if r.get("canary_host_ms_replayed_median") is not None:
            parts = ", ".join(f"{k.split('.')[-1]} {v:.3f}" for k, v in
                              sorted(r["canary_host_ms_replayed_median_by_entry"].items(), key=lambda kv: -kv[1]))
            print(f"  {r['graphs']:<3} {r['config']:<15} decode steps that captured a graph: {r['decode_steps_captured']}"
                  f"/{r['decode_steps']}; the others: decode {r['decode_ms_replayed']:.2f} ms, canary host median "
                  f"{r['canary_host_ms_replayed_median']:.3f} ms ({parts})")
    for r in rows:
        entries = r.get("canary_host_ms_per_step_by_entry")
        if entries:
            parts = ", ".join(f"{k.split('.')[-1]} {v:.3f}" for k, v in sorted(entries.items(), key=lambda kv: -kv[1]))
            print(f"  {r['graphs']:<3} {r['config']:<15} host ms/step by entry: {parts}")
    if args.device_profile and not cuda:
        print("# --device-profile: CUDA only, skipped")
    base_profile = {r["graphs"]: r["device_profile"] for r in rows
                    if r["config"] == "baseline" and r.get("device_profile") and "error" not in r["device_profile"]}
    for r in rows:
        dp = r.get("device_profile")
        if dp:
            base = base_profile.get(r["graphs"])
            print(f"  {r['graphs']:<3} {r['config']:<15} " + _profile_line(dp, r["config"] == "baseline",
                                                                         base["device_ms"] if base else None))
            if base is not None and r["config"] != "baseline" and "error" not in dp:
                print(f"  {r['graphs']:<3} {r['config']:<15} grown most against the baseline: {grown_kernels(dp, base)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine, "args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
