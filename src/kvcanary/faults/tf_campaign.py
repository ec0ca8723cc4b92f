"""A seeded fault campaign on transformers continuous batching (the demo's tiny random models, CPU).

The classes this engine can express today: ``kv_flip_used``, ``kv_flip_cached`` (llama, prefix
sharing), ``slot_redirect`` (llama full attention, and the qwen3 sliding-window group), ``swa_window_stale``
(qwen3: a position leaving the window during a chunk read from a freed ring block) and ``token_swap``
(llama; detectable only with the token oracle). One checked ``generate_batch`` per injection (injector
seeded ``seed * 1000 + k``, firing after 1..4 forwards); the clean twin is one checked run per model with
no injector. With ``oracle`` (the default) every run, clean twin included, samples the token oracle
(`kvcanary.faults.tf_oracle.OracleSampler`) and the adapter checks each written token against it.
"""
from __future__ import annotations

import logging
import random
from typing import Callable, Optional, Sequence

import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.faults.accounting import Outcome, account
from kvcanary.faults.tf_oracle import OracleSampler
from kvcanary.faults.transformers import (
    FlipSharedBlockByte,
    FlipUsedBlockByte,
    RedirectRead,
    StaleWindowRead,
    SwapInputTokens,
)

VOCAB = 256  # the demo models' vocabulary (kvcanary.cli.demo.tiny_model)

TF_CLASSES = {  # class -> (model, injector factory (seed, after_step, oracle on))
    "kv_flip_used": ("llama", lambda seed, after, oracle: FlipUsedBlockByte(seed=seed, after_step=after)),
    "kv_flip_cached": ("llama", lambda seed, after, oracle: FlipSharedBlockByte(seed=seed, after_step=after)),
    "slot_redirect": ("llama", lambda seed, after, oracle: RedirectRead(group="full", seed=seed, after_step=after)),
    "slot_redirect_swa": ("qwen3_swa", lambda seed, after, oracle: RedirectRead(group="swa", seed=seed, after_step=after)),
    "swa_window_stale": ("qwen3_swa", lambda seed, after, oracle: StaleWindowRead(seed=seed, after_step=after)),
    "token_swap": ("llama", lambda seed, after, oracle: SwapInputTokens(seed=seed, after_step=after, oracle_on=oracle)),
}


def run_tf_campaign(faults: Sequence[str], *, seed: int = 0, per_class: int = 3, real_kv_hash: str = "partial",
                    num_requests: int = 8, device: str = "cpu", oracle: bool = True,
                    progress: Optional[Callable[[], None]] = None) -> tuple[dict, list[Outcome], dict]:
    """Returns ({class: [Outcome]}, all outcomes, clean {forwards, violations})."""
    from kvcanary.faults.tf_workload import generate, tiny_model, workload
    from kvcanary.engines.transformers_cb.attach import attach

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    unknown = [f for f in faults if f not in TF_CLASSES]
    if unknown:
        raise KvCanaryValueError(f"kv-canary: the transformers engine cannot express {unknown} (it can: {', '.join(TF_CLASSES)})")
    dev = torch.device(device)
    models: dict = {}
    per: dict = {}
    outcomes: list[Outcome] = []
    opts = dict(mode="log", sweep_interval=8, readable_per_step=0, real_kv_hash=real_kv_hash)

    def checked_run(model, prompts, injector=None):
        sampler = OracleSampler(VOCAB).install(model) if oracle else None
        if injector is not None:
            injector.install(model)
        try:
            with attach(model, token_oracle=sampler.token if sampler else None, **opts) as handle:
                generate(model, prompts)
        finally:
            if injector is not None:
                injector.remove()
            if sampler is not None:
                sampler.remove()
        return handle

    for fault in faults:
        kind, make = TF_CLASSES[fault]
        model = models.get(kind) or models.setdefault(kind, tiny_model(kind, dev, seed))
        per[fault] = []
        for k in range(per_class):
            s = seed * 1000 + k
            injector = make(s, random.Random(s).randint(1, 4), oracle)
            handle = checked_run(model, workload(s, num_requests=num_requests), injector)
            for inj in injector.ledger:
                o = account(inj, handle.violations())
                per[fault].append(o)
                outcomes.append(o)
            if progress is not None:
                progress()
    clean = {"forwards": 0, "violations": 0}
    for kind in sorted({TF_CLASSES[f][0] for f in faults}):
        handle = checked_run(models[kind], workload(seed, num_requests=num_requests))
        clean["forwards"] += handle.forwards
        clean["violations"] += len(handle.violations())
    return per, outcomes, clean
