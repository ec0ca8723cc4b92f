"""``kvcanary pd``: prefill -> decode transfer between two processes, checked on receipt.

Process P (rank 0) prefills each request on a simulated engine with the canary on, exports the
request's KV blocks with their canary records (`SimMoves.transfer_out`) and sends both over
``torch.distributed`` (gloo on the CPU; NCCL with tensors on the GPU — the same calls). Process D
(rank 1) receives, writes the KV into its own slots, imports + verifies the records
(`SimMoves.transfer_in`) and only then decodes the request with the canary on. A request whose receipt
reports a violation is dropped before any decode step reads its KV.

Scenarios, one request each (seeded prompts; the previous request's transfer is what a stale block
comes from):

* ``clean``            — nothing wrong: zero violations, the same tokens as one process doing both;
* ``unfilled_block``   — one block's KV taken before the prefill forward wrote it (sent too early);
* ``zeroed_in_flight`` — one block's KV zeroed on the wire;
* ``out_of_order``     — two blocks (KV with their records) delivered swapped;
* ``stale_block``      — one block (KV and records) from the previous request's transfer.

The sampler makes each token a function of the request's KV bytes, so "same tokens" means the KV D
decodes from is the KV P computed.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from typing import Optional

import torch

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryValueError
from kvcanary.engines.sim import SimConfig, SimEngine
from kvcanary.engines.sim.moves import SimMoves, Transfer
from kvcanary.ops import FailReason
from kvcanary.runtime import Canary, CanaryConfig

SCENARIOS = ("clean", "unfilled_block", "zeroed_in_flight", "out_of_order", "stale_block")
BLOCK = 4  # slots per transferred block


def _sim_config(seed: int) -> SimConfig:
    return SimConfig(num_slots=1024, max_requests=8, max_context=128, block_size=BLOCK, num_layers=2, seed=seed,
                     chunk_size=64, max_batch_tokens=128)


def _engine(seed: int, checked: bool = True) -> SimEngine:
    sc = _sim_config(seed)
    canary = None
    if checked:
        config = CanaryConfig(mode="log", health_interval=0, stats_interval=0, readable_per_step=0, sweep_interval=8)
        canary = Canary(config, groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                        max_batch_tokens=sc.max_batch_tokens)
    engine = SimEngine(sc, canary)
    if not hasattr(engine, "sampler"):
        raise KvCanaryRuntimeError("kv-canary: pd needs SimEngine.sampler (a token function of the KV)")
    engine.sampler = _kv_sampler(engine)
    return engine


def _kv_sampler(engine: SimEngine):
    """The next token as a function of the request's stored K bytes (layer 0) and the position."""
    def sample(rid: str, position: int) -> int:
        req = engine.request(rid)
        k = engine.kv[("full", 0)][0]
        idx = torch.tensor(req.full_slots[: req.num_computed], dtype=torch.int64, device=k.device)
        words = k[idx, :8].contiguous().view(torch.int64).flatten()
        mixed = int((words * torch.arange(1, words.numel() + 1, device=k.device)).sum())
        return 1 + (mixed ^ (position * 0x9E3779B1)) % 31999

    return sample


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 32000, (int(torch.randint(14, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in SCENARIOS]


def _prefill(engine: SimEngine, prompt: list[int], rid: str, max_new: int, fault: Optional[str]):
    """Run ``rid``'s prefill on P; for ``unfilled_block`` also keep its block 1 KV as it was before the forward."""
    early = {}

    def snapshot(batch):
        if rid in (batch.request_ids or ()) and "kv" not in early:
            loc = batch.groups["full"].out_cache_loc
            slots = loc[BLOCK : 2 * BLOCK].tolist()
            early["kv"] = SimMoves(engine)._read_kv(slots).clone()
        return batch

    if fault == "unfilled_block":
        engine.batch_hooks.append(snapshot)
    engine.add_request(prompt, max_new, rid=rid)
    while True:
        engine.step()
        req = engine.request(rid)
        if req.num_computed == len(prompt):
            break
    if fault == "unfilled_block":
        engine.batch_hooks.remove(snapshot)
    return early.get("kv")


def _corrupt(t: Transfer, fault: Optional[str], previous: Optional[Transfer], early: Optional[torch.Tensor]) -> Transfer:
    kv, records = t.kv.clone(), t.records.clone()
    b1 = slice(BLOCK, 2 * BLOCK)
    if fault == "unfilled_block":
        kv[:, b1] = early
    elif fault == "zeroed_in_flight":
        kv[:, b1] = 0
    elif fault == "out_of_order":
        order = list(range(t.num_computed))
        order[BLOCK : 2 * BLOCK], order[2 * BLOCK : 3 * BLOCK] = order[2 * BLOCK : 3 * BLOCK], order[BLOCK : 2 * BLOCK]
        kv = kv[:, order]
        records = torch.cat([records[:1], records[1:][order]])
    elif fault == "stale_block":
        kv[:, b1] = previous.kv[:, b1]
        records[1:][b1] = previous.records[1:][b1]
    return Transfer(rid=t.rid, tokens=t.tokens, num_computed=t.num_computed, max_new=t.max_new,
                    generated=t.generated, kv=kv, records=records)


def _decode(engine: SimEngine, rid: str) -> list[int]:
    req = next(r for r in engine.running if r.rid == rid)
    while req.state == "running":
        engine.step()
    return list(req.tokens)


# ---- the two ranks -----------------------------------------------------------------------------------
def _send(t: Transfer, dst: int, device: torch.device) -> None:
    import torch.distributed as dist

    meta = dict(rid=t.rid, tokens=list(t.tokens), num_computed=t.num_computed, max_new=t.max_new,
                generated=t.generated, kv_shape=list(t.kv.shape), rec_shape=list(t.records.shape))
    dist.send_object_list([meta], dst=dst, device=device if device.type == "cuda" else None)
    dist.send(t.kv.to(device).contiguous(), dst=dst)
    dist.send(t.records.to(device).contiguous(), dst=dst)


def _recv(src: int, device: torch.device) -> Transfer:
    import torch.distributed as dist

    box = [None]
    dist.recv_object_list(box, src=src, device=device if device.type == "cuda" else None)
    meta = box[0]
    kv = torch.empty(meta["kv_shape"], dtype=torch.uint8, device=device)
    records = torch.empty(meta["rec_shape"], dtype=torch.int64, device=device)
    dist.recv(kv, src=src)
    dist.recv(records, src=src)
    return Transfer(rid=meta["rid"], tokens=tuple(meta["tokens"]), num_computed=meta["num_computed"],
                    max_new=meta["max_new"], generated=meta["generated"], kv=kv.cpu(), records=records.cpu())


def _rank_main(rank: int, port: int, seed: int, max_new: int, out_path: str, backend: str) -> None:
    import logging

    import torch.distributed as dist

    logging.getLogger("kvcanary").setLevel(logging.ERROR)  # the table reports what the receipt checks found
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    try:
        if rank == 0:
            engine = _engine(seed)
            moves = SimMoves(engine)
            for i, (fault, prompt) in enumerate(zip(SCENARIOS, _prompts(seed))):
                rid = f"req{i}-{fault}"
                early = _prefill(engine, prompt, rid, max_new, fault)
                t = moves.transfer_out(rid)
                if fault == "unfilled_block":
                    t = _corrupt(t, fault, None, early)
                _send(t, 1, device)
            json.dump({"p_violations": engine.canary.counters()["total"]}, open(out_path + ".p", "w"))
        else:
            engine = _engine(seed + 1)
            moves = SimMoves(engine)
            rows, previous = [], None
            for fault in SCENARIOS:
                t = _recv(0, device)
                sent = t
                if fault in ("zeroed_in_flight", "out_of_order", "stale_block"):
                    t = _corrupt(t, fault, previous, None)
                steps_before = engine.forwards
                req, report = moves.transfer_in(t)
                row = dict(scenario=fault, request=t.rid, blocks=t.num_computed // BLOCK + bool(t.num_computed % BLOCK),
                           caught=not report.clean, violations=len(report.violations),
                           reasons=sorted({b.label for v in report.violations for b in FailReason if v.reasons & b}),
                           tags=sorted({v.launch_tag.name for v in report.violations}),
                           blamed=sorted({str(v.request_id) for v in report.violations}),
                           slots=sorted({v.slot for v in report.violations}),
                           import_step=report.step, decode_forwards_before_catch=engine.forwards - steps_before)
                if report.clean:
                    row["tokens"] = _decode(engine, t.rid)[len(t.tokens) - t.generated :]
                else:
                    engine.abort(req)  # never decoded: the receipt check stops it first
                rows.append(row)
                previous = sent
            json.dump({"rows": rows, "d_violations": engine.canary.counters()["total"]}, open(out_path + ".d", "w"))
    finally:
        dist.destroy_process_group()


def _reference_tokens(seed: int, max_new: int) -> dict[str, list[int]]:
    """One process doing prefill and decode of the clean scenario's request (no canary)."""
    prompt = _prompts(seed)[0]
    engine = _engine(seed, checked=False)
    rid = "req0-clean"
    engine.add_request(prompt, max_new, rid=rid)
    req = engine.waiting[-1]
    while req.state in ("waiting", "running"):
        engine.step()
    return {rid: list(req.tokens[len(prompt) :])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pd(*, seed: int = 0, max_new: int = 6, backend: Optional[str] = None) -> dict:
    """Run both ranks (spawned processes) and return the result table as a dict."""
    import torch.multiprocessing as mp

    backend = backend or ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pd")
        mp.spawn(_rank_main, args=(_free_port(), seed, max_new, out, backend), nprocs=2, join=True)
        p = json.load(open(out + ".p"))
        d = json.load(open(out + ".d"))
    reference = _reference_tokens(seed, max_new)
    for row in d["rows"]:
        if "tokens" in row and row["request"] in reference:
            row["same_tokens_as_one_process"] = row["tokens"] == reference[row["request"]]
    clean = d["rows"][0]
    ok = (not clean["caught"] and clean.get("same_tokens_as_one_process", False)
          and all(r["caught"] and r["blamed"] == [r["request"]] and r["decode_forwards_before_catch"] == 0
                  for r in d["rows"][1:]))
    return dict(backend=backend, seed=seed, prefill_violations=p["p_violations"], rows=d["rows"], ok=ok)


def format_table(result: dict) -> str:
    head = ("scenario", "blocks", "caught", "viol", "reasons", "blamed", "tokens")
    rows = [head]
    for r in result["rows"]:
        tok = ("same as one process" if r.get("same_tokens_as_one_process") else "DIFFERENT") if "tokens" in r else "not decoded"
        rows.append((r["scenario"], str(r["blocks"]), "yes" if r["caught"] else "no", str(r["violations"]),
                     "+".join(r["reasons"]) or "-", ",".join(r["blamed"]) or "-", tok))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    right = {1, 3}  # numbers
    lines = [f"kvcanary pd: prefill (rank 0) -> decode (rank 1) over {result['backend']}, seed {result['seed']}"]
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.append(f"prefill-side violations: {result['prefill_violations']}; result: {'OK' if result['ok'] else 'FAILED'}")
    return "\n".join(lines)


BACKENDS = ("gloo", "nccl")


def check_args(args) -> None:
    """Every argument, before the two processes start (a bad backend would fail in both, late)."""
    from kvcanary.cli.paths import check_output_path

    if args.max_new < 1:
        raise KvCanaryValueError(f"kv-canary: --max-new must be >= 1, got {args.max_new}")
    check_output_path("--json", args.json)
    if args.backend is None:
        return
    if args.backend not in BACKENDS:
        raise KvCanaryValueError(f"kv-canary: --backend {args.backend!r} is not one of {', '.join(BACKENDS)}")
    import torch.distributed as dist

    if not dist.is_available():
        raise KvCanaryValueError("kv-canary: --backend: this torch build has no torch.distributed")
    if args.backend == "nccl":
        if not dist.is_nccl_available():
            raise KvCanaryValueError("kv-canary: --backend nccl: this torch build has no NCCL (a CPU build?); "
                                     "use --backend gloo")
        if torch.cuda.device_count() < 2:
            raise KvCanaryValueError(f"kv-canary: --backend nccl needs 2 CUDA devices, this machine has "
                                     f"{torch.cuda.device_count()}; use --backend gloo")
    elif not dist.is_gloo_available():
        raise KvCanaryValueError("kv-canary: --backend gloo: this torch build has no gloo")


def main(args) -> int:
    check_args(args)
    print("kvcanary pd: starting two processes (prefill, decode) ...", file=sys.stderr, flush=True)
    result = run_pd(seed=args.seed, max_new=args.max_new, backend=args.backend)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")
    return 0 if result["ok"] else 1
