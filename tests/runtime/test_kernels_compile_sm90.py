"""Every Triton variant the simulated engine's per-forward path binds also builds for Hopper (sm_90).

CI has no GPU: the interpreter runs the kernels' logic but never compiles them, so a kernel that the interpreter
accepts and Triton's compiler refuses (a non-constexpr global, a type the code generator rejects) would first
fail on a card. Here the interpreted run records each variant's compile spec (`tests/triton_variants.py`) and a
process without the interpreter compiles them all to cubins with the ptxas Triton ships.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it on machines without a GPU
    pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcanary.ops import RealKvHashMode, VerifyPlan  # noqa: E402
from kvcanary.ops.triton import launch_verify, launch_write  # noqa: E402
from tests.ops.triton_cases import make_context, make_source, write_inputs, write_plan  # noqa: E402
from tests.runtime.conftest import make_sim, warm_sim  # noqa: E402
from tests.triton_variants import COMPILE_SM90, record_variants  # noqa: E402


def test_per_forward_kernels_compile_for_sm90(all_triton, tmp_path):
    engine, canary = make_sim(canary_options=dict(sweep_interval=4, mode="raise"), num_slots=384, swa_num_slots=192,
                              max_requests=10, max_context=96, sliding_window=16)
    specs: dict = {}
    with record_variants(specs) as variants:
        warm_sim(engine, steps=4)
        for mode in (RealKvHashMode.ALL, RealKvHashMode.LANES):
            _prefill_sized_write_and_verify(mode)
    assert canary.stats().violations == 0
    assert {"_verify_kernel", "_write_small_kernel", "_write_prepare_kernel", "_write_chain_kernel", "_tile_plan_kernel",
            "_stamp_kernel", "_sweep_slice_kernel", "_record_store_kernel", "_padding_read_kernel"} <= set(variants)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    out = subprocess.run([sys.executable, "-c", COMPILE_SM90], input=json.dumps(list(specs.values())), env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0 and "ptxas" in out.stderr:
        pytest.skip(f"Triton cannot build cubins here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == []
    assert result["compiled"] == len(specs) >= len(variants)


def _prefill_sized_write_and_verify(mode: RealKvHashMode) -> None:
    """A 300-token write (past the single-CTA limit: the prepare + chain kernel pair) and a verify, in ALL mode (the
    looped fold) or LANES mode (the deep records' tiles) over two sources of 16 words per token — shapes the simulated
    run above does not bind."""
    g = torch.Generator().manual_seed(0)
    srcs = [make_source(g, "cpu", num_slots=512, page_size=4, nbpt=128, read_bytes=128, dtype=torch.bfloat16)
            for _ in range(2)]
    ctx = make_context(g, "cpu", num_slots=512, stride_bytes=32, ring_cap=64, sources=srcs, mode=mode,
                       chain_assert=1, kind=0)
    n = 300
    launch_write(context=ctx, plan=write_plan([n], [-1]), **write_inputs(list(range(n)), list(range(n)), list(range(1, n + 1))))
    plan = VerifyPlan.allocate(n, "cpu")
    plan.verify_slot_indices.copy_(torch.arange(1, n + 1))
    plan.verify_prev_slot_indices.copy_(torch.arange(0, n))
    plan.verify_prev_slot_indices[0] = -1
    plan.verify_expected_positions.copy_(torch.arange(n))
    plan.verify_num_valid[0] = n
    launch_verify(context=ctx, plan=plan, check_verify_expected_token=False)
    assert int(ctx.violation_write_index[0]) == 0
