"""Shared fixtures: builders for canary contexts, plans and real-KV sources; a seeded generator.

Builders are plain functions handed out by fixtures, so hypothesis tests can use them too.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, Optional, Sequence

import pytest
import torch

# Without a GPU, Triton kernels can only run in its interpreter, and Triton reads this when it is
# first imported (any test module may import it first, e.g. through transformers).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcanary.ops.constants import CanaryLaunchTag, RealKvHashMode
from kvcanary.ops.records import RealKvSource, VerifyOrWriteContext, VerifyPlan, WritePlan
from kvcanary.runtime.device_probe import DevicePath, DeviceProber, use_prober

@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """The named loggers at CRITICAL for the block, their levels restored after."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@pytest.fixture(scope="module")
def quiet_engine() -> Iterator[None]:
    """transformers' continuous-batching logger silenced for a module (``pytest.mark.usefixtures``)."""
    with quiet_loggers("ContinuousBatchingLogger"):
        yield


@pytest.fixture(scope="module")
def quiet_engine_and_canary() -> Iterator[None]:
    """The engine's and kvcanary's loggers silenced for a module."""
    with quiet_loggers("ContinuousBatchingLogger", "kvcanary"):
        yield


@pytest.fixture(scope="module")
def llama():
    """The demo's tiny random Llama on the CPU (seed 0); modules using it skip without transformers."""
    from kvcanary.cli.demo import tiny_model

    return tiny_model("llama", torch.device("cpu"), seed=0)


@pytest.fixture(scope="module")
def qwen3():
    """The demo's tiny random Qwen3 with sliding-window layers on the CPU (seed 0)."""
    from kvcanary.cli.demo import tiny_model

    return tiny_model("qwen3_swa", torch.device("cpu"), seed=0)


RING_SENTINEL = -77
NUM_TAGS = len(CanaryLaunchTag)


def build_context(
    *,
    num_slots: int = 32,
    stride_bytes: int = 32,
    ring_capacity: int = 8,
    kind: int = CanaryLaunchTag.TAIL_K_FULL,
    sources: Sequence[RealKvSource] = (),
    mode: int = RealKvHashMode.NONE,
    chain_assert: int = 0,
    write_index: int = 0,
    slot_count: int = 0,
    kernel_count: int = 0,
    fill: str = "zero",
    generator: Optional[torch.Generator] = None,
) -> VerifyOrWriteContext:
    """A context with a fresh buffer (zeros or random bytes), a ring filled with RING_SENTINEL and
    counters that are one-element views of per-tag arrays (``counter._base`` is the whole array)."""
    if fill == "zero":
        buf = torch.zeros(num_slots, stride_bytes, dtype=torch.uint8)
    else:
        buf = torch.randint(0, 256, (num_slots, stride_bytes), dtype=torch.uint8, generator=generator)
    k = int(kind)
    slot_counts = torch.arange(100, 100 + NUM_TAGS, dtype=torch.int64)
    kernel_counts = torch.arange(200, 200 + NUM_TAGS, dtype=torch.int64)
    slot_counts[k] = slot_count
    kernel_counts[k] = kernel_count
    return VerifyOrWriteContext(
        canary_buf=buf,
        kernel_kind=kind,
        violation_ring=torch.full((ring_capacity, 8), RING_SENTINEL, dtype=torch.int64),
        violation_write_index=torch.tensor([write_index], dtype=torch.int32),
        slot_run_counter=slot_counts[k : k + 1],
        kernel_run_counter=kernel_counts[k : k + 1],
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=mode,
        enable_chain_position_assert=torch.tensor([chain_assert], dtype=torch.int32),
    )


