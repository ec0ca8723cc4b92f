"""`Canary.warm_up`: the per-forward kernels compiled before serving. Under the Triton interpreter (CPU tensors,
TRITON_INTERPRET=1; `record_variants` records each launch's specialisation key, what Triton compiles once per key):
warming up changes nothing a forward later sees, and the forwards that follow launch no kernel variant the warm-up
did not."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it on machines without a GPU
    pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcanary.engines.sim.forward_view import describe  # noqa: E402
from kvcanary.errors import KvCanaryValueError  # noqa: E402
from kvcanary.ops.dispatch import selected_backend  # noqa: E402
from tests.ops.test_triton_interpret import _numpy_scalar_index_fix  # noqa: E402
from tests.runtime.conftest import flip_and_redirect, make_sim, warm_sim  # noqa: E402
from tests.runtime.test_kernels import _runtime_state  # noqa: E402
from tests.runtime.kernel_cases import assert_same  # noqa: E402
from tests.triton_variants import record_variants  # noqa: E402

OPTIONS = dict(num_slots=160, swa_num_slots=96, max_requests=6, max_context=64, sliding_window=16,
               max_batch_tokens=64)


def _empty(engine):
    return describe([], table=engine.table, full_to_swa=engine.full_to_swa if engine.swa_alloc else None,
                    contexts=False)


def _run(warm: bool):
    engine, canary = make_sim(**OPTIONS)
    with record_variants() as warmed:
        if warm:
            assert canary.warm_up(_empty(engine)) is True
    with record_variants() as served:
        warm_sim(engine, steps=8)
        flip_and_redirect(engine)
        canary.launch_sweep(engine.live_slots())  # vLLM's periodic sweep on CUDA
        warm_sim(engine, steps=6, seed=1)
        canary.launch_sweep(engine.live_slots())
    return canary, warmed, served


def test_warm_up_changes_nothing_and_leaves_nothing_to_compile():
    _numpy_scalar_index_fix()
    with selected_backend("triton"):
        cold, _, _ = _run(warm=False)
        warm, warmed, served = _run(warm=True)
    assert_same(_runtime_state(warm), _runtime_state(cold))
    key = lambda v: (v.step, v.launch_tag.name, v.slot, v.stored_position, int(v.reasons), v.request_id)  # noqa: E731
    assert cold.violations() and sorted(map(key, warm.violations())) == sorted(map(key, cold.violations()))
    assert warm.step == cold.step and warm.counters() == cold.counters()
    assert warm.sweeper.sweeps == cold.sweeper.sweeps == 2 and warm.sweeper.last == cold.sweeper.last
    assert warmed, "the warm-up launched nothing"
    new = {name: keys - warmed.get(name, set()) for name, keys in served.items()}
    assert {name: keys for name, keys in new.items() if keys} == {}


def test_warm_up_refuses_a_batch_with_rows_and_runs_nothing_on_the_twins():
    engine, canary = make_sim(**OPTIONS)
    assert canary.warm_up(_empty(engine)) is False  # the torch twins: nothing compiles
    warm_sim(engine, steps=2)
    req = engine.running[0]
    one = describe([(req, 1, req.full_slots[-1:], req.swa_slots[-1:])], table=engine.table,
                   full_to_swa=engine.full_to_swa, contexts=False)
    with pytest.raises(KvCanaryValueError, match="kv-canary: warm_up"):
        canary.warm_up(one)
