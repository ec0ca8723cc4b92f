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

from tests.runtime.conftest import make_sim, warm_sim  # noqa: E402
from tests.triton_variants import record_variants, runtime_only_differences  # noqa: E402


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
    for name in ("_tile_plan_kernel", "_token_rows_kernel", "_record_claim_kernel", "_record_store_kernel"):
        assert len(variants[name]) == 1, (name, len(variants[name]))
