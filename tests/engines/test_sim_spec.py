"""Speculative decoding on the simulated engine: verify forwards of k + 1 tokens, rejected drafts rolled back,
the canary silent on clean runs (raise mode) with tokens identical to an unchecked run."""
from __future__ import annotations

import pytest

from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload
from kvcanary.faults.oracle import TokenOracle
from kvcanary.runtime import Canary, CanaryConfig

QUIET = dict(health_interval=0, stats_interval=0, readable_per_step=0)


def _run(sc: SimConfig, *, checked: bool, oracle: bool, steps: int = 60):
    canary = None
    if checked:
        canary = Canary(CanaryConfig(mode="raise", sweep_interval=2, **QUIET), groups=sc.group_specs(),
                        max_requests=sc.max_requests, max_context=sc.max_context, max_batch_tokens=sc.max_batch_tokens)
    eng = SimEngine(sc, canary)
    kinds, committed = [], []
    tok = TokenOracle(32000) if oracle else None
    if tok is not None:
        eng.sampler = tok.sample
        eng.batch_hooks.append(tok.sim_hook())
    stream = SimWorkload(seed=sc.seed, shared_prefixes=2, share_prob=0.8, new_tokens=(6, 20)).stream(sc.max_context)
    reqs = []
    for i in range(steps + 400):
        if i < steps:
            for prompt, new in next(stream):
                reqs.append(eng.add_request(prompt, new))
                if tok is not None:
                    tok.register(reqs[-1].rid, prompt)
        elif not eng.running and not eng.waiting:
            break
        batch = eng.step()
        if batch is not None:
            kinds.append(batch.forward_kind)
            committed.append(batch.committed_lens)
    if canary is not None:
        canary.sweep()
    return eng, canary, kinds, committed, {r.rid: list(r.tokens) for r in reqs}


@pytest.mark.parametrize("window,oracle,accept", [(0, True, 0.6), (8, False, 0.3), (0, False, 1.0), (16, True, 0.0)])
def test_clean_speculative_runs_are_silent_and_token_identical(window, oracle, accept):
    sc = SimConfig(seed=11, num_layers=4, sliding_window=window, spec_tokens=3, spec_accept=accept, num_slots=512,
                   swa_num_slots=256, max_context=96, block_size=4)
    eng, canary, kinds, committed, tokens = _run(sc, checked=True, oracle=oracle)
    _, _, ref_kinds, _, ref_tokens = _run(sc, checked=False, oracle=oracle)
    assert tokens == ref_tokens and kinds == ref_kinds
    assert "verify" in kinds and any(c is not None for c in committed)
    assert canary.violations() == []
    counters = canary.counters()
    assert counters["checked_forwards"] == counters["engine_forwards"] == eng.forwards
    assert eng.finished > 0


def test_rejected_drafts_are_rolled_back_and_the_bonus_token_committed():
    sc = SimConfig(seed=3, num_layers=2, spec_tokens=4, spec_accept=0.5, max_context=64)
    eng = SimEngine(sc)
    req = eng.add_request([5, 6, 7, 8], 30)
    seen = []
    while req.state == "running" or req.state == "waiting":
        free_before = eng.full_alloc.num_free
        batch = eng.step()
        if batch is None:
            break
        if batch.forward_kind == "verify":
            k, a = int(batch.extend_lens[0]) - 1, None
            seen.append(k)
            # after the step: slots held == positions computed; the rejected ones went back to the allocator
            assert len(req.full_slots) == req.num_computed or req.state == "finished"
            if req.state == "running":
                assert req.num_computed == len(req.tokens) - 1  # the bonus token waits for the next forward
                assert eng.full_alloc.num_free == free_before - (req.num_computed - int(batch.prefix_lens[0]))
            assert int(batch.committed_lens[0]) == int(batch.prefix_lens[0]) + 1
    assert seen and max(seen) == 4
    assert len(req.tokens) == 4 + 30


def test_a_bad_speculative_config_is_refused():
    with pytest.raises(ValueError, match="kv-canary: SimConfig needs spec_tokens >= 0"):
        SimConfig(spec_tokens=-1)
    with pytest.raises(ValueError, match="spec_accept"):
        SimConfig(spec_tokens=2, spec_accept=1.5)
