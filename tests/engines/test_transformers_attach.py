"""Attach-time checks, handle lifecycle and log-mode degradation of the transformers adapter (issue 10).

Items: 2 (everything checkable at attach is checked at attach), 1 / 3 adapter side (in ``log`` mode a
problem of the canary or of its translation never fails the engine's forward: that forward runs unchecked
and is counted; forwards outside continuous batching are counted unchecked, warned once).
"""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

import kvcanary  # noqa: E402
from kvcanary.cli.demo import generate, workload  # noqa: E402
from kvcanary.engines.transformers_cb import attach  # noqa: E402
from kvcanary.errors import KvCanaryError, KvCanaryRuntimeError, KvCanaryTypeError, KvCanaryValueError  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_engine")


def _hooks(model) -> int:
    return len(model._forward_pre_hooks) + len(model._forward_hooks)


# ---- item 2: attach-time checks ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(max_requests=0), r"^kv-canary: max_requests must be a positive integer, got 0"),
    (dict(max_requests=-3), r"^kv-canary: max_requests must be a positive integer, got -3"),
    (dict(max_context=0), r"^kv-canary: max_context must be a positive integer \(or None\), got 0"),
    (dict(max_requests=True), r"^kv-canary: max_requests must be a positive integer, got True"),
])
def test_limits_are_checked_at_attach(llama, kwargs, message):
    before = _hooks(llama)
    with pytest.raises(KvCanaryValueError, match=message):
        attach(llama, **kwargs)
    assert _hooks(llama) == before  # nothing attached


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_capture_sweep_must_be_a_bool(llama, value):
    before = _hooks(llama)
    with pytest.raises(KvCanaryTypeError, match=r"^kv-canary: capture_sweep must be a bool, got "):
        attach(llama, capture_sweep=value)
    assert _hooks(llama) == before


def test_capture_sweep_on_an_eager_cpu_engine_changes_nothing(llama):
    """The option only acts when the engine captures its own CUDA graphs; on the CPU the run is as without it."""
    prompts = workload(seed=1)
    reference = generate(llama, prompts)
    with attach(llama, mode="raise", sweep_interval=2, capture_sweep=True) as handle:
        checked = generate(llama, prompts)
    assert checked == reference and handle.violations() == [] and handle.errors == []
    assert handle.stats()[-1].sweep_passes > 0


@pytest.mark.parametrize("layers", [(2,), (0, -3)])
def test_real_kv_layers_out_of_range_for_the_model_is_refused_at_attach(llama, layers):
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: real_kv_layers index -?\d is out of range for the "
                                                 r"model's full_attention layers \(2 layers: valid -2\.\.1\)"):
        attach(llama, real_kv_layers=layers)


def test_real_kv_layers_checked_per_attention_type(qwen3):
    with pytest.raises(KvCanaryValueError, match=r"sliding_attention layers \(2 layers: "):
        attach(qwen3, real_kv_layers=(0, 2))
    attach(qwen3, real_kv_layers=(1, -2)).detach()  # in range for both types


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_device_without_a_gpu_is_refused_at_attach(llama):
    with pytest.raises(KvCanaryRuntimeError, match=r"^kv-canary: device 'cuda' is not usable: no CUDA GPU"):
        attach(llama, device="cuda")


def test_unparseable_device_is_refused_at_attach(llama):
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: device 'gpu0' is not a torch device"):
        attach(llama, device="gpu0")


def test_unknown_keyword_names_the_valid_ones(llama):
    with pytest.raises(KvCanaryTypeError) as err:
        kvcanary.attach(llama, sweep_intervall=4)
    msg = str(err.value)
    assert msg.startswith("kv-canary: attach() got an unknown keyword argument 'sweep_intervall' "
                          "(did you mean 'sweep_interval'?)")
    assert "max_requests" in msg and "max_context" in msg and "mode" in msg and "jsonl_path" in msg
    assert isinstance(err.value, TypeError)


def test_attaching_twice_is_refused_and_detach_frees_the_model(llama):
    first = attach(llama, mode="log")
    try:
        with pytest.raises(KvCanaryRuntimeError, match=r"^kv-canary: a canary is already attached to this "
                                                       r"LlamaForCausalLM; detach\(\) it first"):
            attach(llama, mode="log")
    finally:
        first.detach()
    attach(llama, mode="log").detach()  # free again


