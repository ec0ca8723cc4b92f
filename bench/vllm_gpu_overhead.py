"""vLLM on a GPU: what the canary costs per decode step and in prefill, at vLLM's defaults (issue: vLLM on the GPU).

vLLM runs as it does by default (engine-core process and worker process, V2 model runner, torch.compile,
FULL_AND_PIECEWISE CUDA graphs, FlashAttention, async scheduling). Random-weight (``load_format="dummy"``, re-scaled so tokens depend on the KV) Llama-shaped models — ``1b``
(Llama-3.2-1B shape) and ``8b`` (Llama-3.1-8B shape) — serve rounds of 64 requests with 2-3 k-token prompts
(fresh random prompts per round: no prefix hits across rounds) and 128 new tokens each, greedy. Each arm is an
engine of its own, alive for the whole run in a child process: ``none`` (no canary), ``canary`` (default options), ``canary_nokv`` (``real_kv_hash="none"``), ``canary_nohole`` (``padding_read_check=False``: the padding-read check's share), ``canary_after``
(``check_after_forward=True``: each forward checked in wait_for_save from a copy of its inputs taken in bind), ``none_again`` (a second engine without the canary: how far vLLM's own
tokens vary between two engines, the yardstick for the canary arms' token differences; ``--arms``),
``none_ngram`` / ``canary_ngram`` (n-gram speculative decoding, 3 draft tokens; ``canary_ngram`` is compared with
``none_ngram``), ``none_eagle`` / ``canary_eagle`` (EAGLE speculative decoding, 3 draft tokens from a one-layer
random-weight EAGLE head of the same shape, its weights re-scaled like the target's; ``canary_eagle`` is compared with
``none_eagle``), every other arm with ``none``.
One unrecorded warm-up round per arm, then interleaved rounds: round r runs on every arm (rotating order) before
round r + 1, each arm the same prompts.

Per round and arm: prefill throughput (prompt tokens / time until every request has its first token), the decode
step (time between two ``LLMEngine.step`` outputs once every request is decoding: inter-token latency), the
canary's host time per forward (the worker's own clock, ``vllm:kv_canary_canary_microseconds``), checked / engine
forwards and violations (``LLM.get_metrics()``; the worker reports them at most once a second, so each round ends
with a one-token request after 1.2 s that carries the last counts), and a hash of every output
token (identical across arms = the canary changed nothing). Prints one table, writes JSON.

    python bench/vllm_gpu_overhead.py --shapes 1b 8b --rounds 3 --out bench/vllm_gpu_overhead.gpu.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_gpu_probe import _reinit_weights as _reinit  # noqa: E402  (the same re-scaling as the probe)

SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, head_dim=64, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, head_dim=128, tie_word_embeddings=False),
}
ARMS = {"none": None, "none_again": None, "canary": {}, "canary_nokv": {"real_kv_hash": "none"}, "none_ngram": None,
        "canary_ngram": {}, "none_eagle": None, "canary_eagle": {},
        "canary_nohole": {"padding_read_check": False},  # the identity / padding-read check's share (issue 36)
        "canary_after": {"check_after_forward": True}}  # each forward checked after its launch, from a snapshot
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
EAGLE = {"method": "eagle", "num_speculative_tokens": 3}  # + "model": a one-layer draft written by the child
SPECULATIVE = {"none_ngram": NGRAM, "canary_ngram": NGRAM, "none_eagle": EAGLE, "canary_eagle": EAGLE}  # arm -> vLLM speculative_config
BASELINE = {"canary_ngram": "none_ngram", "canary_eagle": "none_eagle"}  # arm -> the arm it is compared with (default "none")
REQUESTS, NEW_TOKENS, PROMPT_MIN, PROMPT_MAX, VOCAB = 64, 128, 2048, 3072, 128256


def _reinit_with_draft(worker) -> int:
    """`_reinit` of the target model, then the same re-scaling of the speculative draft model's own parameters (the
    EAGLE head: V1 runner ``drafter.model``, V2 ``speculator.model``; those it shares with the target, the embeddings
    and the LM head, are left as the target's). Returns the parameters re-scaled."""
    import torch

    n = _reinit(worker)
    runner = getattr(getattr(worker, "worker", worker), "model_runner")
    draft = getattr(getattr(runner, "drafter", None) or getattr(runner, "speculator", None), "model", None)
    if not isinstance(draft, torch.nn.Module):
        return n
    target = runner.model if hasattr(runner, "model") else runner.get_model()
    shared = {p.data_ptr() for p in target.parameters()}
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for name, prm in draft.named_parameters():
            if prm.data_ptr() in shared:
                continue
            if "norm" in name:
                prm.fill_(1.0)
            else:
                fan_in = prm.shape[-1] if prm.dim() > 1 else 1
                prm.copy_(torch.randn(prm.shape, generator=g).mul_(fan_in ** -0.5).to(prm.dtype))
            n += 1
    return n


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB - 10) for _ in range(rng.randrange(PROMPT_MIN, PROMPT_MAX + 1))]
            for _ in range(REQUESTS)]


