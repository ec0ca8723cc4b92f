"""One compiled Triton variant per context geometry (`kvcanary.ops.triton.launch.jit_batch_sized`): verify
and write launches of every launch tag and batch size bind to the same key on a CUDA sm_90 target
(`tests/triton_variants.py`), while a different canary stride still gets its own."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it on machines without a GPU
    pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcanary.ops import CanaryLaunchTag, RealKvHashMode  # noqa: E402
from kvcanary.ops.triton import launch_verify, launch_write  # noqa: E402
from tests.conftest import build_verify_plan  # noqa: E402
from tests.triton_variants import record_variants  # noqa: E402

from .test_triton_interpret import _numpy_scalar_index_fix  # noqa: E402
from .triton_cases import make_context, write_inputs, write_plan  # noqa: E402

_numpy_scalar_index_fix()

# HEAD_V_FULL is 1 and HEAD_K_FULL 0: the two integers Triton would otherwise specialise differently
TAGS = (CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.HEAD_V_FULL, CanaryLaunchTag.TAIL_V_FULL,
        CanaryLaunchTag.SWEEP_K_SWA)


def _context(kind, stride_bytes=32):
    g = torch.Generator().manual_seed(int(kind))
    # make_context hands each tag a counter at its own offset of one tensor: alignments differ too
    return make_context(g, "cpu", num_slots=64, stride_bytes=stride_bytes, ring_cap=16, sources=(),
                        mode=RealKvHashMode.NONE, chain_assert=1, kind=kind)


def _verify(ctx, n):
    plan = build_verify_plan(list(range(n)), list(range(n)), [-1] + list(range(n - 1)), capacity=n)
    launch_verify(context=ctx, plan=plan, check_verify_expected_token=False)


def test_verify_of_every_tag_and_capacity_binds_one_variant():
    with record_variants() as variants:
        for kind in TAGS:
            ctx = _context(kind)
            for n in (1, 5, 16, 48):
                _verify(ctx, n)
    assert len(variants["_verify_kernel"]) == 1
    with record_variants() as wider:
        _verify(_context(TAGS[0], stride_bytes=128), 5)  # 16 words: divisible by 16
    assert wider["_verify_kernel"] - variants["_verify_kernel"], "a different canary stride must still specialise"


def test_small_write_of_every_tag_and_batch_size_binds_one_variant():
    """Batches of 1, 2, 16 and 17 one-token requests (entries <= 32: one LANES class)."""
    with record_variants() as variants:
        for kind in TAGS:
            ctx = _context(kind)
            for bs in (1, 2, 16, 17):
                slots = list(range(bs))
                launch_write(context=ctx, plan=write_plan([1] * bs, [-1] * bs),
                             **write_inputs([7] * bs, [0] * bs, slots))
    assert len(variants["_write_small_kernel"]) == 1
