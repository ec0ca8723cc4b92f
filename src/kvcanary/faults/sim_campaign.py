"""A seeded fault campaign on the simulated engine: per class, K injections, each accounted.

Per class: an engine (4 full layers; with a sliding-window group for ``swa_window_stale``; speculative decoding,
3 drafts a step, for the ``verify_*`` classes) runs a
seeded workload with the token oracle as its sampler; after a warm-up the class's injector fires,
the engine runs a detection window (``2 * sweep_interval + 2`` forwards, so the rotating sweep has
passed every slot at least once), the injector repairs, and the next injection follows on the same
engine — or on a fresh engine seeded ``seed * 1000 + k`` for classes whose damage cannot be undone.
The clean twin runs the same engine seeds for the same number of forwards without firing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from kvcanary.errors import KvCanaryValueError
from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload
from kvcanary.faults.accounting import Outcome, account
from kvcanary.faults.ledger import FaultLedger
from kvcanary.faults.oracle import TokenOracle
from kvcanary.faults.sim import CORE_INJECTORS, SimTarget
from kvcanary.faults.sim_identity import IDENTITY_INJECTORS
from kvcanary.runtime import Canary, CanaryConfig

VOCAB = 32000
QUIET = dict(health_interval=0, stats_interval=0, readable_per_step=0)
#: every simulated-engine fault class by name: the engine-level ones and the producer-identity ones
INJECTORS = {**CORE_INJECTORS, **{cls.fault: cls for cls in IDENTITY_INJECTORS}}


@dataclass(frozen=True, kw_only=True)
class SimCampaignConfig:
    """real_kv_hash / real_kv_layers: the canary's fingerprint settings. sweep_interval: forwards per
    full sweep pass. warm: forwards before the first injection. oracle: sample with the token oracle
    and hand its tokens to the write-input assert."""

    seed: int = 0
    per_class: int = 20
    real_kv_hash: str = "partial"
    real_kv_layers: tuple[int, ...] = (0, -1)
    deep_fingerprints: bool = True
    sweep_interval: int = 4
    warm: int = 16
    oracle: bool = True
    max_tries: int = 30

    @property
    def window(self) -> int:
        return 2 * self.sweep_interval + 2


class SimDriver:
    """One engine + canary + oracle fed by a seeded workload; ``step()`` is one scheduler step."""

    def __init__(self, cfg: SimCampaignConfig, seed: int, *, swa: bool, spec: bool = False) -> None:
        sc = SimConfig(seed=seed, num_layers=4, sliding_window=16 if swa else 0, spec_tokens=3 if spec else 0,
                       spec_accept=0.6)
        config = CanaryConfig(mode="log", real_kv_hash=cfg.real_kv_hash, real_kv_layers=cfg.real_kv_layers,
                              deep_fingerprints=cfg.deep_fingerprints,
                              sweep_interval=cfg.sweep_interval, **QUIET)
        self.canary = Canary(config, groups=sc.group_specs(), max_requests=sc.max_requests,
                             max_context=sc.max_context, max_batch_tokens=sc.max_batch_tokens)
        self.engine = SimEngine(sc, self.canary)
        self.oracle = TokenOracle(VOCAB) if cfg.oracle else None
        if self.oracle is not None:
            self.engine.sampler = self.oracle.sample
            self.engine.batch_hooks.append(self.oracle.sim_hook())
        self.stream = SimWorkload(seed=seed, new_tokens=(20, 50), abort_prob=0.0, arrival_prob=0.5).stream(sc.max_context)

    def register(self, rid: str, prompt: list) -> None:
        if self.oracle is not None:
            self.oracle.register(rid, prompt)

    def step(self) -> None:
        for prompt, new in next(self.stream):
            req = self.engine.add_request(prompt, new)
            self.register(req.rid, prompt)
        self.engine.step()

    def target(self, ledger: FaultLedger) -> SimTarget:
        return SimTarget(engine=self.engine, canary=self.canary, ledger=ledger, oracle_on=self.oracle is not None,
                         register=self.register)


@dataclass
class ClassRun:
    fault: str
    ledger: FaultLedger = field(default_factory=FaultLedger)
    outcomes: list[Outcome] = field(default_factory=list)
    forwards: int = 0
    clean_forwards: int = 0
    clean_violations: int = 0


def _inject_once(driver: SimDriver, injector, cfg: SimCampaignConfig) -> Optional[Outcome]:
    inj = None
    for _ in range(cfg.max_tries):
        inj = injector.fire()
        if inj is not None:
            break
        driver.step()
    if inj is None:
        return None
    driver.step()
    injector.after_forward()
    for _ in range(cfg.window - 1):
        driver.step()
    injector.repair()
    found = driver.canary.violations()
    outcome = account(inj, found, until_step=driver.canary.step + 1)
    settled = injector.settled(inj, detected=outcome.detected)
    return outcome if settled is inj else account(settled, found, until_step=driver.canary.step + 1)


# Each class's seed slot. Append only: a new class takes the next slot, so the seeds (and the pinned outcomes of
# tests and published campaigns) of the classes before it do not move.
SEED_SLOTS = (
    "copy_corruption", "cross_context_hit", "double_alloc", "kv_flip_cached", "kv_flip_deep_layer", "kv_flip_used",
    "position_shift", "prefix_collision", "slot_redirect", "swa_window_stale", "token_swap", "use_after_free",
    "verify_draft_kept", "verify_draft_misdirected", "verify_positions_shifted", "verify_rollback_off_by_one",
    "weights_update_stale_prefix", "salt_ignored_by_cache_key", "adapter_ignored_by_cache_key",
    "multimodal_key_ignores_image",
)


def class_seed(fault: str, cfg: SimCampaignConfig) -> int:
    """The seed of the first engine and injector of class ``fault`` in a campaign of ``cfg``."""
    return cfg.seed * 1000 + SEED_SLOTS.index(fault) * 100


def run_class(fault: str, cfg: SimCampaignConfig, *, clean_twin: bool = True,
              progress: Optional[Callable[[], None]] = None) -> ClassRun:
    """Run ``cfg.per_class`` injections of ``fault`` (and its clean twin) on the simulated engine."""
    if fault not in INJECTORS:
        raise KvCanaryValueError(f"kv-canary: unknown fault class {fault!r} (known: {', '.join(INJECTORS)})")
    cls = INJECTORS[fault]
    run = ClassRun(fault=fault)
    base = class_seed(fault, cfg)
    seeds = [base + k for k in range(cfg.per_class)] if cls.fresh_engine else [base]
    driver: Optional[SimDriver] = None
    engine_forwards: list[tuple[int, int]] = []
    for k in range(cfg.per_class):
        if driver is None or cls.fresh_engine:
            if driver is not None:
                engine_forwards.append((seeds[k - 1], driver.engine.forwards))
            driver = SimDriver(cfg, seeds[k], swa=cls.needs_swa, spec=cls.needs_spec)
            injector = cls(driver.target(run.ledger), seed=seeds[k])
            for _ in range(cfg.warm):
                driver.step()
        outcome = _inject_once(driver, injector, cfg)
        if outcome is not None:
            run.outcomes.append(outcome)
        if progress is not None:
            progress()
    engine_forwards.append((seeds[cfg.per_class - 1] if cls.fresh_engine else base, driver.engine.forwards))
    run.forwards = sum(n for _, n in engine_forwards)
    if clean_twin:
        seed, n = engine_forwards[0]
        twin = SimDriver(cfg, seed, swa=cls.needs_swa, spec=cls.needs_spec)
        while twin.engine.forwards < n:
            twin.step()
        run.clean_forwards = twin.engine.forwards
        run.clean_violations = len(twin.canary.violations())
    return run


def run_sim_campaign(faults: Sequence[str], cfg: SimCampaignConfig, *,
                     progress: Optional[Callable[[], None]] = None) -> list[ClassRun]:
    return [run_class(f, cfg, progress=progress) for f in faults]
