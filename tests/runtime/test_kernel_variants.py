"""How many Triton variants the per-forward path would compile on a GPU (`tests/triton_variants.py`):
the simulated engine with every op and glue kernel on Triton (interpreted), batches of changing sizes.
No two variants may differ only in a runtime value or an alignment (`kvcanary.ops.triton.launch.jit_batch_sized`):
on a card each variant is seconds of compiling, mid-serving, the first time a batch brings it."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it on machines without a GPU
    pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcanary.ops import copy as copy_op, plan as plan_op, scatter as scatter_op  # noqa: E402
from kvcanary.ops import stamp as stamp_op, verify as verify_op, write as write_op  # noqa: E402
from kvcanary.ops.dispatch import _triton_ops  # noqa: E402
from kvcanary.runtime import kernels  # noqa: E402
from tests.ops.test_triton_interpret import _numpy_scalar_index_fix  # noqa: E402
from tests.runtime.conftest import make_sim, warm_sim  # noqa: E402
from tests.triton_variants import record_variants, runtime_only_differences  # noqa: E402

_OP_MODULES = (copy_op, plan_op, scatter_op, stamp_op, verify_op, write_op)


@pytest.fixture
def all_triton(monkeypatch):
    """Ops and runtime glue on the Triton launchers for CPU tensors (the interpreter runs them)."""
    _numpy_scalar_index_fix()
    for module in _OP_MODULES:
        monkeypatch.setattr(module, "triton_backend", lambda device: _triton_ops())
    monkeypatch.setattr(kernels, "use_kernels", lambda t: True)


def test_batch_sizes_and_tags_split_no_variant_by_a_runtime_value(all_triton):
    engine, canary = make_sim(canary_options=dict(sweep_interval=4, mode="raise"), num_slots=384, swa_num_slots=192,
                              max_requests=10, max_context=96, sliding_window=16)
    with record_variants() as variants:
        warm_sim(engine, steps=14)
    assert canary.stats().violations == 0
    assert variants["_verify_kernel"] and variants["_tile_plan_kernel"] and variants["_write_small_kernel"]
    for name, keys in variants.items():
        assert not runtime_only_differences(keys), f"{name}: variants split by a runtime value or an alignment"
    # constexprs that follow the batch would split variants too; these kernels have none left
    for name in ("_tile_plan_kernel", "_token_rows_kernel", "_expected_tokens_kernel", "_record_claim_kernel",
                 "_record_store_kernel"):
        assert len(variants[name]) == 1, (name, len(variants[name]))
