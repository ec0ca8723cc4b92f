"""Clean-workload fuzzing of transformers continuous batching (the engine `kvcanary.attach` checks).

A configuration draws a tiny randomly initialised model built here (no download): Llama (full
attention), Qwen3 with a mix of sliding and full layers, Mistral (every layer sliding), Gemma2
(alternating) or Gemma3 (five sliding layers per full one), 2-8 layers, a window shorter or longer than
the prompts; the engine's `ContinuousBatchingConfig` (page size 4-64, block sharing, ``num_blocks``
small enough to evict, CPU offload, ``max_batch_tokens`` small enough to chunk prefill,
``max_requests_per_batch`` 1-16); a workload of prompts sharing a few system prompts, greedy or sampled
with forks (``num_return_sequences`` 2-4), optionally the token oracle; and the canary's options
(``sweep_interval``, ``real_kv_hash``, ``deep_fingerprints``, ``drain_interval``).

`run_config`: one unchecked ``generate``, one checked in ``raise`` mode (0 violations, the same tokens,
``checked_forwards == engine_forwards``), and with ``faulted`` a twin in ``log`` mode with one injector of
`kvcanary.faults.transformers` (a flipped fingerprinted K byte of a slot the forward reads, or one read
redirected to another live slot) that must be caught against the request that read it.

``device="cuda", cuda_graphs=True`` runs the engine with ``use_cuda_graph=True``; ``dry_graphs=True``
(CPU) pads batches and runs the warmup exactly as graph mode does, the steps driven from the adapter's
``compute_batch`` wrapper (``attach(..., graph_driver=True)``) — everything of graph mode but the capture. In both, faults are fired between
the engine's batch preparation and the forward (replays run no forward hooks).
"""
from __future__ import annotations

import contextlib
import logging
import random
import time
from typing import Optional

import torch

from kvcanary.faults.fuzz import describe_violation, fault_result, outcome

ENGINE = "transformers"
VOCAB = 128
ARCHS = ("llama", "qwen3", "mistral", "gemma2", "gemma3")
GENERATE_TIMEOUT_S = 300.0  # a generate that makes no progress for this long is stopped and reported
_MODELS: dict = {}  # (arch, layers, window, layer types, seed, device) -> model (a few kept)


# ---- configurations ------------------------------------------------------------------------------------
def sample_config(rng: random.Random) -> dict:
    """A JSON-ready configuration: model, engine, workload, canary."""
    arch = rng.choice(ARCHS)
    layers = rng.randint(2, 8)
    window = rng.choice([3, 4, 6, 8, 12, 16, 24, 40, 64]) if arch != "llama" else None
    layer_types = None
    if arch == "qwen3":  # sliding and full layers, at least one of each
        layer_types = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]
        layer_types[rng.randrange(layers)] = "sliding_attention"
        full = [i for i in range(layers) if layer_types[i] == "full_attention"]
        if not full:
            layer_types[(layer_types.index("sliding_attention") + 1) % layers] = "full_attention"
    page = rng.choice([4, 8, 16, 32, 64])
    fork = rng.random() < 0.3
    tight = rng.random() < 0.5
    offload = tight and rng.random() < 0.4  # a tight cache, more requests and longer decodes: requests get offloaded
    big = rng.random() < 0.2  # a fifth: the many-request workloads real false alarms needed (10-40 requests)
    if big:
        n_requests = rng.randint(6, 12) if fork else rng.randint(10, 40)
    else:
        n_requests = rng.randint(3, 8) if offload else rng.randint(1, 8 if not fork else 4)
    max_new = rng.randint(8, 24) if offload else rng.randint(1, 12)
    systems = [rng.randint(2, 40) for _ in range(rng.randint(1, 3))]
    user = (1, rng.randint(1, 30))
    longest = max(systems) + user[1] + max_new
    need = -(-longest // page) + 1
    return {
        "size": "big" if big else "small",
        "model": {"arch": arch, "layers": layers, "window": window, "layer_types": layer_types,
                  "model_seed": rng.randrange(4)},
        "engine": {
            "page_size": page, "allow_block_sharing": rng.random() < 0.7,
            "num_blocks": need + (rng.randint(0, 3) if tight else rng.randint(16, 64)),
            "max_batch_tokens": rng.choice([4, 8, 16, 24, 32, 64, 128, 256]),
            "max_requests_per_batch": rng.choice([1, 1, 2, 2, 3, 4, 6, 8, 12, 16]),  # few per batch: more turnover
            "cpu_offload_space": 0.01 if offload else 0.0,
        },
        "workload": {
            "requests": n_requests, "system_lens": systems, "user_len": list(user),
            "share_prob": rng.choice([0.0, 0.5, 0.8, 1.0]), "max_new_tokens": max_new,
            "num_return_sequences": rng.randint(2, 4) if fork else 1, "do_sample": fork or rng.random() < 0.2,
            "oracle": not fork and rng.random() < 0.3,
        },
        "canary": {
            "sweep_interval": rng.choice([1, 2, 3, 4, 8, 16, 32, 64]),
            "real_kv_hash": rng.choice(["none", "partial", "all"]),
            "deep_fingerprints": rng.random() < 0.6,
            "drain_interval": rng.choice([1, 2, 4, 8, 16]),
        },
    }


def prompts_of(config: dict, seed: int) -> list[list[int]]:
    w = config["workload"]
    rng = random.Random(f"tf-prompts:{seed}")
    systems = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in w["system_lens"]]
    out = []
    for _ in range(w["requests"]):
        user = [rng.randrange(1, VOCAB) for _ in range(rng.randint(*w["user_len"]))]
        out.append((list(rng.choice(systems)) if rng.random() < w["share_prob"] else []) + user)
    return out


