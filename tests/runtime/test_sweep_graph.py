"""`Canary.capture_sweep_graph` at its boundary (the capture itself needs CUDA: tests/gpu)."""
from __future__ import annotations

import pytest

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryValueError
from kvcanary.runtime.graphs import capture_sweep_slice

from tests.runtime.conftest import make_sim, warm_sim


def test_without_a_sweep_there_is_nothing_to_capture():
    engine, canary = make_sim(num_slots=256, max_requests=8, max_context=64, canary_options={"sweep_interval": 0})
    warm_sim(engine, steps=4)
    assert canary.capture_sweep_graph() is False


def test_a_cpu_canary_refuses_with_a_kvcanary_error():
    engine, canary = make_sim(num_slots=256, max_requests=8, max_context=64, canary_options={"sweep_interval": 4})
    warm_sim(engine, steps=4)
    with pytest.raises(KvCanaryValueError, match="^kv-canary: CUDA graphs need a CUDA canary"):
        canary.capture_sweep_graph()


def test_the_slice_is_captured_only_after_an_eager_slice_compiled_it():
    engine, canary = make_sim(num_slots=256, max_requests=8, max_context=64, canary_options={"sweep_interval": 4})
    canary.sweeper.slices_run = 0
    with pytest.raises(KvCanaryRuntimeError, match="^kv-canary: capture the sweep slice after one eager slice"):
        capture_sweep_slice(canary.sweeper, canary.static.device)
