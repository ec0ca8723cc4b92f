"""Compiled Triton variants on a real card (`kvcanary.ops.triton.launch.jit_batch_sized`): the simulated engine
eager on CUDA, batches of changing sizes; the runtime glue kernels, whose block shapes do not follow the batch,
must each hold exactly one compiled variant per geometry (the CPU twin of this check binds keys without
compiling: tests/runtime/test_kernel_variants.py)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("triton")

from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload  # noqa: E402
from kvcanary.runtime import Canary, CanaryConfig, kernels  # noqa: E402


def _compiled(kernel) -> int:
    """Variants ``kernel`` (a JITFunction) has compiled for the current device."""
    caches = getattr(kernel, "device_caches", {})
    device = torch.cuda.current_device()
    return len(caches[device][0]) if device in caches else 0


GLUE = (kernels._token_rows_kernel, kernels._record_claim_kernel, kernels._record_store_kernel) if kernels.AVAILABLE else ()


def run_sim(device: str) -> Canary:
    """40 steps of a workload whose batches change size every step (arrivals, aborts, 1-30 new tokens)."""
    sc = SimConfig(num_slots=384, max_requests=10, max_context=96, seed=3, device=device)
    canary = Canary(CanaryConfig(mode="raise", sweep_interval=4, health_interval=0, stats_interval=0,
                                 readable_per_step=0),
                    groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                    max_batch_tokens=sc.max_batch_tokens, device=device)
    engine = SimEngine(sc, canary)
    engine.run(40, SimWorkload(seed=3, new_tokens=(1, 30), abort_prob=0.05, arrival_prob=0.6))
    return canary


def test_glue_kernels_compile_one_variant_whatever_the_batch_size():
    # other tests of this process may have compiled variants already (other geometries): count the new ones
    before = {k.fn.__name__: _compiled(k) for k in GLUE}
    canary = run_sim("cuda")
    assert canary.stats().violations == 0
    new = {k.fn.__name__: _compiled(k) - before[k.fn.__name__] for k in GLUE}
    assert all(n <= 1 for n in new.values()), new
