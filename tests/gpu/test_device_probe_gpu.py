"""The device probe and the capture helper on a real GPU (skipped without CUDA).

The probe passes on a working machine; its failure branches give the documented causes; a capture that fails
(a host read inside it) leaves the calling thread on its own stream and torch's CUDA generator usable outside
capture (``torch.cuda.graph`` alone leaves both behind).
"""
from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kvcanary.ops import dispatch  # noqa: E402
from kvcanary.runtime import device_probe  # noqa: E402
from kvcanary.runtime.capture import capture_graph  # noqa: E402


@pytest.fixture
def fresh():
    """No Triton switch in, none out; each test proves with a `DeviceProber` of its own (no verdict carried over)."""
    with dispatch.selected_backend(None):
        yield


def test_the_probe_passes_and_keeps_kernels_and_graphs(fresh):
    before = torch.cuda.current_stream()
    path = device_probe.DeviceProber().prove("cuda")
    assert path.path == "kernels" and path.graphs
    assert torch.cuda.current_stream() == before


def test_a_launch_that_fails_is_a_compile_refusal(fresh):
    def no_compiler(x, out):
        raise FileNotFoundError(2, "No such file or directory", "/nonexistent/cc")

    cause, detail = device_probe.probe_device(torch.device("cuda", torch.cuda.current_device()), launch=no_compiler)
    assert cause == device_probe.CAUSE_TRITON_COMPILE and "/nonexistent/cc" in detail
    prober = device_probe.DeviceProber(probe=functools.partial(device_probe.probe_device, launch=no_compiler))
    with device_probe.use_prober(prober), pytest.raises(device_probe.DevicePathError, match="system C compiler"):
        device_probe.prove_device_path("cuda")


def test_a_capture_that_fails_is_a_graph_refusal_and_leaves_the_thread_usable(fresh):
    real = device_probe._launch  # the probe kernel

    def reads_the_host(x, out):
        real(x, out)
        if torch.cuda.is_current_stream_capturing():
            out.sum().item()  # forbidden inside a capture: invalidates it

    before = torch.cuda.current_stream()
    cause, _ = device_probe.probe_device(torch.device("cuda", torch.cuda.current_device()), launch=reads_the_host)
    assert cause == device_probe.CAUSE_GRAPH_CAPTURE
    assert torch.cuda.current_stream() == before
    torch.rand(8, device="cuda").sum().item()  # the generator is out of capture mode


def test_capture_graph_restores_the_stream_and_the_generator_after_a_failed_capture():
    before = torch.cuda.current_stream()
    x = torch.ones(4, device="cuda")
    with pytest.raises(Exception):
        capture_graph(lambda: (x * 2).sum().item())
    assert torch.cuda.current_stream() == before
    torch.rand(8, device="cuda").sum().item()  # no "Offset increment outside graph capture encountered unexpectedly"
    g = capture_graph(lambda: x.mul_(2))  # and capturing still works
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4
