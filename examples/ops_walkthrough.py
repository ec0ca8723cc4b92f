"""Walk through the op layer by hand: plan, write and verify three requests, corrupt the cache,
and print what was checked and what was caught.

Run: ``python examples/ops_walkthrough.py``
"""
from __future__ import annotations

import torch

from kvcanary.ops import (
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_verify_kernel,
    launch_canary_write_kernel,
)
from kvcanary.ops.constants import reason_label

PAGE, BYTES_PER_TOKEN, NUM_SLOTS = 4, 64, 64


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, (NUM_SLOTS // PAGE, PAGE * BYTES_PER_TOKEN), dtype=torch.uint8, generator=gen)
    ctx = VerifyOrWriteContext(
        canary_buf=torch.zeros(NUM_SLOTS, 32, dtype=torch.uint8),
        kernel_kind=CanaryLaunchTag.TAIL_K_FULL,
        violation_ring=torch.zeros(16, 8, dtype=torch.int64),
        violation_write_index=torch.zeros(1, dtype=torch.int32),
        slot_run_counter=torch.zeros(1, dtype=torch.int64),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64),
        real_kv_sources=(RealKvSource(tensor=kv, page_size=PAGE, num_bytes_per_token=BYTES_PER_TOKEN, read_bytes=32),),
        real_kv_hash_mode=RealKvHashMode.PARTIAL,
        enable_chain_position_assert=torch.ones(1, dtype=torch.int32),
    )
    # Three requests in rows 1..3 of the request table; slot 0 is padding.
    prompts = {1: [11, 12, 13, 14, 15], 2: [21, 22, 23], 3: [31, 32, 33, 34]}
    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    next_slot = 1
    for row, toks in prompts.items():
        req_to_token[row, : len(toks) + 1] = torch.arange(next_slot, next_slot + len(toks) + 1)
        next_slot += len(toks) + 1
    vplan, wplan = VerifyPlan.allocate(64), WritePlan.allocate(4)
    rows = torch.tensor([1, 2, 3])

    def step(prefix, extend, ids, title):
        launch_canary_plan_kernels(
            verify_plan_out=vplan, write_plan_out=wplan, req_pool_indices=rows, prefix_lens=prefix,
            extend_seq_lens=extend, req_to_token=req_to_token, swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=64, req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0,
        )
        before = int(ctx.violation_write_index[0])
        launch_canary_verify_kernel(context=ctx, plan=vplan, check_verify_expected_token=False)
        positions = torch.cat([torch.arange(int(p), int(p) + int(e)) for p, e in zip(prefix, extend)])
        slots = torch.cat([req_to_token[r, int(p) : int(p) + int(e)] for r, p, e in zip(rows, prefix, extend)])
        launch_canary_write_kernel(
            context=ctx, plan=wplan, input_ids=ids, positions=positions, out_cache_loc=slots.to(torch.int64),
            enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
        )
        found = int(ctx.violation_write_index[0]) - before
        print(f"{title:34s} verified {int(vplan.verify_num_valid[0]):3d} slots, wrote {len(ids):3d}, violations {found}")

    lens = torch.tensor([len(t) for t in prompts.values()])
    step(torch.zeros(3, dtype=torch.int64), lens, torch.tensor(sum(prompts.values(), [])), "prefill (3 requests)")
    step(lens, torch.ones(3, dtype=torch.int64), torch.tensor([16, 24, 35]), "decode step 1")
    kv[1, 2 * BYTES_PER_TOKEN + 3] ^= 0x10  # slot 6 (request 1, position 5): flip a byte of its K
    ctx.canary_buf.view(torch.int64)[12, 1] += 1  # slot 12 (request 3, position 1) now claims position 2
    step(lens + 1, torch.ones(3, dtype=torch.int64), torch.tensor([17, 25, 36]), "decode step 2 (after corruption)")

    print("\nviolations:")
    print(f"{'tag':12s} {'slot':>4s} {'pos':>4s} {'token':>6s}  reason")
    for row in ctx.violation_ring[: int(ctx.violation_write_index[0])].tolist():
        print(f"{CanaryLaunchTag(row[0]).name:12s} {row[1]:4d} {row[2]:4d} {row[3]:6d}  {reason_label(row[7])}")


if __name__ == "__main__":
    main()
