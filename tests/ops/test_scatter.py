"""Hand cases for the expected-token scatter (docs/design.md §3.8)."""
from __future__ import annotations

import pytest
import torch

from kvcanary.ops import launch_scatter_req_token_ids_kernel, scatter_req_token_ids_torch_reference

from .oracle import oracle_scatter

SCATTERS = pytest.mark.parametrize(
    "scatter", [scatter_req_token_ids_torch_reference, launch_scatter_req_token_ids_kernel], ids=["twin", "launcher"]
)


def go(scatter, pool, flat, offsets, rows):
    scatter(flat_in=torch.tensor(flat, dtype=torch.int64), offsets=torch.tensor(offsets, dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64), pool_out=pool)


@SCATTERS
def test_basic_rows(scatter):
    pool = torch.full((4, 5), -7, dtype=torch.int32)
    go(scatter, pool, [1, 2, 3, 4, 5, 6], [0, 2, 2, 6], [3, 1, 2])
    assert pool.tolist() == [[-7] * 5, [-7] * 5, [3, 4, 5, 6, -7], [1, 2, -7, -7, -7]]


@SCATTERS
def test_clipped_to_table_width(scatter):
    pool = torch.zeros(3, 3, dtype=torch.int32)
    go(scatter, pool, [9, 8, 7, 6, 5, -4], [0, 5, 6], [1, 2])
    assert pool.tolist() == [[0, 0, 0], [9, 8, 7], [-4, 0, 0]]


@SCATTERS
def test_nothing_when_no_rows_or_no_tokens(scatter):
    pool = torch.full((2, 3), 5, dtype=torch.int32)
    go(scatter, pool, [], [0], [])
    go(scatter, pool, [], [0, 0, 0], [0, 1])
    go(scatter, pool, [1, 2], [1, 1, 0], [0, 1])  # zero and negative row lengths write nothing
    assert pool.eq(5).all()


@SCATTERS
def test_values_converted_to_int32(scatter):
    pool = torch.zeros(2, 3, dtype=torch.int32)
    go(scatter, pool, [2**31 - 1, -(2**31), 2**32 + 5], [0, 3], [1])
    assert pool[1].tolist() == [2**31 - 1, -(2**31), 5]


@SCATTERS
def test_offsets_not_starting_at_zero_and_view_output(scatter):
    big = torch.full((6, 6), -1, dtype=torch.int32)
    pool = big[1:5, 1:5]
    go(scatter, pool, [0, 0, 7, 8, 9], [2, 4, 5], [0, 3])
    want = [[-1] * 6 for _ in range(6)]
    want[1][1:3] = [7, 8]
    want[4][1] = 9
    assert big.tolist() == want


def test_twin_matches_oracle_with_repeated_rows():
    pool = torch.full((3, 4), -1, dtype=torch.int32)
    flat, offsets, rows = [1, 2, 3, 4, 5, 6, 7], [0, 3, 4, 7], [1, 1, 2]
    want = oracle_scatter(pool.tolist(), flat_in=flat, offsets=offsets, req_pool_indices=rows)
    go(scatter_req_token_ids_torch_reference, pool, flat, offsets, rows)
    assert pool.tolist() == want == [[-1] * 4, [4, 2, 3, -1], [5, 6, 7, -1]]


@pytest.mark.parametrize("bad_row", [-1, 4, 99])
def test_request_row_outside_the_table_raises_before_writing(bad_row):
    from kvcanary.errors import KvCanaryValueError

    pool = torch.full((4, 3), 5, dtype=torch.int32)
    with pytest.raises(KvCanaryValueError, match=r"req_pool_indices\[1\]=.* outside the request table rows \[0, 4\)"):
        go(launch_scatter_req_token_ids_kernel, pool, [1, 2, 3, 4], [0, 2, 4], [1, bad_row])
    assert pool.eq(5).all(), "nothing may be written when the launcher raises"


def test_triton_scatter_writes_nothing_for_a_row_outside_the_table():
    """What the kernel does under graph capture (no host check): the bad row is skipped, the others land."""
    triton_ops = pytest.importorskip("kvcanary.ops.triton")
    if not getattr(triton_ops, "AVAILABLE", False):
        pytest.skip("Triton unavailable")
    pool = torch.full((4, 3), 5, dtype=torch.int32)
    triton_ops.launch_scatter(flat_in=torch.tensor([1, 2, 3, 4, 6], dtype=torch.int64),
                              offsets=torch.tensor([0, 2, 4, 5], dtype=torch.int64),
                              req_pool_indices=torch.tensor([1, 7, -3], dtype=torch.int64), pool_out=pool)
    assert pool.tolist() == [[5, 5, 5], [1, 2, 5], [5, 5, 5], [5, 5, 5]]
