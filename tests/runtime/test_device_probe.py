"""Proving the device path (`kvcanary.runtime.device_probe`): what is refused, why, and the opt-in eager fallback.

The probe itself needs a GPU (tests/gpu and bench/chaos_gpu.py run it there); here its verdicts are injected and
the policy around them is checked: the refusal's message, the fallback's switch, warning and metrics, and that
nothing is ever captured on the fallback path. A CPU canary probes nothing.
"""
from __future__ import annotations

import logging

import pytest
import torch

from kvcanary.errors import KvCanaryRuntimeError
from kvcanary.ops import dispatch
from kvcanary.runtime import CanaryConfig, canary as canary_module, device_probe
from kvcanary.runtime.device_probe import (
    CAUSE_GRAPH_CAPTURE, CAUSE_KERNEL_RESULT, CAUSE_TRITON_COMPILE, CAUSE_TRITON_MISSING, DevicePath, DevicePathError,
    DeviceProber, prove_device_path, use_prober,
)
from tests.runtime.conftest import make_sim

CUDA0 = torch.device("cuda", 0)  # never touched: the verdict is injected


@pytest.fixture
def fresh():
    """No Triton switch carried over from another test (restored afterwards); probe verdicts and warnings are
    each test's own `DeviceProber`'s."""
    with dispatch.selected_backend(None):  # no Triton switch in, none out
        yield


def _verdict(verdict):
    """A `DeviceProber` whose probe returns ``verdict``, and the devices it probed."""
    calls = []

    def probe(device):
        calls.append(device)
        return verdict

    return DeviceProber(probe=probe), calls


def test_a_cpu_canary_probes_nothing(fresh):
    prober, calls = _verdict((CAUSE_TRITON_MISSING, "x"))
    with use_prober(prober):
        path = prove_device_path("cpu")
        assert path == DevicePath(device="cpu", path="twins", graphs=False) and calls == []
        _, canary = make_sim(seed=1)
    assert canary.device_path.path == "twins" and canary.counters()["device_path"] == "twins" and calls == []


@pytest.mark.parametrize("cause,detail,remedy", [
    (CAUSE_TRITON_MISSING, "import triton failed", "pip install triton"),
    (CAUSE_TRITON_COMPILE, "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/cc'",
     "system C compiler"),
    (CAUSE_KERNEL_RESULT, "the probe kernel returned [0, 0, 0, 0]...", "Reinstall the Triton"),
    (CAUSE_GRAPH_CAPTURE, "RuntimeError: operation not permitted when stream is capturing", "without CUDA graphs"),
])
def test_a_failed_probe_is_refused_with_its_cause_and_remedy(fresh, cause, detail, remedy):
    prober, calls = _verdict((cause, detail))
    with use_prober(prober), pytest.raises(DevicePathError) as err:
        prove_device_path(CUDA0)
    msg = str(err.value)
    assert msg.startswith("kv-canary: the canary cannot use Triton on cuda:0")
    assert cause in msg and detail in msg and remedy in msg and "allow_eager_fallback=True" in msg
    assert err.value.cause == cause and isinstance(err.value, KvCanaryRuntimeError)
    assert dispatch.triton_disabled() is None  # refused: nothing switched
    with use_prober(prober), pytest.raises(DevicePathError):
        prove_device_path(CUDA0)
    assert len(calls) == 1  # probed once per prober and device


def test_a_passing_probe_keeps_the_kernels_and_graphs(fresh):
    prober, _ = _verdict(None)
    with use_prober(prober):
        path = prove_device_path(CUDA0)
    assert path.path == "kernels" and path.graphs and not path.degraded


def test_the_opt_in_fallback_turns_triton_off_and_says_so_once(fresh, caplog):
    prober, _ = _verdict((CAUSE_TRITON_COMPILE, "RuntimeError: Failed to find C compiler"))
    with use_prober(prober), caplog.at_level(logging.WARNING, logger="kvcanary"):
        a = prove_device_path(CUDA0, allow_eager_fallback=True)
        b = prove_device_path(CUDA0, allow_eager_fallback=True)
    assert a == b and a.degraded and not a.graphs and a.cause == CAUSE_TRITON_COMPILE
    warnings = [r for r in caplog.records if "eager fallback on cuda:0" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert dispatch.triton_disabled() and dispatch.triton_backend(CUDA0) is None  # every launch on the twins
    # once Triton is off for the process, a later canary without the opt-in is refused, not silently degraded
    with use_prober(prober), pytest.raises(DevicePathError):
        prove_device_path(torch.device("cuda", 1))


def test_the_probe_reports_a_missing_triton_before_touching_the_device(fresh, monkeypatch):
    from kvcanary.ops import triton as triton_ops

    monkeypatch.setattr(triton_ops, "AVAILABLE", False)
    assert device_probe.probe_device(CUDA0) == (CAUSE_TRITON_MISSING, "import triton failed")


def test_the_config_option_and_its_environment_variable():
    assert CanaryConfig().allow_eager_fallback is False
    assert CanaryConfig.from_env({"KVCANARY_ALLOW_EAGER_FALLBACK": "1"}).allow_eager_fallback is True
    with pytest.raises(ValueError, match="kv-canary: allow_eager_fallback must be True or False"):
        CanaryConfig(allow_eager_fallback="yes")


def test_the_fallback_never_captures_and_is_shown_in_counters_stats_and_metrics(eager_fallback, monkeypatch):
    engine, canary = make_sim(seed=2, canary_options=dict(stats_interval=0))
    engine.run(6)
    c = canary.counters()
    assert c["device_path"] == "eager_fallback" and c["checked_forwards"] == c["engine_forwards"] == 6
    assert "state=eager_fallback" in canary.stats().line()
    for capture in (canary.capture_graphs, canary.capture_sweep_graph):
        with pytest.raises(KvCanaryRuntimeError, match=r"^kv-canary: capture_\w+\(\) needs CUDA graphs, but the "
                                                       r"canary runs the eager fallback on cpu \(triton_missing"):
            capture()
    batch = _any_batch(engine)
    monkeypatch.setattr(canary_module, "capturing", lambda: True)  # as if an engine's capture reached the canary
    with pytest.raises(KvCanaryRuntimeError, match="cannot be captured"):
        canary.stage(batch)
    monkeypatch.undo()
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvcanary.runtime.metrics import register_metrics

    registry = prometheus_client.CollectorRegistry()
    register_metrics(canary, registry=registry)
    assert registry.get_sample_value("kvcanary_device_path", {"canary": "default", "path": "eager_fallback"}) == 1


def _any_batch(engine):
    engine.add_request([1, 2, 3], 2)
    captured = []
    engine.batch_hooks.append(lambda b: captured.append(b) or b)
    engine.step()
    return captured[-1]


class _AsCuda0(DeviceProber):
    """Proves ``cuda:0`` whatever device it is asked about (a CPU canary meets a CUDA verdict)."""

    def prove(self, device, *, allow_eager_fallback=False):
        return super().prove(CUDA0, allow_eager_fallback=allow_eager_fallback)


def test_a_refusal_at_creation_allocates_nothing(fresh):
    calls = []
    prober = _AsCuda0(probe=lambda device: calls.append(device) or (CAUSE_TRITON_MISSING, "import triton failed"))
    with use_prober(prober), pytest.raises(DevicePathError, match="kv-canary: the canary cannot use Triton"):
        make_sim(seed=3)
    assert calls == [CUDA0]
