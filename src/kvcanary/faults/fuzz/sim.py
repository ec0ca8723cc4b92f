"""Clean-workload fuzzing of the simulated engine (`kvcanary.engines.sim`).

A configuration draws the engine's own knobs — layers, bytes per slot, page size of the prefix cache,
a sliding-window group (window shorter or longer than the prompts), pool sizes small enough to evict
cached prefixes and retract running requests, chunk size and batch budget (chunked prefill), requests
running at once, shared system prompts, aborts, forks and host offload / restore (`SimMoves`,
full-attention engines only), speculative decoding (drafts per step, acceptance rate), the token oracle, producer
identity (images in prompts from a small pool of contents, adapters and salts per request, weight updates between
forwards followed by the engine's own cache reset or keyed into its cache; the prefix-cache key holds every field,
as a correct engine's does) — and the canary's options (``sweep_interval``, ``real_kv_hash``, ``real_kv_layers``,
``deep_fingerprints``, ``drain_interval``, ``verify_token``). Sliding windows and speculative rollbacks null slots
(the padding slot) that a correct engine never reads again: the padding-read check stays silent on them.

`run_config` runs the workload unchecked, then checked (``raise``), then — faulted twin — checked
(``log``) with one `kvcanary.faults.sim` injector fired once: ``kv_flip_used`` (a bit in the
fingerprinted bytes of a slot a running request reads) or ``slot_redirect`` (one cached position read
from another live slot for one forward).
"""
from __future__ import annotations

import random
import time
from typing import Optional

from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload
from kvcanary.engines.sim.identity import IMAGE_TOKEN, SimImage
from kvcanary.engines.sim.moves import SimMoves
from kvcanary.errors import KvCanaryRuntimeError
from kvcanary.faults.accounting import account
from kvcanary.faults.fuzz import describe_violation, fault_result, outcome
from kvcanary.faults.ledger import FaultLedger
from kvcanary.faults.oracle import TokenOracle
from kvcanary.faults.sim import KvFlipUsed, SimTarget, SlotRedirect
from kvcanary.runtime import Canary, CanaryConfig
from kvcanary.runtime.identity import ProducerIdentity
from kvcanary.runtime.report import CanaryViolationError

ENGINE = "sim"
VOCAB = 32000
QUIET = dict(health_interval=0, stats_interval=0, readable_per_step=0)
DRAIN_STEPS = 3000  # forwards allowed to finish the queued work once arrivals stop
DRAIN_FORK_STEPS = 60  # forks go on this many forwards into the drain, then stop (so the drain ends)


