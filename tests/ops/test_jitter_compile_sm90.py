"""The jitter variants of the verify and write kernels, with the clock spin on (``SPIN``: what a GPU runs, never the
interpreter), build for Hopper (sm_90) with the ptxas Triton ships: the interpreter records each variant's compile
spec (`tests/triton_variants.py`), the spin constexpr is switched on, and a process without the interpreter
compiles them to cubins."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it on machines without a GPU
    pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcanary.ops import KernelJitter, VerifyPlan  # noqa: E402
from kvcanary.ops.triton import launch_verify, launch_verify_many, launch_write, launch_write_many  # noqa: E402
from kvcanary.ops.triton.write import WriteLaunchConfig  # noqa: E402
from tests.triton_variants import COMPILE_SM90, record_variants  # noqa: E402

from .test_triton_interpret import _numpy_scalar_index_fix  # noqa: E402,F401  (patches the interpreter)
from .triton_cases import make_context, sibling_context, write_inputs, write_plan  # noqa: E402

KERNELS = {"_verify_kernel", "_write_small_kernel", "_write_prepare_kernel"}


def _with_spin(spec: dict) -> dict:
    """``spec`` with its ``SPIN`` constexpr True (and ``JITTER`` checked True)."""
    module = __import__(spec["module"], fromlist=[spec["kernel"]])
    names = list(inspect.signature(getattr(module, spec["kernel"]).fn).parameters)
    consts = {tuple(p)[0]: v for p, v in spec["constexprs"]}
    assert consts[names.index("JITTER")] is True
    consts[names.index("SPIN")] = True
    return dict(spec, constexprs=[[[i], v] for i, v in consts.items()])


def test_jitter_kernels_with_the_spin_compile_for_sm90(tmp_path):
    g = torch.Generator().manual_seed(0)
    jitter = KernelJitter.create(fire_prob=0.1, max_cycles=100, seed=1, launch_key=torch.zeros(1, dtype=torch.int64),
                                 counters=torch.zeros(2, dtype=torch.int64))
    ctx = make_context(g, "cpu", num_slots=512, stride_bytes=32, ring_cap=64, sources=[], mode=0, chain_assert=1, kind=2)
    other = sibling_context(ctx, 0, kind=3)
    n = 40
    plan = VerifyPlan.allocate(n, "cpu")
    plan.verify_slot_indices.copy_(torch.arange(1, n + 1))
    plan.verify_prev_slot_indices.copy_(torch.arange(0, n))
    plan.verify_expected_positions.copy_(torch.arange(n))
    plan.verify_num_valid[0] = n
    wp, kw = write_plan([n], [-1]), write_inputs(list(range(n)), list(range(n)), list(range(1, n + 1)))
    specs: dict = {}
    with record_variants(specs) as variants:
        launch_verify(context=ctx, plan=plan, check_verify_expected_token=False, jitter=jitter)
        launch_verify_many(contexts=[ctx, other], plan=plan, check_verify_expected_token=True, jitter=jitter)
        launch_write(context=ctx, plan=wp, jitter=jitter, **kw)
        launch_write_many(contexts=[ctx, other], plan=wp, jitter=jitter, **kw)
        launch_write(context=ctx, plan=wp, jitter=jitter, config=WriteLaunchConfig(small_lanes=0), **kw)
    assert KERNELS <= set(variants)
    todo = [_with_spin(s) for s in specs.values() if s["kernel"] in KERNELS]
    assert len(todo) >= 5  # verify x2 (one and two contexts), small x2, prepare
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", COMPILE_SM90], input=json.dumps(todo), env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0 and "ptxas" in out.stderr:
        pytest.skip(f"Triton cannot build cubins here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == []
    assert result["compiled"] == len(todo)
