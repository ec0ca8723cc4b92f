"""Paged-KV bookkeeping ops (docs/design.md §3.10): hand cases, random parity twin vs Triton (interpreter)."""
from __future__ import annotations

import os

import pytest
import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops import launch_block_table_slots_kernel, launch_mark_written_slots_kernel
from kvcanary.ops.dispatch import selected_backend

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_block_table_slots_hand_case():
    table = torch.full((4, 10), -5, dtype=torch.int32)
    bt = torch.tensor([[3, 0, 7], [2, 5, 0]], dtype=torch.int32)
    launch_block_table_slots_kernel(block_table=bt, rows=torch.tensor([2, 1]), seq_lens=torch.tensor([9, 5]),
                                    block_size=4, width=10, table_out=table)
    assert table[2].tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 28, 0]
    assert table[1].tolist() == [8, 9, 10, 11, 20, 0, 0, 0, 0, 0]
    assert table[0].tolist() == [-5] * 10 and table[3].tolist() == [-5] * 10  # rows not named: untouched


def test_block_table_slots_drop_null_and_row_outside():
    table = torch.full((2, 6), -1, dtype=torch.int64)
    bt = torch.tensor([[0, 4], [1, 1]])
    launch_block_table_slots_kernel(block_table=bt, rows=torch.tensor([1, 9]), seq_lens=torch.tensor([6, 6]),
                                    block_size=3, width=6, table_out=table, drop_null=True)
    assert table.tolist() == [[-1] * 6, [0, 0, 0, 12, 13, 14]]  # row 9 is outside the table: nothing written


def test_block_table_slots_to_each_rows_length_keeps_the_rest():
    table = torch.full((4, 10), -5, dtype=torch.int32)
    bt = torch.tensor([[3, 0, 7], [2, 5, 0], [1, 1, 1]], dtype=torch.int32)
    launch_block_table_slots_kernel(block_table=bt, rows=torch.tensor([2, 1, 0]), seq_lens=torch.tensor([9, 5, 0]),
                                    block_size=4, width=None, table_out=table, drop_null=True)
    assert table[2].tolist() == [12, 13, 14, 15, 0, 0, 0, 0, 28, -5]  # drop_null: block 0 -> 0; past 9 kept
    assert table[1].tolist() == [8, 9, 10, 11, 20, -5, -5, -5, -5, -5]
    assert table[0].tolist() == [-5] * 10  # length 0: nothing written
    table = torch.full((4, 10), -5, dtype=torch.int32)  # rows past the block table's own: nothing written
    launch_block_table_slots_kernel(block_table=bt[:1], rows=torch.tensor([2, 1]), seq_lens=torch.tensor([9, 5]),
                                    block_size=4, width=None, table_out=table)
    assert table[2].tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 28, -5] and table[1].tolist() == [-5] * 10


def test_block_table_slots_refuses_bad_input():
    table = torch.zeros(2, 4, dtype=torch.int32)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(KvCanaryTypeError, match="kv-canary: block_table_slots rows must be int64"):
        launch_block_table_slots_kernel(block_table=bt, rows=torch.tensor([0], dtype=torch.int32),
                                        seq_lens=torch.tensor([1]), block_size=2, width=4, table_out=table)
    with pytest.raises(KvCanaryValueError, match="width must be None or an int in"):
        launch_block_table_slots_kernel(block_table=bt, rows=torch.tensor([0]), seq_lens=torch.tensor([1]),
                                        block_size=2, width=5, table_out=table)
    with pytest.raises(KvCanaryValueError, match="needs 2 rows"):
        launch_block_table_slots_kernel(block_table=bt, rows=torch.tensor([0, 1]), seq_lens=torch.tensor([1, 1]),
                                        block_size=2, width=4, table_out=table)
    with pytest.raises(KvCanaryValueError, match="unit column stride"):
        launch_block_table_slots_kernel(block_table=torch.zeros(4, 2, dtype=torch.int32).t(), rows=torch.tensor([0]),
                                        seq_lens=torch.tensor([1]), block_size=2, width=4, table_out=table)


def test_mark_written_slots_counts_rewrites():
    ever = torch.zeros(8, dtype=torch.uint8)
    count = torch.zeros(1, dtype=torch.int64)
    launch_mark_written_slots_kernel(slots=torch.tensor([1, 2, -1, 9]), ever_written=ever, rewritten=count)
    assert count.item() == 0 and ever.tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    launch_mark_written_slots_kernel(slots=torch.tensor([2, 3, 1], dtype=torch.int32), ever_written=ever,
                                     rewritten=count)
    assert count.item() == 2 and ever.tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    with pytest.raises(KvCanaryTypeError, match="ever_written must be uint8"):
        launch_mark_written_slots_kernel(slots=torch.tensor([1]), ever_written=ever.bool(), rewritten=count)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
@pytest.mark.parametrize("seed", range(6))
def test_paged_triton_matches_twin(seed):
    g = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 9, (1,), generator=g))
    block = int(torch.randint(1, 17, (1,), generator=g))
    width = int(torch.randint(0, 70, (1,), generator=g))
    nblk = int(torch.randint(1, 8, (1,), generator=g))
    bt = torch.randint(0, 40, (bs + 2, nblk), generator=g, dtype=torch.int64).to(
        torch.int32 if seed % 2 else torch.int64)
    rows = torch.randperm(12, generator=g)[:bs] - 1  # distinct, one may be -1 (outside)
    seq = torch.randint(0, width + 5, (bs,), generator=g)
    out = {}
    for name in ("torch", "triton"):
        table = torch.full((11, 80), 7, dtype=torch.int32)
        with selected_backend(name):
            launch_block_table_slots_kernel(block_table=bt, rows=rows, seq_lens=seq, block_size=block, width=width,
                                            table_out=table, drop_null=bool(seed % 3 == 0))
        out[name] = table
    assert torch.equal(out["torch"], out["triton"])
    for name in ("torch", "triton"):  # to each row's length (lengths past the table's 80 columns clamp)
        table = torch.full((11, 80), 7, dtype=torch.int32)
        with selected_backend(name):
            launch_block_table_slots_kernel(block_table=bt[: max(bs - seed % 3, 0)], rows=rows,
                                            seq_lens=seq * (1 + seed % 2), block_size=block, width=None, table_out=table, drop_null=bool(seed % 3 == 0))
        out[name] = table
    assert torch.equal(out["torch"], out["triton"])
    slots = torch.randperm(60, generator=g)[:25] - 5
    res = {}
    for name in ("torch", "triton"):
        ever = (torch.rand(50, generator=torch.Generator().manual_seed(seed)) < 0.3).to(torch.uint8)
        count = torch.tensor([3])
        with selected_backend(name):
            launch_mark_written_slots_kernel(slots=slots, ever_written=ever, rewritten=count)
        res[name] = (ever, count)
    assert torch.equal(res["torch"][0], res["triton"][0]) and torch.equal(res["torch"][1], res["triton"][1])