def sample_config(rng: random.Random) -> dict:
    """A JSON-ready configuration of the simulated engine, its workload and the canary."""
    layers = rng.randint(2, 8)
    max_context = rng.choice([32, 48, 64, 96, 128])
    swa = rng.random() < 0.4
    window = rng.choice([2, 4, 8, 16, 24, 40, 64, 100]) if swa else 0
    chunk = rng.choice([1, 2, 3, 4, 8, 16, 32, 48])
    max_running = rng.randint(1, 16)
    max_requests = max_running + 1 + rng.randint(0, 8)
    tight = rng.random() < 0.5
    num_slots = max_context + 2 + (rng.randint(0, max_context) if tight else 4 * max_context)
    swa_slots = window + chunk + 2 + (rng.randint(0, 2 * window) if tight else 4 * (window + chunk))
    new_hi = rng.randint(1, min(16, max_context // 3))
    full_n = len(range(0, layers, 2)) if swa else layers
    group_n = min(full_n, layers - full_n) if swa else layers
    picks = rng.sample(range(-group_n, group_n), k=min(rng.randint(1, 4), 2 * group_n))
    moves = not swa and rng.random() < 0.35
    config = {
        "engine": {
            "num_layers": layers, "kv_bytes": rng.choice([16, 32, 48, 64]), "block_size": rng.choice([1, 2, 4, 8, 16, 32]),
            "sliding_window": window, "max_context": max_context, "chunk_size": chunk,
            "max_batch_tokens": rng.choice([4, 8, 16, 32, 64, 128]), "max_running": max_running,
            "max_requests": max_requests, "num_slots": num_slots, "swa_num_slots": swa_slots if swa else 512,
        },
        "workload": {
            "steps": rng.randint(4, 24), "max_arrivals": rng.randint(2, 12), "shared_prefixes": rng.randint(1, 4),
            "shared_prefix_len": sorted(rng.sample(range(1, 32), 2)), "share_prob": rng.choice([0.0, 0.5, 0.9, 1.0]),
            "prompt_len": [1, rng.randint(1, max_context // 3)], "new_tokens": [1, new_hi],
            "arrival_prob": rng.choice([0.2, 0.5, 0.8, 1.0]), "abort_prob": rng.choice([0.0, 0.0, 0.02, 0.1]),
            "oracle": rng.random() < 0.5,
            "moves": {"fork": rng.choice([0.0, 0.05, 0.15]), "offload": rng.choice([0.0, 0.05, 0.15])} if moves else None,
        },
        "canary": {
            "sweep_interval": rng.choice([0, 1, 2, 3, 4, 8, 16, 32, 64]),
            "real_kv_hash": rng.choice(["none", "partial", "all"]), "real_kv_layers": picks,
            "deep_fingerprints": rng.random() < 0.6, "drain_interval": rng.choice([1, 2, 4, 8, 16]),
            "verify_token": rng.random() < 0.8, "chain_position_warmup": rng.choice([-1, 0, 2, 8]),
        },
    }
    # drawn last, so the fields above are what earlier campaigns drew for the same index
    spec = rng.random() < 0.5
    config["engine"]["spec_tokens"] = rng.choice([1, 2, 3, 4, 6]) if spec else 0
    config["engine"]["spec_accept"] = rng.choice([0.0, 0.3, 0.6, 0.8, 1.0]) if spec else 0.7
    # producer identity, drawn after the fields above: images, adapters / salts, weight updates (with a cache reset,
    # or a cache key that holds the weights version), on a correct engine whose prefix-cache key holds every field
    ident = None
    if rng.random() < 0.6:
        steps = config["workload"]["steps"]
        ident = {"image_prob": rng.choice([0.0, 0.3, 0.7, 1.0]), "image_len": [1, rng.randint(1, 8)],
                 "image_pool": rng.randint(1, 4), "adapters": rng.randint(0, 3), "salts": rng.randint(0, 2),
                 "weight_updates": sorted(rng.sample(range(1, steps), k=min(steps - 1, rng.randint(0, 3)))),
                 "reset": rng.random() < 0.5, "repeat_prob": rng.choice([0.0, 0.3, 0.6])}
    config["workload"]["identity"] = ident
    config["engine"]["cache_key_fields"] = key_fields(ident)
    return config


def key_fields(ident: Optional[dict]) -> list:
    """The prefix-cache key of a correct engine for the identity scenario ``ident``."""
    fields = ["images"]
    if ident is not None:
        fields += ["adapter"] * bool(ident["adapters"]) + ["salt"] * bool(ident["salts"])
        fields += ["weights_version"] * bool(ident["weight_updates"] and not ident["reset"])
    return fields


class _Identities:
    """Per arrival: its images and producer identity, drawn from the run's own generator (the same in every twin). With
    ``repeat_prob`` an arrival repeats an earlier arrival's text (an RL group's samples of one prompt) under its own
    draw of images and identity: the prefix cache then meets the same tokens under other producers."""

    def __init__(self, ident: dict, seed: int) -> None:
        self.d = ident
        self.rng = random.Random(f"sim-identity:{seed}")
        self.images = 0
        self.texts: list = []

    def draw(self, prompt: list, limit: int) -> tuple[list, tuple, ProducerIdentity]:
        """``prompt`` (or an earlier text, cut to ``limit`` tokens) with its images, and its identity."""
        d, rng = self.d, self.rng
        if self.texts and rng.random() < d.get("repeat_prob", 0.0):
            prompt = list(rng.choice(self.texts))[:limit]
        else:
            self.texts.append(tuple(prompt))
        images = ()
        if rng.random() < d["image_prob"]:
            # often inside a shared system prompt: same text, another (or the same) picture
            start = rng.randrange(min(len(prompt), 8)) if rng.random() < 0.5 else rng.randrange(len(prompt))
            n = min(rng.randint(*d["image_len"]), len(prompt) - start)
            prompt = prompt[:start] + [IMAGE_TOKEN] * n + prompt[start + n:]
            images = (SimImage(start=start, length=n, content=f"image-{rng.randrange(d['image_pool'])}"),)
            self.images += 1
        adapter = rng.randrange(d["adapters"] + 1) if d["adapters"] else 0
        salt = rng.randrange(d["salts"] + 1) if d["salts"] else 0
        identity = ProducerIdentity(adapter=f"lora-{adapter}" if adapter else None, salt=f"salt-{salt}" if salt else None)
        return prompt, images, identity


class _Run:
    """One engine (+ canary, + oracle) fed by the configuration's workload."""

    def __init__(self, config: dict, seed: int, mode: Optional[str]) -> None:
        e, w, c = config["engine"], config["workload"], config["canary"]
        self.sc = SimConfig(seed=seed, **dict(e, cache_key_fields=tuple(e.get("cache_key_fields", ("images",)))))
        self.canary = None
        if mode is not None:
            opts = dict(c, real_kv_layers=tuple(c["real_kv_layers"]))
            self.canary = Canary(CanaryConfig(mode=mode, **opts, **QUIET), groups=self.sc.group_specs(),
                                 max_requests=self.sc.max_requests, max_context=self.sc.max_context,
                                 max_batch_tokens=self.sc.max_batch_tokens)
        self.engine = SimEngine(self.sc, self.canary)
        self.oracle = TokenOracle(VOCAB) if w["oracle"] else None
        if self.oracle is not None:
            self.engine.sampler = self.oracle.sample
            self.engine.batch_hooks.append(self.oracle.sim_hook())
        self.workload = SimWorkload(seed=seed, vocab=VOCAB, shared_prefixes=w["shared_prefixes"],
                                    shared_prefix_len=tuple(w["shared_prefix_len"]), share_prob=w["share_prob"],
                                    prompt_len=tuple(w["prompt_len"]), new_tokens=tuple(w["new_tokens"]),
                                    arrival_prob=w["arrival_prob"], abort_prob=w["abort_prob"])
        self.stream = self.workload.stream(self.sc.max_context)
        self.moves = SimMoves(self.engine) if w["moves"] else None
        self.move_odds = w["moves"] or {}
        self.max_arrivals = w["max_arrivals"]
        self.rng = random.Random(f"sim-run:{seed}")  # aborts and moves: the same draws in every twin
        self.requests: dict = {}
        self.last_batch = None
        self.steps_done = 0
        self.moved = {"forks": 0, "offloads": 0, "restores": 0}
        ident = w.get("identity")
        self.identities = _Identities(ident, seed) if ident else None
        self.updates = set(ident["weight_updates"]) if ident else set()
        self.reset_on_update = bool(ident and ident["reset"])

    def register(self, rid: str, prompt: list) -> None:
        if self.oracle is not None:
            self.oracle.register(rid, prompt)

    def step(self, arrivals: bool = True) -> None:
        eng = self.engine
        if arrivals and self.steps_done in self.updates:  # new weights between two forwards
            eng.update_weights(reset_prefix_cache=self.reset_on_update)
        if arrivals:
            for prompt, new in next(self.stream)[: max(0, self.max_arrivals - len(self.requests))]:
                if self.identities is None:
                    req = eng.add_request(prompt, new)
                else:
                    prompt, images, identity = self.identities.draw(prompt, self.sc.max_context - new - 1)
                    req = eng.add_request(prompt, new, identity=identity, images=images)
                self.requests[req.rid] = req
                self.register(req.rid, req.tokens[: len(prompt)])  # the model's tokens: images as content tokens
            if eng.running and self.rng.random() < self.workload.abort_prob:
                eng.abort(self.rng.choice(eng.running))
        if self.moves is not None:
            self._move(forks=self.steps_done < self._steps + DRAIN_FORK_STEPS)
        self.last_batch = eng.step()
        self.steps_done += 1

    def _move(self, forks: bool = True) -> None:
        """Forks (until `DRAIN_FORK_STEPS` into the drain: a fork is a new request, and forks of forks can keep a
        tight pool thrashing forever), host offloads and restores, drawn from the run's own generator."""
        eng, mv = self.engine, self.moves
        running = [r for r in eng.running if r.state == "running"]
        if self.rng.random() < self.move_odds.get("fork", 0.0) and forks:
            parents = [r for r in running if r.num_computed > r.own_from and r.max_new - r.generated >= 1]
            if parents and eng.table.num_free and len(eng.running) < self.sc.max_running:
                parent = self.rng.choice(parents)
                try:
                    child = mv.fork(parent.rid, f"{parent.rid}.f{self.moved['forks']}")
                except KvCanaryRuntimeError:  # no room for the copy: the engine declines the fork
                    child = None
                if child is not None:
                    self.requests[child.rid] = child
                    self.moved["forks"] += 1
                    if self.oracle is not None:  # the child's history so far is its parent's: its "prompt"
                        self.oracle.register(child.rid, child.tokens)
        if self.rng.random() < self.move_odds.get("offload", 0.0):
            cands = [r for r in running if r.num_computed > r.own_from]
            if cands:
                mv.offload(self.rng.choice(cands).rid)
                self.moved["offloads"] += 1
        if mv.host and (self.rng.random() < 0.3 or not eng.running):
            self.restore(next(iter(mv.host)))

    def restore(self, rid: str) -> bool:
        try:
            self.moves.restore(rid)
        except KvCanaryRuntimeError:  # no room yet: stays in host memory, tried again later
            return False
        self.moved["restores"] += 1
        return True

    def run(self, on_step=None) -> None:
        """The workload's steps with arrivals, then drain (no arrivals) until every request ended."""
        for _ in range(self.workload_steps):
            self.step()
            if on_step is not None:
                on_step(self)
        for _ in range(DRAIN_STEPS):
            eng = self.engine
            if self.moves is not None and self.moves.host and not eng.running:
                if not self.restore(next(iter(self.moves.host))):
                    raise RuntimeError("sim fuzz: an offloaded request cannot be restored on an idle engine")
            if not eng.running and not eng.waiting:
                break
            self.step(arrivals=False)
            if on_step is not None:
                on_step(self)
        else:
            raise RuntimeError(f"sim fuzz: work left after {DRAIN_STEPS} drain steps "
                               f"({len(self.engine.running)} running, {len(self.engine.waiting)} waiting)")
        if self.canary is not None and self.canary.config.sweep_interval:
            self.canary.sweep()  # end of session: every slot still cached is verified once more

    @property
    def workload_steps(self) -> int:
        return self._steps

    def tokens(self) -> dict:
        return {rid: (r.state, list(r.tokens)) for rid, r in self.requests.items()}


def _make(config: dict, seed: int, mode: Optional[str]) -> _Run:
    run = _Run(config, seed, mode)
    run._steps = config["workload"]["steps"]
    return run


def run_config(config: dict, *, seed: int, faulted: bool) -> dict:
    """Unchecked run, checked run (``raise``), and with ``faulted`` a faulted twin (``log``); see the module
    docstring. Returns a `kvcanary.faults.fuzz.outcome` dict."""
    t0 = time.perf_counter()
    ref = _make(config, seed, None)
    ref.run()
    reference = ref.tokens()

    checked = _make(config, seed, "raise")
    error = None
    try:
        checked.run()
    except CanaryViolationError:
        pass  # counted below from the canary's violations
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    canary = checked.canary
    found = canary.violations()
    counters = canary.counters()
    out = outcome(
        ENGINE, seed, config, violations=int(counters["total"]), false_positive=bool(counters["total"]),
        tokens_identical=checked.tokens() == reference, engine_forwards=checked.engine.forwards,
        checked_forwards=int(counters["checked_forwards"]), error=error,
        first_violations=[describe_violation(v) for v in found[:5]],
        stats={"requests": len(reference), "finished": checked.engine.finished, "aborted": checked.engine.aborted,
               "retracted": checked.engine.retracted, "evicted_blocks": checked.engine.evicted_blocks,
               "cache_hit_tokens": checked.engine.cache_hit_tokens, **checked.moved,
               "weight_updates": checked.engine.weights_version,
               "image_requests": checked.identities.images if checked.identities else 0},
    )
    if faulted:
        out["fault"] = _faulted_twin(config, seed)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _faulted_twin(config: dict, seed: int) -> dict:
    run = _make(config, seed, "log")
    rng = random.Random(f"sim-fault:{seed}")
    hashed = config["canary"]["real_kv_hash"] != "none"
    cls = KvFlipUsed if hashed and rng.random() < 0.6 else SlotRedirect
    ledger = FaultLedger()
    target = SimTarget(engine=run.engine, canary=run.canary, ledger=ledger, oracle_on=run.oracle is not None,
                       register=run.register)
    injector = cls(target, seed=seed)
    after = rng.randint(1, max(1, config["workload"]["steps"] // 2))
    state: dict = {"fired": None, "pending": None, "tries": 0}

    def on_step(r: _Run) -> None:
        pending = state["pending"]
        if pending is not None:  # the forward after the injection has run
            state["pending"] = None
            batch = r.last_batch
            read = batch is not None and pending.request_id in (batch.request_ids or ())
            if cls is SlotRedirect:
                read = read and injector.in_place()  # a restore in between rewrote the entry: nothing was read
            if cls is SlotRedirect or not read:
                injector.after_forward() if cls is SlotRedirect else injector.repair()
            if read:
                state["fired"] = pending
            else:  # the request sat this forward out (batch budget, abort, offload): undo, try again
                target.ledger = FaultLedger()
                injector.t = target
        # a weight update with a cache reset before the next forward would drop the corrupted KV unread: wait
        erased = r.reset_on_update and r.steps_done in r.updates
        if state["fired"] is None and state["pending"] is None and r.steps_done >= after and state["tries"] < 50 \
                and not erased:
            state["pending"] = injector.fire()
            state["tries"] += state["pending"] is not None

    run.run(on_step)
    inj = state["fired"]
    if inj is None:
        return fault_result(cls.fault, fired=False, tries=state["tries"])
    o = account(inj, run.canary.violations())
    return fault_result(cls.fault, fired=True, caught=o.detected, right_request=o.request_id == inj.request_id,
                        expected_detectable=inj.expected_detectable, latency_forwards=o.latency_forwards,
                        reasons=list(o.reasons), detail=inj.detail, step=inj.step, request_id=inj.request_id)
