"""Diagnostic (device): the vLLM adapter's host time per decode forward, section by section, without a profiler.

1B-shaped dummy Llama, in-process engine core, 64 requests of 2-3 k prompts, 96 new tokens (round 0 warms up). Each
section below is wrapped with a ``perf_counter`` pair (~0.3 us each); per section: calls per forward and the median and
mean time per forward over round 1's decode forwards (forwards with one token per row). Nested sections overlap (a
parent's time includes its children's). Also: vLLM's own step time and the canary's ``canary_seconds`` per forward.

    python bench/diag/vllm_host_sections.py
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from vllm_gpu_overhead import SHAPES, VOCAB, _reinit, prompts  # noqa: E402


SHAPE = os.environ.get("KVC_SHAPE", "1b")  # or "8b"


def main() -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if os.environ.get("KVC_TINY"):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    import kvcanary.engines.vllm.forward_view as fv
    from kvcanary.engines.vllm import kv_transfer_config
    from kvcanary.engines.vllm.connector import KvCanaryConnector
    from kvcanary.runtime import upload
    from kvcanary.runtime.canary import Canary
    from kvcanary.runtime.drain import ViolationDrain
    from kvcanary.runtime.staging import StaticBatch

    options = kv_transfer_config(**json.loads(os.environ.get("KVC_OPTIONS", "{}")))
    if os.environ.get("KVC_TINY"):  # a CPU smoke run (VLLM_CPU_KVCACHE_SPACE=2) of this script (vllm-cpu): tiny model, short prompts
        from kvcanary.faults.vllm_workload import write_tiny_model

        llm = LLM(model=write_tiny_model(tempfile.mkdtemp(), "llama", layers=4), load_format="dummy",
                  skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=1024, block_size=32,
                  max_num_seqs=64, enforce_eager=True, kv_transfer_config=options)
        make_prompts = lambda seed: [p[:300] for p in prompts(seed)]  # noqa: E731
        new_tokens = 16
    else:
        mdir = tempfile.mkdtemp()
        cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, rope_theta=500000.0,
                   rms_norm_eps=1e-5, max_position_embeddings=8192, torch_dtype="bfloat16", **SHAPES[SHAPE])
        with open(os.path.join(mdir, "config.json"), "w") as fh:
            json.dump(cfg, fh)
        llm = LLM(model=mdir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=3200,
                  max_num_seqs=64, gpu_memory_utilization=0.5 if SHAPE == "1b" else 0.85,
                  kv_transfer_config=options)
        make_prompts, new_tokens = prompts, 96
    if not os.environ.get("KVC_TINY"):
        llm.collective_rpc(_reinit)
    state = {"on": False, "fw": -1, "decode": False, "in_sweep": False}
    sweep_spent: dict[str, list[float]] = collections.defaultdict(list)  # per explicit sweep, device-synchronised
    spent: dict[str, dict[int, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    calls: dict[str, int] = collections.Counter()

    def wrap(owner, name, label):
        orig = getattr(owner, name)

        def timed(*a, **k):
            if not state["on"]:
                return orig(*a, **k)
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                spent[label][state["fw"]] += time.perf_counter() - t0
                calls[label] += 1
        setattr(owner, name, timed)

    def wrap_synced(owner, name, label, outer=False):
        """Inside an explicit sweep: wall time with the device synchronised before and after (the sweep's parts)."""
        orig = getattr(owner, name)

        def timed(*a, **k):
            if not (state["on"] and (outer or state["in_sweep"])):
                return orig(*a, **k)
            import torch
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            state["in_sweep"] = True
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                sync()
                sweep_spent[label].append(time.perf_counter() - t0)
                if outer:
                    state["in_sweep"] = False
        setattr(owner, name, timed)

    events: dict[str, dict[int, list]] = collections.defaultdict(dict)  # label -> forward -> [start, end] CUDA events

    def wrap_events(owner, name, label):
        """Device time of the work a call queues: CUDA events before and after it (read once at the end)."""
        orig = getattr(owner, name)

        def timed(*a, **k):
            import torch
            if not (state["on"] and torch.cuda.is_available()):
                return orig(*a, **k)
            pair = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            pair[0].record()
            try:
                return orig(*a, **k)
            finally:
                pair[1].record()
                events[label][state["fw"]] = pair
        setattr(owner, name, timed)

    orig_describe = fv.WorkerView.describe

    def describe(self, step):
        if state["on"]:
            state["fw"] += 1
            state.setdefault("decode_fw", set())
            if len(step.query) and max(step.query) == 1:
                state["decode_fw"].add(state["fw"])
        return orig_describe(self, step)
    fv.WorkerView.describe = describe
    for owner, name, label in [
        (KvCanaryConnector, "build_connector_meta", "sched.build_connector_meta"),
        (KvCanaryConnector, "bind_connector_metadata", "bind"),
        (KvCanaryConnector, "_step", "bind.step"),
        (fv.WorkerView, "apply", "bind.apply"),
        (fv.WorkerView, "describe", "bind.describe"),
        (upload.ColumnUpload, "__call__", "bind.describe.upload"),
        (fv.WorkerView, "_tables", "bind.describe.tables"),
        (fv, "launch_block_table_slots_kernel", "bind.describe.tables.block_table_kernel"),
        (fv, "launch_mark_written_slots_kernel", "bind.describe.tables.mark_written_kernel"),
        (Canary, "before_forward", "bind.before_forward"),
        (Canary, "begin_step", "bind.before_forward.begin_step"),
        (StaticBatch, "stage", "bind.before_forward.stage"),
        (Canary, "launch_head", "bind.before_forward.launch_head"),
        (KvCanaryConnector, "wait_for_save", "save"),
        (Canary, "after_forward", "save.after_forward"),
        (Canary, "launch_tail", "save.after_forward.launch_tail"),
        (Canary, "end_step", "save.after_forward.end_step"),
        (ViolationDrain, "end_step", "save.after_forward.end_step.drain"),
        (KvCanaryConnector, "_launch_sweep", "save.sweep"),
        (KvCanaryConnector, "get_kv_connector_stats", "stats"),
    ]:
        wrap(owner, name, label)
    wrap_events(Canary, "launch_head", "device.launch_head")
    wrap_events(Canary, "launch_tail", "device.launch_tail")
    wrap_events(fv.WorkerView, "describe", "device.describe")
    wrap_events(StaticBatch, "stage", "device.stage")
    from kvcanary.engines.vllm.layout import StripMirror
    from kvcanary.runtime import kernels
    from kvcanary.runtime import sweep as sweep_mod
    for owner, name, label in [
        (fv.WorkerView, "live_masks", "sweep.live_masks"),
        (StripMirror, "refresh_all", "sweep.mirrors_refresh_all"),
        (sweep_mod.Sweeper, "run_masks", "sweep.run_masks"),
        (kernels, "sweep_slice", "sweep.run_masks.fill_chunk"),
        (sweep_mod.Sweeper, "_launch", "sweep.run_masks.verify_chunk"),
    ]:
        wrap_synced(owner, name, label)
    wrap_synced(KvCanaryConnector, "_launch_sweep", "sweep(total)", outer=True)
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    conn = []
    for r in range(2):
        state["on"] = r == 1
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": [t % 500 + 3 for t in p] if os.environ.get("KVC_TINY") else p} for p in make_prompts(700 + r)], sp, use_tqdm=False)
        print(f"round {r}: {time.perf_counter() - t0:.2f} s", flush=True)
    dec = sorted(state.get("decode_fw", ()))
    print(f"round 1: {state['fw'] + 1} forwards, {len(dec)} decode forwards (one token per row)")
    print(f"{'section':48s} {'calls/fw':>8s} {'median us':>10s} {'mean us':>9s} {'max us':>9s}  (per decode forward)")
    for label in spent:
        per = [1e6 * spent[label].get(f, 0.0) for f in dec]
        print(f"{label:48s} {calls[label] / max(state['fw'] + 1, 1):8.2f} {statistics.median(per):10.1f} "
              f"{statistics.fmean(per):9.1f} {max(per):9.1f}")
    if events:
        import torch
        torch.cuda.synchronize()
        print("device time of the work queued by each call (CUDA events), per decode forward:")
        for label, per_fw in events.items():
            ts = [1e3 * per_fw[f][0].elapsed_time(per_fw[f][1]) for f in dec if f in per_fw]
            if ts:
                print(f"{label:48s} {len(ts):8d} {statistics.median(ts):10.1f} {statistics.fmean(ts):9.1f} {max(ts):9.1f}  us")
    if sweep_spent:
        print(f"explicit sweeps in round 1 (device synchronised around each part, so kernels count): "
              f"{len(sweep_spent['sweep(total)'])}")
        n_sweeps = max(len(sweep_spent["sweep(total)"]), 1)
        for label, ts in sweep_spent.items():
            print(f"{label:48s} calls {len(ts):3d}  ms total per sweep: "
                  + " ".join(f"{1e3 * t / n_sweeps:.2f}" for t in [sum(ts)]) + f"  first calls: "
                  + " ".join(f"{1e3 * t:.2f}" for t in ts[:6]))
    sys.stdout.flush()
    if os.environ.get("KVC_PROFILE", "1") == "1" and not os.environ.get("KVC_TINY"):
        state["on"] = False
        _profile_round(llm, sp, make_prompts(702))
    return 0


def _profile_round(llm, sp, prompts_) -> None:
    """One more round under torch.profiler (CUDA activity): device time per kernel name, the canary's kernels
    (Triton names starting with ``_``) beside vLLM's own, per decode step of the round."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([{"prompt_token_ids": p} for p in prompts_], sp, use_tqdm=False)
    torch.cuda.synchronize()
    rows = [(e.key, e.count, getattr(e, "device_time_total", 0) or getattr(e, "self_device_time_total", 0)) for e in prof.key_averages()]
    rows = [r for r in rows if r[2]]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"profile: device time by kernel over one round ({total / 1e3:.1f} ms in all; {sp.max_tokens} tokens per request)")
    for key, count, us in rows[:40]:
        print(f"kernel {100 * us / total:6.2f}% {us / 1e3:10.2f} ms {count:7d} calls  {key[:110]}")


if __name__ == "__main__":
    raise SystemExit(main())