def build_model(spec: dict, device: str = "cpu"):
    """The tiny random model of ``spec`` (cached: a few at a time)."""
    from transformers import (
        Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
        MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    key = (spec["arch"], spec["layers"], spec["window"], tuple(spec["layer_types"] or ()), spec["model_seed"], device)
    if key in _MODELS:
        return _MODELS[key]
    torch.manual_seed(1000 + spec["model_seed"])
    common = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  vocab_size=VOCAB, max_position_embeddings=512, num_hidden_layers=spec["layers"],
                  attn_implementation="sdpa")
    arch, w = spec["arch"], spec["window"]
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(sliding_window=w, use_sliding_window=True, max_window_layers=spec["layers"],
                                             layer_types=list(spec["layer_types"]), **common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=w, **common))
    elif arch == "gemma2":  # no SDPA path in 5.24.0
        model = Gemma2ForCausalLM(Gemma2Config(sliding_window=w, **dict(common, attn_implementation="eager")))
    elif arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(sliding_window=w, **common))
    else:
        raise ValueError(f"unknown architecture {arch!r}")
    model = model.to(device).eval()
    if len(_MODELS) >= 6:
        _MODELS.pop(next(iter(_MODELS)))
    _MODELS[key] = model
    return model


# ---- running the engine ------------------------------------------------------------------------------
class _HostTorch:
    """``torch`` as the offloading manager sees it without an accelerator (its host pool asks for
    ``pin_memory=True``, which CPU-only torch refuses; plain host memory behaves the same)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)


@contextlib.contextmanager
def engine_patches(*, offload: bool, dry_graphs: bool):
    """CPU offload without pinned memory (when no CUDA), and the graph-mode dry run's padded batches (see the module
    docstring)."""
    from transformers.generation.continuous_batching import model_runner, offloading_manager

    saved = []
    if offload and not torch.cuda.is_available():
        saved.append((offloading_manager, "torch", offloading_manager.torch))
        offloading_manager.torch = _HostTorch()
    if dry_graphs:
        init = model_runner.ModelRunner.__init__

        def padded_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.pad_inputs = True

        saved.append((model_runner.ModelRunner, "__init__", init))
        model_runner.ModelRunner.__init__ = padded_init
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def generate(model, prompts, config: dict, seed: int, *, cuda_graphs: bool = False) -> dict:
    """``generate_batch`` with the configuration's engine and generation settings; returns
    {request id: (error or None, generated tokens)}. Stops the engine and raises `TimeoutError` when it makes
    no progress for `GENERATE_TIMEOUT_S`."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    w, e = config["workload"], config["engine"]
    torch.manual_seed(seed)
    gen = GenerationConfig(max_new_tokens=w["max_new_tokens"], do_sample=w["do_sample"],
                           num_return_sequences=w["num_return_sequences"], eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=e["page_size"], num_blocks=e["num_blocks"],
                                  max_batch_tokens=e["max_batch_tokens"],
                                  max_requests_per_batch=e["max_requests_per_batch"],
                                  allow_block_sharing=e["allow_block_sharing"], cpu_offload_space=e["cpu_offload_space"],
                                  use_cuda_graph=cuda_graphs, use_async_batching=False, seed=seed)
    n = len(prompts) * w["num_return_sequences"]
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=w["max_new_tokens"],
                          num_requests=n)
    results: dict = {}
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb, block=True,
                                                   timeout=5, workload_hints=hints) as manager:
        manager.add_requests(inputs=prompts, max_new_tokens=w["max_new_tokens"])
        last = time.monotonic()
        while len(results) < n:
            r = manager.get_result(timeout=0.5)
            if r is not None:
                if r.is_finished():
                    results[r.request_id] = (None if r.error is None else str(r.error), list(r.generated_tokens))
                last = time.monotonic()
            elif not manager.is_running():
                break
            elif time.monotonic() - last > GENERATE_TIMEOUT_S:
                manager.stop(block=True, timeout=10, hard_stop=True)
                raise TimeoutError(f"the engine made no progress for {GENERATE_TIMEOUT_S:.0f} s "
                                   f"({len(results)}/{n} requests finished)")
    return results


