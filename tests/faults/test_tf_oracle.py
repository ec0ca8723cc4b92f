"""The token oracle on transformers continuous batching: the sampler, the adapter's expected tokens, and
the write-input assert end to end (CPU, the demo's tiny random Llama)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from engines.cb_support import padded_like_graphs  # noqa: E402
from kvcanary.cli.demo import generate, workload  # noqa: E402
from kvcanary.engines.transformers_cb.attach import attach  # noqa: E402
from kvcanary.errors import KvCanaryRuntimeError, KvCanaryTypeError  # noqa: E402
from kvcanary.faults.accounting import account  # noqa: E402
from kvcanary.faults.oracle import oracle_token  # noqa: E402
from kvcanary.faults.tf_oracle import INIT_METHOD, OracleSampler  # noqa: E402
from kvcanary.faults.transformers import SwapInputTokens  # noqa: E402

VOCAB = 256  # the demo models' vocabulary
MAX_NEW = 8
OPTS = dict(mode="log", sweep_interval=8, readable_per_step=0)


pytestmark = pytest.mark.usefixtures("quiet_engine_and_canary")


@pytest.fixture(scope="module")
def prompts():
    return workload(seed=0, num_requests=6)


def oracle_outputs(prompts) -> dict:
    """What the oracle says each request generates (``generate_batch`` names requests ``req_<i>``)."""
    return {f"req_{i}": [oracle_token(f"req_{i}", len(p) + k, VOCAB) for k in range(MAX_NEW)]
            for i, p in enumerate(prompts)}


def test_sampler_emits_the_oracle_tokens_and_is_removed_cleanly(llama, prompts):
    with OracleSampler(VOCAB).install(llama) as sampler:
        assert INIT_METHOD in vars(llama)
        out = generate(llama, prompts, max_new_tokens=MAX_NEW)
    assert out == oracle_outputs(prompts)
    assert sampler.managers == 1
    assert INIT_METHOD not in vars(llama)
    assert generate(llama, prompts, max_new_tokens=MAX_NEW) != out  # the model's own greedy tokens again


def test_clean_run_with_the_oracle_is_silent_and_the_assert_reads_the_oracle(llama, prompts):
    with OracleSampler(VOCAB).install(llama) as sampler:
        with attach(llama, token_oracle=sampler.token, **OPTS) as handle:
            out = generate(llama, prompts, max_new_tokens=MAX_NEW)
        assert out == oracle_outputs(prompts)
        assert handle.violations() == []
        assert handle.counters()["engine_forwards"] == handle.counters()["checked_forwards"] > 0
        assert sum(s.write_assert_skipped for s in handle.stats()) == 0

        # the same run judged by an oracle one position off: every generated token the engine writes (all
        # but each request's last) is a write_token violation at its own position, charged to its request
        with attach(llama, token_oracle=lambda rid, q: sampler.token(rid, q + 1), **OPTS) as wrong:
            generate(llama, prompts, max_new_tokens=MAX_NEW)
    found = wrong.violations()
    assert {v.reason_label for v in found} == {"write_token"}
    got = sorted((v.request_id, v.position) for v in found)
    want = sorted((f"req_{i}", len(p) + k) for i, p in enumerate(prompts) for k in range(MAX_NEW - 1))
    assert got == want
    assert all(v.stored_token == sampler.token(v.request_id, v.position) for v in found)
    assert all(v.expected_token == sampler.token(v.request_id, v.position + 1) for v in found)


def test_oracle_with_padded_batches_and_warmup_as_in_graph_mode(llama, prompts, monkeypatch):
    """Graph mode's batches (padding sequences and tokens, ``__warmup_*`` forwards, steps driven from the
    compute_batch wrapper) without a GPU: the sampler's argument row and the adapter's expected tokens line up
    with padded batches too."""
    padded_like_graphs(monkeypatch)
    with OracleSampler(VOCAB).install(llama) as sampler:
        with attach(llama, token_oracle=sampler.token, graph_driver=True, **OPTS) as handle:
            out = generate(llama, prompts, max_new_tokens=MAX_NEW)
    assert out == oracle_outputs(prompts)
    counters = handle.counters()
    assert counters["warmup_forwards"] > 0 and counters["engine_forwards"] == counters["checked_forwards"]
    assert handle.violations() == []


def _run_swap(model, prompts, *, oracle: bool, seed: int, committed: bool = True):
    with OracleSampler(VOCAB).install(model) as sampler:
        injector = SwapInputTokens(seed=seed, after_step=3, oracle_on=oracle, committed_on=committed).install(model)
        try:
            with attach(model, token_oracle=sampler.token if oracle else None, committed_tokens=committed,
                        **OPTS) as handle:
                generate(model, prompts, max_new_tokens=MAX_NEW)
        finally:
            injector.remove()
    (inj,) = injector.ledger
    return inj, handle


@pytest.mark.parametrize("seed", [1, 2])
def test_token_swap_in_the_input_ids_is_caught_by_the_write_assert_against_the_swapped_request(llama, prompts, seed):
    inj, handle = _run_swap(llama, prompts, oracle=True, seed=seed)
    outcome = account(inj, handle.violations())
    assert outcome.detected and outcome.latency_forwards == 0
    assert outcome.request_id == inj.request_id and outcome.detected_by == ("write_input",)
    at_step = [v for v in handle.violations() if v.step == inj.step]
    mine = [v for v in at_step if v.request_id == inj.request_id]
    assert [(v.reason_label, v.position, v.launch_tag.name) for v in mine] == [("write_token", inj.position, "HEAD_K_FULL")]
    assert len(at_step) == 2  # and the partner request, which got this request's token
    assert len(handle.violations()) == 2  # nothing before or after the swap


def test_without_the_oracle_committed_tokens_catch_the_swap_against_the_swapped_request(llama, prompts):
    """The default truth (no oracle): the tokens each request committed, read from the engine's request states."""
    inj, handle = _run_swap(llama, prompts, oracle=False, seed=1)
    assert inj.expected_detectable
    outcome = account(inj, handle.violations())
    assert outcome.detected and outcome.latency_forwards == 0 and outcome.request_id == inj.request_id
    assert {v.reason_label for v in handle.violations()} == {"write_token"}
    assert len(handle.violations()) == 2  # the two swapped requests, nothing else