def build_verify_plan(
    slots: Sequence[int],
    positions: Sequence[int],
    prevs: Sequence[int],
    tokens: Optional[Sequence[int]] = None,
    *,
    num_valid: Optional[int] = None,
    enable: int = 1,
    capacity: Optional[int] = None,
) -> VerifyPlan:
    """A VerifyPlan holding the given entries (padding entries past them are slot 0)."""
    n = len(slots)
    cap = capacity if capacity is not None else max(n, 1)
    plan = VerifyPlan.allocate(cap, "cpu")
    tokens = list(tokens) if tokens is not None else [-1] * n
    for arr, vals in (
        (plan.verify_slot_indices, slots), (plan.verify_expected_tokens, tokens),
        (plan.verify_expected_positions, positions), (plan.verify_prev_slot_indices, prevs),
    ):
        arr.zero_()
        arr[:n] = torch.tensor(list(vals), dtype=torch.int64)
    plan.verify_num_valid[0] = n if num_valid is None else num_valid
    plan.enable[0] = enable
    return plan


def build_write_plan(
    lengths: Sequence[int], seeds: Sequence[int], *, num_valid: Optional[int] = None, capacity: Optional[int] = None
) -> WritePlan:
    """A WritePlan for requests of the given entry counts and seed slots."""
    n = len(lengths)
    cap = capacity if capacity is not None else max(n, 1)
    plan = WritePlan.allocate(cap, "cpu")
    off = 0
    plan.write_offsets[0] = 0
    for r, length in enumerate(lengths):
        off += length
        plan.write_offsets[r + 1] = off
        plan.write_seed_slot_indices[r] = seeds[r]
    plan.write_num_valid_reqs[0] = n if num_valid is None else num_valid
    return plan


def build_source(
    *,
    num_slots: int,
    page_size: int = 1,
    num_bytes_per_token: int = 16,
    read_bytes: Optional[int] = None,
    dtype: torch.dtype = torch.uint8,
    row_pad_bytes: int = 0,
    stride_pad_bytes: int = 0,
    inner_shape: Optional[tuple] = None,
    generator: Optional[torch.Generator] = None,
) -> RealKvSource:
    """A random real-KV source for ``num_slots`` slots.

    row_pad_bytes: extra logical columns per row past the strips (ignored by the hash).
    stride_pad_bytes: extra storage per row outside the logical row (a row-strided view).
    inner_shape: split each row's elements into this shape (a >2-D tensor).
    """
    es = torch.empty(0, dtype=dtype).element_size()
    rows = -(-num_slots // page_size)
    row_bytes = page_size * num_bytes_per_token + row_pad_bytes
    stored = row_bytes + stride_pad_bytes
    raw = torch.randint(0, 256, (rows, stored), dtype=torch.uint8, generator=generator)
    full = raw.view(dtype)  # [rows, stored // es]
    t = full[:, : row_bytes // es]
    if inner_shape is not None:
        t = t.reshape(rows, *inner_shape) if stride_pad_bytes == 0 else t.unflatten(1, inner_shape)
    return RealKvSource(
        tensor=t,
        page_size=page_size,
        num_bytes_per_token=num_bytes_per_token,
        read_bytes=num_bytes_per_token if read_bytes is None else read_bytes,
    )


@pytest.fixture
def gen() -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(1234)
    return g


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


@pytest.fixture
def make_context():
    return build_context


@pytest.fixture
def make_verify_plan():
    return build_verify_plan


@pytest.fixture
def make_write_plan():
    return build_write_plan


@pytest.fixture
def make_source():
    return build_source


class EagerFallbackProber(DeviceProber):
    """Proves every device to the eager fallback, as a CUDA machine whose Triton does not work (opted in) would."""

    def prove(self, device, *, allow_eager_fallback=False) -> DevicePath:
        return DevicePath(device=str(device), path="eager_fallback", graphs=False, cause="triton_missing",
                          detail="import triton failed")


@pytest.fixture
def eager_fallback() -> Iterator[None]:
    """Every canary and engine adapter created in the test runs the eager fallback: its device path is proved by an
    `EagerFallbackProber` (`kvcanary.runtime.device_probe.use_prober`), the process's prober restored after."""
    with use_prober(EagerFallbackProber()):
        yield
