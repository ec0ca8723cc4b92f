"""Diagnostic (device): where the vLLM adapter's per-forward host time goes on a GPU.

1B-shaped dummy Llama, in-process engine core (the worker's connector is this process's), 64 requests of 2-3 k
prompts. Round 0 warms up (Triton compiles); round 1 runs with (a) torch's CUDA sync debug mode switched on inside
the connector's two hooks only (every synchronising op there warns; unique stacks are counted) and (b) cProfile over
the hooks once the round's prefill is past (``KVC_PROFILE_SKIP`` hook calls, default 60: decode forwards). Prints each
hook's median / p90 time per call, the sync sites and the top functions by cumulative time inside the hooks.
"""
from __future__ import annotations

import cProfile
import collections
import io
import json
import os
import pstats
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from vllm_gpu_overhead import SHAPES, VOCAB, _reinit, prompts  # noqa: E402


def main() -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import tempfile

    import torch
    from vllm import LLM, SamplingParams

    from kvcanary.engines.vllm import kv_transfer_config
    from kvcanary.engines.vllm.connector import KvCanaryConnector

    options = json.loads(os.environ.get("KVC_OPTIONS", "{}"))
    mdir = tempfile.mkdtemp()
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, rope_theta=500000.0,
               rms_norm_eps=1e-5, max_position_embeddings=8192, torch_dtype="bfloat16", **SHAPES["1b"])
    with open(os.path.join(mdir, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    llm = LLM(model=mdir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=3200,
              max_num_seqs=64, gpu_memory_utilization=0.5, kv_transfer_config=kv_transfer_config(**options))
    llm.collective_rpc(_reinit)
    state = {"on": False, "sites": collections.Counter(), "prof": cProfile.Profile(), "hook_s": 0.0, "calls": 0,
             "per_call": collections.defaultdict(list), "skip": int(os.environ.get("KVC_PROFILE_SKIP", "60"))}

    def wrap(name):
        orig = getattr(KvCanaryConnector, name)

        def hooked(self, *a, **k):
            if not state["on"]:
                return orig(self, *a, **k)
            t0 = time.perf_counter()
            torch.cuda.set_sync_debug_mode("warn")
            profiled = state["calls"] >= state["skip"]  # past the round's prefill forwards: decode only
            if profiled:
                state["prof"].enable()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    return orig(self, *a, **k)
            finally:
                if profiled:
                    state["prof"].disable()
                torch.cuda.set_sync_debug_mode("default")
                for w in caught:
                    if "synchroniz" in str(w.message):
                        stack = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_stack()
                                 if "kvcanary" in f.filename][-4:]
                        state["sites"][f"{name} | {' <- '.join(reversed(stack))} | {str(w.message)[:60]}"] += 1
                state["hook_s"] += time.perf_counter() - t0
                state["per_call"][name].append(time.perf_counter() - t0)
                state["calls"] += 1
        setattr(KvCanaryConnector, name, hooked)

    for n in ("bind_connector_metadata", "wait_for_save", "get_kv_connector_stats", "build_connector_meta"):
        wrap(n)
    sp = SamplingParams(max_tokens=int(os.environ.get("KVC_NEW_TOKENS", "96")), temperature=0.0, ignore_eos=True,
                        detokenize=False)
    for r in range(2):
        state["on"] = r == 1
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts(500 + r)], sp, use_tqdm=False)
        print(f"round {r}: {time.perf_counter() - t0:.2f} s", flush=True)
    print(f"hooks: {state['calls']} calls, {1e3 * state['hook_s']:.1f} ms in all ({1e6 * state['hook_s'] / max(state['calls'], 1):.0f} us/call)")
    for n, ts in state["per_call"].items():
        ts = sorted(ts)
        print(f"{n}: {len(ts)} calls, median {1e6 * ts[len(ts) // 2]:.0f} us, p90 {1e6 * ts[int(0.9 * len(ts))]:.0f} us")
    print(f"cProfile below: calls after the first {state['skip']} of round 1 (KVC_PROFILE_SKIP), i.e. decode forwards")
    print("sync sites (count | hook | kvcanary stack innermost first | message):")
    for site, n in state["sites"].most_common(25):
        print(f"{n:5d} {site}")
    s = io.StringIO()
    pstats.Stats(state["prof"], stream=s).sort_stats("cumulative").print_stats(45)
    print(s.getvalue()[:12000])
    s = io.StringIO()
    pstats.Stats(state["prof"], stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue()[:8000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
