"""`dispatch.selected_backend`: a documented override of the launch backend, restored on exit."""
import pytest
import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops import dispatch
from kvcanary.runtime import kernels

CUDA0 = torch.device("cuda", 0)  # never touched: only the routing decision is asked
CPU = torch.device("cpu")


def test_torch_forces_the_twins_and_none_routes_by_device():
    with dispatch.selected_backend("torch"):
        assert dispatch.selected() == "torch"
        assert dispatch.triton_backend(CUDA0) is None and dispatch.triton_backend(CPU) is None
        assert not kernels.use_kernels(torch.zeros(1))
    assert dispatch.selected() is None
    assert dispatch.triton_backend(CPU) is None  # by device: the CPU gets the twins


def test_triton_routes_cpu_tensors_to_the_launchers():
    pytest.importorskip("triton")
    with dispatch.selected_backend("triton"):
        assert dispatch.triton_backend(CPU) is not None
        assert kernels.use_kernels(torch.zeros(1))
    assert dispatch.triton_backend(CPU) is None


def test_the_block_starts_with_triton_on_and_restores_a_switch_made_before():
    with dispatch.selected_backend(None):
        dispatch.disable_triton("no compiler")
        with dispatch.selected_backend(None):
            assert dispatch.triton_disabled() is None
            dispatch.disable_triton("inner")
        assert dispatch.triton_disabled() == "no compiler"
    assert dispatch.triton_disabled() is None


def test_unknown_backend_is_refused():
    with pytest.raises(KvCanaryValueError, match="unknown ops backend 'cuda'"):
        with dispatch.selected_backend("cuda"):
            pass