def _canary_options(config: dict) -> dict:
    return dict(config["canary"], readable_per_step=0, health_interval=0)


# ---- faults ------------------------------------------------------------------------------------------------
def _pick_injector(config: dict, model, rng: random.Random):
    from kvcanary.faults.transformers import FlipUsedBlockByte, RedirectRead

    types = set(getattr(model.config, "layer_types", None) or
                (["sliding_attention"] if getattr(model.config, "sliding_window", None) else ["full_attention"]))
    after = rng.randint(1, 3)
    seed = rng.randrange(1 << 30)
    if "full_attention" in types and config["canary"]["real_kv_hash"] != "none" and rng.random() < 0.5:
        return FlipUsedBlockByte(seed=seed, after_step=after)
    group = rng.choice(sorted("full" if t == "full_attention" else "swa" for t in types))
    return RedirectRead(group=group, seed=seed, after_step=after)


class _BetweenSteps:
    """Fire a `kvcanary.faults.transformers` injector between the engine's batch preparation and the forward
    (graph mode: replays run no forward hooks), on views of the engine's static buffers."""

    def __init__(self, injector, handle) -> None:
        self.injector = injector
        self.handle = handle
        self._saved = None

    def install(self) -> None:
        from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

        from kvcanary.engines.transformers_cb import compat

        prepare = ContinuousBatchingIOs.prepare_batch_tensors
        inj, handle = self.injector, self.handle

        def prepare_then_inject(io, *args, **kwargs):
            prepare(io, *args, **kwargs)
            batch = list(io.requests_in_batch)
            if compat.is_warmup(batch):
                return
            current = handle._current
            inj.step = (current.canary.step if current is not None and current.cache is io.cache else 0) + 1
            if not inj.ledger and inj.step > inj.after_step:
                inj.fire(io.cache, _static_kwargs(io), batch)
            inj.seen.update(fs.state.request_id for fs in batch)

        self._saved = (ContinuousBatchingIOs, prepare)
        ContinuousBatchingIOs.prepare_batch_tensors = prepare_then_inject

    def remove(self) -> None:
        if self._saved is not None:
            cls, prepare = self._saved
            cls.prepare_batch_tensors = prepare
            self._saved = None


def _static_kwargs(io) -> dict:
    n = len(io.cache.cache_allocators)
    reads = [io.read_index_storage[i, : io.true_read_sizes[i] if io.max_kv_read else 0] for i in range(n)]
    return {
        "block_table": io.block_table[:, : io.num_request_in_batch] if io.use_block_table else None,
        "read_index": reads,
        "write_index": [io.write_index_storage[i, : io.true_write_sizes[i]] for i in range(n)],
        "cu_seq_lens_k": io.cumulative_seqlens_k,
        "input_ids": io.input_ids[None, :] if hasattr(io, "input_ids") else None,
    }