def test_without_the_oracle_and_committed_tokens_the_token_swap_is_invisible(llama, prompts):
    inj, handle = _run_swap(llama, prompts, oracle=False, seed=1, committed=False)
    assert not inj.expected_detectable
    assert handle.violations() == []


def test_committed_tokens_must_be_a_bool(llama):
    with pytest.raises(KvCanaryTypeError, match="kv-canary: committed_tokens must be a bool"):
        attach(llama, committed_tokens="yes")


def test_token_oracle_option_is_checked_and_a_sampler_installs_once(llama):
    with pytest.raises(KvCanaryTypeError, match="kv-canary: token_oracle must be a callable"):
        attach(llama, token_oracle=7)
    sampler = OracleSampler(VOCAB).install(llama)
    try:
        with pytest.raises(KvCanaryRuntimeError, match="already installed"):
            sampler.install(llama)
    finally:
        sampler.remove()


@pytest.mark.parametrize("canary_first", [False, True])
def test_sampler_and_canary_both_wrap_init_and_each_removal_restores_what_it_found(llama, prompts, canary_first):
    """Both wrap ``init_continuous_batching``: either order works, and a detach never removes the sampler's wrapper
    (nor the sampler's removal the canary's) — the one on top is unstacked, the other passes through once removed."""
    sampler = OracleSampler(VOCAB)
    handle = attach(llama, **OPTS) if canary_first else None
    sampler.install(llama)
    if handle is None:
        handle = attach(llama, **OPTS)
    with pytest.raises(KvCanaryRuntimeError, match="another OracleSampler"):
        OracleSampler(VOCAB).install(llama)
    handle.detach()  # first out: under the sampler's wrapper when the canary came first
    assert INIT_METHOD in vars(llama)
    out = generate(llama, prompts, max_new_tokens=MAX_NEW)
    assert out == oracle_outputs(prompts)  # the sampler still samples after the canary left
    assert handle.violations() == []
    sampler.remove()
    assert INIT_METHOD not in vars(llama)  # nothing left behind by either
    assert generate(llama, prompts, max_new_tokens=MAX_NEW) != out
