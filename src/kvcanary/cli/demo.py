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

Faults are forward pre-hooks run *before* the canary's (``prepend=True``), with their own seeded
generator and a ledger of what they did where; the canary never knows about them.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from kvcanary.engines.transformers_cb.attach import attach
from kvcanary.engines.transformers_cb.forward_view import find_batch_processor
from kvcanary.engines.transformers_cb.layout import FULL_ATTENTION, SLIDING_ATTENTION, build_layouts

PAGE_SIZE = 16
SLIDING_WINDOW = 16


# ---- embedded models and workload --------------------------------------------------------------
def tiny_model(kind: str, device: torch.device, seed: int = 0):
    """A tiny randomly initialised ``llama`` (full attention) or ``qwen3_swa`` (sliding + full)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=256, max_position_embeddings=1024, attn_implementation="sdpa")
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **common))
    elif kind == "qwen3_swa":
        layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=4, sliding_window=SLIDING_WINDOW, use_sliding_window=True,
                                             max_window_layers=4, layer_types=layer_types, **common))
    else:
        raise ValueError(f"kv-canary: unknown demo model {kind!r}")
    return model.to(device).eval()


def workload(seed: int = 0, num_requests: int = 14) -> list[list[int]]:
    """Prompts: two shared system prompts (2+ pages each), user turns of 3..40 tokens, a few bare."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 256) for _ in range(40)], [rng.randrange(1, 256) for _ in range(37)]]
    prompts = []
    for i in range(num_requests):
        user = [rng.randrange(1, 256) for _ in range(rng.randrange(3, 41))]
        prompts.append(user if i % 7 == 6 else systems[i % 2] + user)
    return prompts