def test_a_detached_handle_says_so(llama):
    handle = attach(llama, mode="log")
    handle.detach()
    with pytest.raises(KvCanaryRuntimeError, match=r"^kv-canary: this canary handle was detached"):
        handle.sweep()
    with pytest.raises(KvCanaryRuntimeError, match=r"^kv-canary: this canary handle was detached"):
        with handle:
            pass
    assert handle.counters()["unchecked_forwards"] == 0  # results stay readable


# ---- items 1 and 3: log mode never fails a forward; unchecked work is counted -------------------------
def test_log_mode_beyond_max_context_serves_every_request_and_counts_unchecked(llama, caplog):
    prompts = workload(seed=1, num_requests=3)
    reference = generate(llama, prompts)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        with attach(llama, mode="log", max_context=24) as handle:
            checked = generate(llama, prompts)
    assert checked == reference  # every request served, identical tokens
    c = handle.counters()
    assert c["unchecked_forwards"] > 0 and c["canary_errors"] == 1
    assert c["unchecked_by_cause"] == {"capacity": c["unchecked_forwards"]}
    assert handle.errors == []
    lines = [r.getMessage() for r in caplog.records if "beyond max_context=24" in r.getMessage()]
    assert len(lines) == 1 and "unchecked" in lines[0]  # logged once


def test_raise_mode_beyond_max_context_still_raises(llama):
    with pytest.raises(KvCanaryRuntimeError, match=r"^kv-canary: request req_\d+ reaches position \d+, beyond max_context=24"):
        with attach(llama, mode="raise", max_context=24):
            generate(llama, workload(seed=1, num_requests=2))


def test_log_mode_more_requests_than_max_requests(llama):
    prompts = workload(seed=2, num_requests=6)
    reference = generate(llama, prompts)
    with attach(llama, mode="log", max_requests=2) as handle:
        checked = generate(llama, prompts)
    assert checked == reference
    c = handle.counters()
    assert c["unchecked_forwards"] > 0 and c["unchecked_by_cause"]["capacity"] == c["unchecked_forwards"]
    assert c["total"] == 0  # no false violations from the unchecked part


def test_healthy_run_reports_zero_unchecked(llama):
    prompts = workload(seed=3, num_requests=3)
    with attach(llama, mode="log") as handle:
        generate(llama, prompts)
    c = handle.counters()
    assert c["unchecked_forwards"] == 0 and c["canary_errors"] == 0 and c["plain_forwards"] == 0
    assert c["engine_forwards"] == c["checked_forwards"] > 0
    assert c["device_path"] == "twins"  # on the CPU; still reported after the handle detached



def test_plain_forwards_while_attached_are_counted_unchecked_and_warned_once(llama, caplog):
    ids = torch.tensor([[1, 2, 3, 4]])
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        with attach(llama, mode="raise") as handle:
            with torch.no_grad():
                llama(input_ids=ids)
                llama(input_ids=ids)
    c = handle.counters()
    assert c["plain_forwards"] == 2 and c["unchecked_forwards"] == 2
    assert c["unchecked_by_cause"] == {"plain_forward": 2}
    warnings = [r for r in caplog.records if "outside continuous batching" in r.getMessage()]
    assert len(warnings) == 1


def test_internal_canary_error_in_log_mode_does_not_fail_the_forward(llama, monkeypatch):
    from kvcanary.runtime import Canary

    calls = {"n": 0}
    original = Canary.launch_head

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated canary bug")
        return original(self)

    monkeypatch.setattr(Canary, "launch_head", flaky)
    prompts = workload(seed=4, num_requests=3)
    reference = generate(llama, prompts)
    with attach(llama, mode="log") as handle:
        checked = generate(llama, prompts)
    assert checked == reference
    c = handle.counters()
    assert c["canary_errors"] == 1 and c["unchecked_by_cause"].get("internal", 0) >= 1
    assert c["total"] == 0


def test_every_error_the_adapter_raises_on_bad_input_is_a_kvcanary_error(llama):
    for kwargs in (dict(max_requests=0), dict(device="gpu0"), dict(sweep_intervall=1), dict(real_kv_layers=(9,))):
        with pytest.raises(KvCanaryError):
            attach(llama, **kwargs)