# ---- one configuration -----------------------------------------------------------------------------------
class _Trial:
    """One configuration's model, prompts and engine switches, shared by its unchecked, checked and faulted
    runs."""

    def __init__(self, config: dict, seed: int, device: str, cuda_graphs: bool, dry_graphs: bool) -> None:
        self.config, self.seed = config, seed
        self.model = build_model(config["model"], device)
        self.prompts = prompts_of(config, seed)
        self.cuda_graphs, self.dry_graphs = cuda_graphs, dry_graphs
        self.graphs = cuda_graphs and not dry_graphs
        self.offload = config["engine"]["cpu_offload_space"] > 0
        self.use_oracle = config["workload"]["oracle"]

    def generate(self) -> dict:
        return generate(self.model, self.prompts, self.config, self.seed, cuda_graphs=self.graphs)

    def run(self, mode: Optional[str], injector=None):
        """``(tokens, handle, error)`` of one ``generate``: unchecked when ``mode`` is None, else attached in
        ``mode`` with ``injector`` (if any) installed. Every hook is removed and the handle detached on return."""
        from kvcanary.engines.transformers_cb import attach
        from kvcanary.faults.tf_oracle import OracleSampler
        from kvcanary.runtime.report import CanaryViolationError

        sampler = OracleSampler(VOCAB).install(self.model) if self.use_oracle else None
        handle = between = error = None
        tokens: dict = {}
        try:
            with engine_patches(offload=self.offload, dry_graphs=self.dry_graphs):
                if mode is None:
                    tokens = self.generate()
                else:
                    handle = attach(self.model, mode=mode, token_oracle=sampler.token if sampler else None,
                                    graph_driver=self.dry_graphs, **_canary_options(self.config))
                    between = self._install(injector, handle)
                    try:
                        with handle:
                            tokens = self.generate()
                    except CanaryViolationError:
                        pass  # counted from the handle
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        finally:
            for hook in (injector, between, sampler):
                if hook is not None:
                    hook.remove()
            if handle is not None and not handle._detached:
                handle.detach()
        return tokens, handle, error

    def _install(self, injector, handle) -> Optional[_BetweenSteps]:
        """Install ``injector``: between the engine's steps in graph modes (returned, to remove), else as a
        forward hook on the model."""
        if injector is None:
            return None
        if self.cuda_graphs or self.dry_graphs:
            between = _BetweenSteps(injector, handle)
            between.install()
            return between
        injector.install(self.model)
        return None


def _clean_outcome(trial: _Trial, reference: dict, ref_error, tokens: dict, handle, error) -> dict:
    """The outcome of the unchecked run against the checked one (``raise`` mode, no fault)."""
    counters = handle.counters() if handle is not None else {}
    found = handle.violations() if handle is not None else []
    failed = sorted(rid for rid, (err, _) in tokens.items() if err is not None)
    errors = [x for x in (f"unchecked run: {ref_error}" if ref_error else None,
                          f"checked run: {error}" if error else None) if x]
    ref_failed = [err for err, _ in reference.values() if err]
    engine_error = None
    if ref_failed:  # the engine fails this configuration without the canary: an engine limit, not a canary finding
        engine_error = f"{len(ref_failed)} request(s) failed in the unchecked run too: {ref_failed[0][:300]}"
    elif failed and not counters.get("total"):
        errors.append(f"checked run: {len(failed)} request(s) failed: {tokens[failed[0]][0][:300]}")
    return outcome(
        ENGINE, trial.seed, trial.config, violations=int(counters.get("total", 0)),
        false_positive=bool(counters.get("total", 0)), tokens_identical=bool(reference) and tokens == reference,
        engine_forwards=int(counters.get("engine_forwards", 0)), checked_forwards=int(counters.get("checked_forwards", 0)),
        error="; ".join(errors) or None, engine_error=engine_error, first_violations=[describe_violation(v) for v in found[:5]],
        stats={"requests": len(reference), "unchecked_forwards": counters.get("unchecked_forwards"),
               "sessions": handle.sessions if handle is not None else 0, "moves": counters.get("moves"),
               "by_reason": counters.get("by_reason")},
    )


def _fault_outcome(trial: _Trial) -> dict:
    """The faulted twin (``log`` mode, one injector drawn from the seed): fired, caught, against the right
    request."""
    from kvcanary.faults.transformers import match

    rng = random.Random(f"tf-fault:{trial.seed}")
    injector = _pick_injector(trial.config, trial.model, rng)
    _, fhandle, ferror = trial.run("log", injector)
    if not injector.ledger:
        return fault_result(injector.fault, fired=False, error=ferror)
    inj = injector.ledger[0]
    hit = match(inj, fhandle.violations())
    return fault_result(injector.fault, fired=True, caught=hit is not None,
                        right_request=hit is not None and hit["request"] == inj.request_id,
                        detail=inj.detail, step=inj.step, request_id=inj.request_id, group=inj.group,
                        reasons=hit["reasons"] if hit else [], error=ferror)


def run_config(config: dict, *, seed: int, faulted: bool, device: str = "cpu", cuda_graphs: bool = False,
               dry_graphs: bool = False) -> dict:
    """See the module docstring. Returns a `kvcanary.faults.fuzz.outcome` dict."""
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    t0 = time.perf_counter()
    trial = _Trial(config, seed, device, cuda_graphs, dry_graphs)
    reference, _, ref_error = trial.run(None)
    tokens, handle, error = trial.run("raise")
    out = _clean_outcome(trial, reference, ref_error, tokens, handle, error)
    if faulted:
        out["fault"] = _fault_outcome(trial)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out