def generate(model, prompts, *, max_new_tokens: int = 8, max_requests_per_batch: int = 4,
             num_blocks: int = 40) -> dict[str, list[int]]:
    """``generate_batch`` with a small cache: 4 requests per batch, 64 tokens per step, no graphs."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=num_blocks, max_batch_tokens=64,
                                  max_requests_per_batch=max_requests_per_batch,
                                  use_cuda_graph=False, use_async_batching=False)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}


# ---- fault injectors -----------------------------------------------------------------------------
@dataclass
class Injection:
    """One ledger entry: what was done, where, at which forward, to which request."""

    name: str
    step: int
    group: str
    slot: int
    request_id: str
    expected: tuple[str, ...]
    detail: str


@dataclass
class _Injector:
    """Base: a forward pre-hook (run before the canary's) that fires once, after ``after_step``."""

    seed: int = 0
    after_step: int = 2
    ledger: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.step = 0
        self.seen: set[str] = set()
        self._hook = None
        self._owner = None  # (cache, its batch processor)

    def install(self, model) -> "_Injector":
        self._hook = model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True)
        return self

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _pre(self, module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is None:
            return None
        self.step += 1
        if self._owner is None or self._owner[0] is not cache:
            self._owner = (cache, find_batch_processor(cache))
        batch = list(self._owner[1].inputs_and_outputs.requests_in_batch)
        if not self.ledger and self.step > self.after_step:
            self.fire(cache, kwargs, batch)
        self.seen.update(fs.state.request_id for fs in batch)
        return None

    def fire(self, cache, kwargs, batch) -> None:
        raise NotImplementedError


class FlipSharedBlockByte(_Injector):
    """Flip one bit in the first 16 K bytes (layer 0) of a slot of a shared prefix block, just
    before the first forward of a request that reuses the block."""

    name = "flip_shared_block_byte"

    def fire(self, cache, kwargs, batch) -> None:
        alloc = cache.cache_allocators.get(FULL_ATTENTION)
        if alloc is None or not cache.use_prefix_sharing:
            return
        ps = alloc.tokens_per_page
        reusers = [fs for fs in batch if fs.state.request_id not in self.seen
                   and fs.state.position_offset - fs.query_length >= ps]
        for fs in reusers:
            rid, prefix = fs.state.request_id, fs.state.position_offset - fs.query_length
            shared = alloc.block_table[rid][: prefix // ps]
            # prefer a block no other request of this forward reads, so the hit is unambiguous
            others = {b for o in batch if o.state.request_id != rid for b in alloc.block_table.get(o.state.request_id, [])}
            blocks = [b for b in shared if b not in others] or (shared if fs is reusers[-1] else [])
            if not blocks:
                continue
            block = self.rng.choice(blocks)
            offset, byte, bit = self.rng.randrange(ps), self.rng.randrange(16), self.rng.randrange(8)
            kv = alloc.cache_tensor  # [tokens, 2, H, D]; layer rank 0 K page starts at the block's start
            per_token = kv.shape[-2] * kv.shape[-1] * kv.element_size()
            row = block * alloc.block_physical_stride + offset
            cache.cache_tensor[row * per_token + byte] ^= 1 << bit
            self.ledger.append(Injection(
                name=self.name, step=self.step, group="full", slot=block * ps + offset, request_id=rid,
                expected=("verify_real_kv_hash",),
                detail=f"block {block} offset {offset} layer {alloc.layer_indices[0]} K byte {byte} bit {bit}",
            ))
            return


class RedirectRead(_Injector):
    """Point one cached position's read index at another live slot (another request's, or another
    position of the same request) in group ``group`` for one forward."""

    name = "redirect_read"

    def __init__(self, group: str = "full", **kw) -> None:
        super().__init__(**kw)
        self.group = group

    def fire(self, cache, kwargs, batch) -> None:
        layer_type = FULL_ATTENTION if self.group == "full" else SLIDING_ATTENTION
        alloc = cache.cache_allocators.get(layer_type)
        layout = next((g for g in build_layouts(cache) if g.layer_type == layer_type), None)
        if alloc is None or kwargs.get("block_table") is not None or kwargs["read_index"][alloc.index].numel() == 0:
            return
        read = kwargs["read_index"][alloc.index]
        cu_k = kwargs["cu_seq_lens_k"][layer_type].tolist()
        window = layout.sliding_window
        rows = []  # (batch row, request id, first verified position, cached positions)
        for i, fs in enumerate(batch):
            p, e = fs.state.position_offset - fs.query_length, fs.query_length
            cached = min(p, window - 1) if window else p
            first = max(0, p + e - window) if window else 0
            if p - first >= 2:
                rows.append((i, fs.state.request_id, first, p, cached))
        if not rows:
            return
        i, rid, first, p, cached = self.rng.choice(rows)
        q = self.rng.randrange(max(first, 1), p)
        idx_q = cu_k[i] + (q - (p - cached))
        candidates = []
        for j, _, first_j, p_j, cached_j in rows:
            for q2 in range(first_j, p_j):
                idx = cu_k[j] + (q2 - (p_j - cached_j))
                if q2 != q and int(read[idx]) != int(read[idx_q]):
                    candidates.append((q2, idx))
        if not candidates:
            return
        q2, idx2 = self.rng.choice(candidates)
        phys = int(read[idx2])
        read[idx_q] = phys
        slot = int(layout.physical_to_slot(torch.tensor([phys]), for_write=False)[0])
        self.ledger.append(Injection(
            name=self.name, step=self.step, group=self.group, slot=slot, request_id=rid,
            expected=("verify_position", "verify_chain_hash"),
            detail=f"position {q} of {rid} read from the slot of position {q2} (slot {slot})",
        ))


def match(injection: Injection, violations) -> Optional[dict]:
    """The first violation that detects ``injection``: same group, at or after its step, on its slot
    or charged to its request, with one of the expected reasons (at the earliest such step, one
    charged to the injected request is preferred)."""
    hits = []
    for v in violations:
        labels = set(v.reason_label.split("+"))
        if v.group != injection.group or v.step < injection.step or not labels & set(injection.expected):
            continue
        if v.slot == injection.slot or v.request_id == injection.request_id:
            hits.append((v.step, v.request_id != injection.request_id, v, labels))
    if not hits:
        return None
    step, _, v, labels = min(hits, key=lambda h: (h[0], h[1]))
    return {"reasons": sorted(labels), "request": v.request_id, "latency_forwards": step - injection.step,
            "step": step, "tag": v.launch_tag.name}


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


def run_demo(*, device: Optional[str] = None, seed: int = 0, models=("llama", "qwen3_swa"),
             verbose: bool = False) -> dict:
    """Run the demo; returns the JSON-ready result (see `kvcanary.cli.main`). Unless ``verbose``, the
    engine's log and the canary's per-violation log lines are kept quiet (the table reports them)."""
    if not verbose:
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        logging.getLogger("kvcanary").setLevel(logging.ERROR)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    prompts = workload(seed)
    result: dict = {"device": str(dev), "models": {}, "clean": {"forwards": 0, "slots_verified": 0, "violations": 0},
                    "faults": []}
    t0 = time.perf_counter()
    for kind in models:
        model = tiny_model(kind, dev, seed)
        reference = generate(model, prompts)
        with attach(model, mode="log", sweep_interval=8, readable_per_step=0) as handle:
            checked = generate(model, prompts)
        clean = _summary(handle)
        clean["outputs_identical"] = checked == reference
        result["models"][kind] = {"clean": clean}
        for key in ("forwards", "slots_verified", "violations"):
            result["clean"][key] += clean[key]

        faults = [FlipSharedBlockByte(seed=seed), RedirectRead(group="full", seed=seed)] if kind == "llama" else \
            [RedirectRead(group="swa", seed=seed)]
        for injector in faults:
            injector.install(model)
            try:
                with attach(model, mode="log", sweep_interval=8, readable_per_step=0) as handle:
                    generate(model, prompts)
            finally:
                injector.remove()
            violations = handle.violations()
            for inj in injector.ledger:
                found = match(inj, violations)
                result["faults"].append({
                    "name": f"{kind}/{inj.name}" + (f"[{inj.group}]" if inj.name == "redirect_read" else ""),
                    "caught": found is not None, "reasons": found["reasons"] if found else [],
                    "request": found["request"] if found else None,
                    "latency_forwards": found["latency_forwards"] if found else None,
                    "injected": asdict(inj), "violations_in_run": len(violations),
                })
            if not injector.ledger:
                result["faults"].append({"name": f"{kind}/{injector.name}", "caught": False, "reasons": [],
                                         "request": None, "latency_forwards": None,
                                         "injected": None, "violations_in_run": len(violations)})
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def format_table(result: dict) -> str:
    lines = [f"kvcanary demo on {result['device']} ({result['seconds']} s)", ""]
    lines.append(f"{'model':<11} {'forwards':>8} {'slots verified':>15} {'violations':>10}  outputs identical")
    for kind, r in result["models"].items():
        c = r["clean"]
        lines.append(f"{kind:<11} {c['forwards']:>8} {c['slots_verified']:>15} {c['violations']:>10}  "
                     f"{'yes' if c['outputs_identical'] else 'NO'}")
        for reason, n in sorted(c["by_reason"].items()):
            lines.append(f"{'':<11}   {reason}: {n}")
    lines += ["", f"{'fault':<38} {'caught':>6}  {'latency':>7}  {'request':<8} reasons"]
    for f in result["faults"]:
        lat = "-" if f["latency_forwards"] is None else f"{f['latency_forwards']} fwd"
        lines.append(f"{f['name']:<38} {'yes' if f['caught'] else 'NO':>6}  {lat:>7}  {str(f['request']):<8} "
                     f"{'+'.join(f['reasons']) or '-'}")
        if f["injected"]:
            inj = f["injected"]
            lines.append(f"{'':<4}injected at forward {inj['step']} into {inj['request_id']}: {inj['detail']}")
    return "\n".join(lines)
