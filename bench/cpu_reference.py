"""CPU throughput of the vectorised torch twins against the targets of docs/design.md §7.

Run alone: ``python bench/cpu_reference.py``. Prints one line per measurement (median of
several runs after a warm-up) and a table of rate vs target last.
"""
from __future__ import annotations

import os
import platform
import statistics
import time

import torch

from kvcanary.ops import (
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel_torch_reference,
)
from kvcanary.ops.reference import chain_scan

PAGE = 16
HEAD_BYTES = 256  # bytes per token per source (e.g. 1 KV head x 128 x bf16)


def _median_seconds(fn, *, repeats: int = 15, setup=None) -> float:
    if setup:
        setup()
    fn()  # warm-up (numba compile, allocator)
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _context(num_slots: int, sources=(), mode=RealKvHashMode.NONE) -> VerifyOrWriteContext:
    return VerifyOrWriteContext(
        canary_buf=torch.zeros(num_slots, 32, dtype=torch.uint8),
        kernel_kind=2,
        violation_ring=torch.zeros(1024, 8, dtype=torch.int64),
        violation_write_index=torch.zeros(1, dtype=torch.int32),
        slot_run_counter=torch.zeros(1, dtype=torch.int64),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64),
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=mode,
        enable_chain_position_assert=torch.zeros(1, dtype=torch.int32),
    )


def _paged_slots(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    pages = torch.randperm(num_tokens // PAGE + 1, generator=gen)[: num_tokens // PAGE] + 1
    return (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()


def _write_chain(ctx, slots, tokens) -> None:
    """Write one request's chain over ``slots`` so a verify of it is clean."""
    n = slots.numel()
    plan = WritePlan.allocate(1)
    plan.write_offsets[:2] = torch.tensor([0, n])
    plan.write_num_valid_reqs.fill_(1)
    launch_canary_write_kernel_torch_reference(
        context=ctx, plan=plan, input_ids=tokens, positions=torch.arange(n), out_cache_loc=slots,
        enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
    )


def bench_verify(mode: RealKvHashMode, num_sources: int, n: int = 1 << 20) -> float:
    gen = torch.Generator().manual_seed(0)
    slots = _paged_slots(n, gen)
    num_slots = int(slots.max()) + PAGE
    sources = []
    for _ in range(num_sources):
        kv = torch.randint(0, 256, (num_slots // PAGE + 1, PAGE * HEAD_BYTES), dtype=torch.uint8, generator=gen)
        sources.append(RealKvSource(tensor=kv, page_size=PAGE, num_bytes_per_token=HEAD_BYTES, read_bytes=HEAD_BYTES))
    ctx = _context(num_slots, sources, mode)
    tokens = torch.randint(0, 32000, (n,), generator=gen)
    _write_chain(ctx, slots, tokens)
    plan = VerifyPlan.allocate(n)
    plan.verify_slot_indices.copy_(slots)
    plan.verify_expected_tokens.copy_(tokens)
    plan.verify_expected_positions.copy_(torch.arange(n))
    plan.verify_prev_slot_indices[0] = -1
    plan.verify_prev_slot_indices[1:] = slots[:-1]
    plan.verify_num_valid.fill_(n)

    def run():
        launch_canary_verify_kernel_torch_reference(context=ctx, plan=plan, check_verify_expected_token=True)

    sec = _median_seconds(run)
    assert int(ctx.violation_write_index[0]) == 0, "benchmark chain must verify clean"
    return n / sec


def bench_write(num_requests: int, tokens_per_request: int) -> float:
    gen = torch.Generator().manual_seed(1)
    n = num_requests * tokens_per_request
    ctx = _context(n + PAGE)
    plan = WritePlan.allocate(num_requests)
    plan.write_offsets.copy_(torch.arange(num_requests + 1) * tokens_per_request)
    plan.write_num_valid_reqs.fill_(num_requests)
    plan.write_seed_slot_indices.copy_(torch.randperm(n, generator=gen)[:num_requests] + 1 if tokens_per_request == 1 else torch.full((num_requests,), -1))
    slots = torch.randperm(n, generator=gen) + 1 if tokens_per_request == 1 else torch.arange(n) + 1
    # decode: seeds are other slots; keep them disjoint from the written slots
    if tokens_per_request == 1:
        ctx = _context(2 * n + PAGE)
        slots = slots + n
    ids = torch.randint(0, 32000, (n,), generator=gen)
    pos = torch.arange(n) % 4096

    def run():
        launch_canary_write_kernel_torch_reference(
            context=ctx, plan=plan, input_ids=ids, positions=pos, out_cache_loc=slots,
            enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
        )

    return n / _median_seconds(run)


def bench_plan(bs: int = 64, prefix: int = 4096) -> float:
    gen = torch.Generator().manual_seed(2)
    req_to_token = torch.randint(1, 1 << 20, (bs + 1, prefix + 8), dtype=torch.int32, generator=gen)
    n = bs * prefix
    vp, wp = VerifyPlan.allocate(n), WritePlan.allocate(bs)

    def run():
        launch_canary_plan_kernels_torch_reference(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.arange(1, bs + 1),
            prefix_lens=torch.full((bs,), prefix), extend_seq_lens=torch.ones(bs, dtype=torch.int64),
            req_to_token=req_to_token, swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=n,
            req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0,
        )

    return n / _median_seconds(run)


def main() -> None:
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__} "
          f"(threads {torch.get_num_threads()}), numba scan: {chain_scan.compiled_scan() is not None}")
    # Last column: SGLang's per-element torch reference on this machine kind, as quoted in docs/design.md §7
    # (verify 46 k/s NONE, 28 k/s PARTIAL 2 sources; write 62 k tokens/s; plan 218 k entries/s).
    rows = [
        ("verify NONE, 1M entries (paged)", bench_verify(RealKvHashMode.NONE, 0), 10e6, 46e3, "entries/s"),
        ("verify PARTIAL, 2 sources, 1M entries", bench_verify(RealKvHashMode.PARTIAL, 2), 3e6, 28e3, "entries/s"),
        ("write one 100k-token request", bench_write(1, 100_000), 1e6, 62e3, "tokens/s"),
        ("write 4096 one-token requests", bench_write(4096, 1), 1e6, 62e3, "tokens/s"),
        ("plan bs 64 x 4k prefix", bench_plan(), 10e6, 218e3, "entries/s"),
    ]
    print(f"\n{'measurement':40s} {'rate':>14s} {'target':>10s} {'ratio':>7s} {'vs SGLang ref':>14s}")
    for name, rate, target, sglang, unit in rows:
        print(f"{name:40s} {rate / 1e6:10.2f} M/s {target / 1e6:7.1f} M/s {rate / target:6.2f}x "
              f"{rate / sglang:12.0f}x  ({unit})")


if __name__ == "__main__":
    main()