def child(arm: str, shape: str, util: float) -> None:
    """One engine; reads ``round SEED`` lines on stdin, answers one JSON line each."""
    import logging

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the re-scaling function
    import torch
    from vllm import LLM, SamplingParams

    logging.getLogger("kvcanary").setLevel(logging.WARNING)
    mdir = tempfile.mkdtemp(prefix=f"bench-{shape}-")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, rope_theta=500000.0,
               rms_norm_eps=1e-5, max_position_embeddings=8192, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
               **SHAPES[shape])
    with open(os.path.join(mdir, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    kw: dict[str, Any] = dict(model=mdir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                              max_model_len=PROMPT_MAX + NEW_TOKENS + 16, max_num_seqs=REQUESTS,
                              gpu_memory_utilization=util, disable_log_stats=False)
    options = ARMS[arm]
    if arm in SPECULATIVE:
        kw["speculative_config"] = dict(SPECULATIVE[arm])
        if kw["speculative_config"]["method"] == "eagle":
            ddir = tempfile.mkdtemp(prefix=f"bench-{shape}-eagle-")
            with open(os.path.join(ddir, "config.json"), "w") as fh:
                json.dump(dict(cfg, num_hidden_layers=1), fh)  # vLLM builds EagleLlamaForCausalLM from it
            kw["speculative_config"]["model"] = ddir
    if options is not None:
        from kvcanary.engines.vllm import kv_transfer_config

        kw["kv_transfer_config"] = kv_transfer_config(**options)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    try:
        reinit = llm.collective_rpc(_reinit_with_draft)[0]
    except Exception as exc:  # noqa: BLE001 — recorded: the tokens then come from flat logits
        reinit = f"failed: {type(exc).__name__}: {exc}"
    conn = options is not None
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    print(json.dumps({"ready": True, "start_s": round(start_s, 1), "device": torch.cuda.get_device_name(0),
                      "reinit": reinit}), flush=True)

    def counters() -> dict:
        out = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:kv_canary_") and getattr(m, "value", None) is not None and not m.labels.get("reason"):
                out[m.name.split(":", 1)[1]] = out.get(m.name.split(":", 1)[1], 0) + int(m.value)
        return out

    flush = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "round":
            break
        seed = int(parts[1])
        batch = prompts(seed)
        for i, p in enumerate(batch):
            engine.add_request(f"r{seed}-{i}", {"prompt_token_ids": p}, sp)
        started: set[str] = set()
        tokens: dict[str, list[int]] = {}
        decode_s, prefill_s = [], None
        seen_len: dict[str, int] = {}
        decode_tokens = 0  # tokens emitted by the timed decode steps (more than one per step with speculative decoding)
        before = counters() if conn else {}
        t_begin = time.perf_counter()
        while engine.has_unfinished_requests():
            decoding = len(started) == REQUESTS
            t1 = time.perf_counter()
            outs = engine.step()
            t2 = time.perf_counter()
            if decoding and outs:
                decode_s.append(t2 - t1)
            for o in outs:
                if o.outputs and o.outputs[0].token_ids:
                    started.add(o.request_id)
                    n_out = len(o.outputs[0].token_ids)  # cumulative outputs (the engine's default)
                    if decoding:
                        decode_tokens += n_out - seen_len.get(o.request_id, 0)
                    seen_len[o.request_id] = n_out
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
            if prefill_s is None and len(started) == REQUESTS:
                prefill_s = t2 - t_begin
        total_s = time.perf_counter() - t_begin
        digest = hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:16]
        rec: dict[str, Any] = {"arm": arm, "seed": seed, "prompt_tokens": sum(map(len, batch)),
                               "prefill_s": round(prefill_s or total_s, 4),
                               "prefill_tok_s": round(sum(map(len, batch)) / (prefill_s or total_s), 1),
                               "decode_steps": len(decode_s),
                               "decode_ms_mean": round(1e3 * statistics.fmean(decode_s), 4) if decode_s else None,
                               "decode_ms_median": round(1e3 * statistics.median(decode_s), 4) if decode_s else None,
                               "decode_tok_s": round(decode_tokens / sum(decode_s), 1) if decode_s else None,
                               "total_s": round(total_s, 3), "tokens_sha": digest, "tokens": sorted(tokens.items())}
        if conn:
            time.sleep(1.2)  # past the worker's stats period: the next step carries every count of this round
            llm.generate([{"prompt_token_ids": [11, 12, 13, 14]}], flush, use_tqdm=False)
            after = counters()
            d = {k: v - before.get(k, 0) for k, v in after.items()}
            fw = d.get("kv_canary_forwards", 0)
            rec.update(canary_host_us_per_forward=round(d.get("kv_canary_canary_microseconds", 0) / max(fw, 1), 1),
                       totals={"forwards": fw, "checked_forwards": d.get("kv_canary_checked_forwards", 0),
                               "full_graph_forwards": d.get("kv_canary_full_graph_forwards", 0),
                               "canary_graph_forwards": d.get("kv_canary_canary_graph_forwards", 0),
                               "violations": d.get("kv_canary_violations", 0), "sweeps": d.get("kv_canary_sweeps", 0)})
        print(json.dumps(rec), flush=True)


def _reply(p: subprocess.Popen, what: str) -> str:
    """The child's next JSON line (its other output skipped); exits when the child died."""
    while True:
        line = p.stdout.readline()
        if not line:
            raise SystemExit(f"engine {what} died")
        if line.startswith("{"):
            return line


def _ask(p: subprocess.Popen, seed: int, what: str) -> dict:
    p.stdin.write(f"round {seed}\n")
    p.stdin.flush()
    return json.loads(_reply(p, what))


def run_shape(shape: str, arms: list[str], rounds: int, util: float, log) -> dict:
    procs = {}
    for arm in arms:  # one at a time: each engine checks free GPU memory when it starts
        p = subprocess.Popen([sys.executable, __file__, "--child", arm, "--shape", shape, "--util", str(util)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        procs[arm] = (p, json.loads(_reply(p, f"{arm} ({shape}) at start")))
        log(f"{shape} {arm}: ready {procs[arm][1]}")
    for arm in arms:  # one warm-up round each, not recorded: Triton compiles, torch.compile's first shapes, caches
        rec = _ask(procs[arm][0], 999, f"{arm} ({shape}) in the warm-up round")
        log(f"{shape} warm-up {arm}: {json.dumps(rec)[:160]}")
    records = []
    for r in range(rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            rec = _ask(procs[arm][0], 1000 + r, f"{arm} ({shape}) in round {r}")
            rec["round"] = r
            records.append(rec)
            log(f"{shape} round {r} {arm}: decode {rec['decode_ms_mean']} ms/step, prefill {rec['prefill_tok_s']} tok/s, "
                f"host {rec.get('canary_host_us_per_forward')} us/fwd, tokens {rec['tokens_sha']}")
        for rec in records:
            base = next((x for x in records if x["round"] == r and x["arm"] == _baseline(rec["arm"], arms)), None)
            if rec["round"] == r and base is not None and rec is not base:
                rec["divergence"] = divergence(dict(base["tokens"]), dict(rec["tokens"]))
                log(f"{shape} round {r} {rec['arm']}: vs {base['arm']} {rec['divergence']}")
    for rec in records:
        rec.pop("tokens", None)
    for p, _ in procs.values():
        p.stdin.close()
        p.wait(timeout=120)
    return {"shape": shape, "arms": {a: procs[a][1] for a in arms}, "records": records}


def _baseline(arm: str, arms) -> str:
    """The arm ``arm`` is compared with: its `BASELINE` (else ``none``) when that arm runs too, else itself (a
    canary-off arm of its own kind, e.g. ``none_ngram`` without ``none``)."""
    b = BASELINE.get(arm, "none")
    return b if b in arms else arm


def divergence(base: dict[str, list[int]], mine: dict[str, list[int]]) -> dict:
    """Requests whose tokens differ from the canary-off arm's (same round, same prompts) and where they first differ
    (token index): a late first difference in a few requests is a near-tie flip of bf16 greedy decoding."""
    first = []
    for rid, ref in base.items():
        got = mine.get(rid)
        if got != ref:
            got = got or []
            first.append(next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got))))
    return {"requests_differing": len(first), "requests": len(base),
            "first_index_min": min(first) if first else None,
            "first_index_median": statistics.median(first) if first else None}


def summarise(result: dict) -> list[dict]:
    rows = []
    for shape in result["shapes"]:
        recs = shape["records"]
        for arm in shape["arms"]:
            base = [r for r in recs if r["arm"] == _baseline(arm, shape["arms"])]
            mine = [r for r in recs if r["arm"] == arm]
            med = statistics.fmean(r["decode_ms_median"] for r in mine)
            b_med = statistics.fmean(r["decode_ms_median"] for r in base)
            dec = statistics.fmean(r["decode_ms_mean"] for r in mine)
            pre = statistics.fmean(r["prefill_tok_s"] for r in mine)
            tok = [r.get("decode_tok_s") for r in mine]
            b_tok = [r.get("decode_tok_s") for r in base]
            tok_s = statistics.fmean(tok) if tok and None not in tok else None
            b_tok_s = statistics.fmean(b_tok) if b_tok and None not in b_tok else None
            b_dec = statistics.fmean(r["decode_ms_mean"] for r in base)
            b_pre = statistics.fmean(r["prefill_tok_s"] for r in base)
            same = all(r["tokens_sha"] == next(b["tokens_sha"] for b in base if b["round"] == r["round"]) for r in mine)
            host = [r["canary_host_us_per_forward"] for r in mine if "canary_host_us_per_forward" in r]
            tot = [r["totals"] for r in mine if "totals" in r]
            rows.append({"shape": shape["shape"], "arm": arm, "baseline": _baseline(arm, shape["arms"]),
                         "rounds": len(mine), "decode_ms": round(dec, 3),
                         "decode_vs_none_pct": round(100 * (dec / b_dec - 1), 2), "decode_median_ms": round(med, 3),
                         "decode_median_vs_none_pct": round(100 * (med / b_med - 1), 2), "prefill_tok_s": round(pre),
                         "prefill_vs_none_pct": round(100 * (pre / b_pre - 1), 2), "tokens_identical": same,
                         "decode_tok_s": round(tok_s) if tok_s else None,
                         "decode_tok_s_vs_none_pct": round(100 * (tok_s / b_tok_s - 1), 2) if tok_s and b_tok_s else None,
                         "requests_differing": sum(r.get("divergence", {}).get("requests_differing", 0) for r in mine),
                         "host_us_per_forward": round(statistics.fmean(host), 1) if host else None,
                         "checked_eq_forwards": all(t["checked_forwards"] == t["forwards"] for t in tot) if tot else None,
                         "violations": sum(t["violations"] for t in tot) if tot else None,
                         "full_graph_forwards": sum(t["full_graph_forwards"] for t in tot) if tot else None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    ap.add_argument("--arms", nargs="+", default=None, choices=sorted(ARMS),
                    help="default: none, canary, canary_nokv for 1b; none + canary for 8b (none_again: a second canary-off "
                         "engine; none_ngram / canary_ngram, none_eagle / canary_eagle: speculative decoding)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--util", type=float, default=None, help="gpu_memory_utilization per engine")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.shape, args.util)
        return 0
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    result: dict[str, Any] = {"bench": "vllm_gpu_overhead", "requests": REQUESTS, "new_tokens": NEW_TOKENS,
                              "prompt_tokens": [PROMPT_MIN, PROMPT_MAX], "rounds": args.rounds, "shapes": []}
    for shape in args.shapes:
        arms = args.arms or (["none", "canary", "canary_nokv"] if shape == "1b" else ["none", "canary"])
        util = args.util or (0.28 if len(arms) == 3 else 0.44)
        result["shapes"].append(run_shape(shape, arms, args.rounds, util, log))
        if args.out:  # the records first: a summary that fails loses nothing
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)
        result["summary"] = summarise(result)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)
    print(f"{'shape':5} {'arm':12} {'vs arm':10} {'decode ms':>9} {'vs':>8} {'median ms':>9} {'vs':>8} "
          f"{'prefill tok/s':>13} {'vs':>8} {'host us/fwd':>12} {'same tokens':>11} {'checked=fwd':>11} {'viol':>4} "
          f"{'dec tok/s':>10} {'vs %':>7}")
    for r in result["summary"]:
        print(f"{r['shape']:5} {r['arm']:12} {r['baseline']:10} {r['decode_ms']:9.3f} {r['decode_vs_none_pct']:7.2f}% "
              f"{r['decode_median_ms']:9.3f} {r['decode_median_vs_none_pct']:7.2f}% {r['prefill_tok_s']:13d} "
              f"{r['prefill_vs_none_pct']:7.2f}% {str(r['host_us_per_forward']):>12} {str(r['tokens_identical']):>11} "
              f"{str(r['checked_eq_forwards']):>11} {str(r['violations']):>4} {str(r['decode_tok_s']):>10} "
              f"{str(r['decode_tok_s_vs_none_pct']):>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
