"""Padding-read check (docs/design.md §3.12): hand cases, argument checks, random parity twin vs Triton
(interpreter)."""
from __future__ import annotations

import os

import pytest
import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops import CanaryLaunchTag, FailReason, launch_padding_read_check_kernel
from kvcanary.ops.constants import reason_label
from kvcanary.ops.dispatch import selected_backend

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BIT = int(FailReason.VERIFY_PADDING_SLOT_READ)
SENTINEL = -77
TAG = CanaryLaunchTag.HEAD_K_FULL


def _outputs(cap: int = 16, write_index: int = 0):
    ring = torch.full((cap, 8), SENTINEL, dtype=torch.int64)
    stamps = torch.full((cap, 3), SENTINEL, dtype=torch.int64)
    return ring, torch.tensor([write_index], dtype=torch.int32), stamps


def _run(rows, prefix, table, *, window=0, lut=None, ring_window=False, cap=16, write_index=0, step=7, tag=TAG,
         shared=None):
    ring, widx, stamps = _outputs(cap, write_index)
    launch_padding_read_check_kernel(
        req_pool_indices=torch.tensor(rows), prefix_lens=torch.tensor(prefix), req_to_token=table,
        swa_window_size=window, full_to_swa_index_mapping=lut, violation_ring=ring, violation_write_index=widx,
        stamps=stamps, step=torch.tensor([step]), kernel_kind=tag, ring_window=ring_window,
        shared_lens=None if shared is None else torch.tensor(shared),
    )
    return ring, int(widx[0]), stamps


def _table(rows: int = 4, width: int = 12) -> torch.Tensor:
    """Every entry a distinct non-zero slot: no hole anywhere."""
    return (torch.arange(rows * width, dtype=torch.int32).reshape(rows, width) + 1)


def test_live_row_hole_in_prefix_is_reported_with_its_batch_row():
    table = _table()
    table[2, 3] = 0  # request row 2 reads position 3 through the padding slot
    table[1, 9] = 0  # past row 1's prefix: computed this forward, not read from the cache
    ring, count, stamps = _run([1, 2], [6, 5], table)
    assert count == 1
    assert ring[0].tolist() == [int(TAG), 0, 3, 0, -1, 0, 0, BIT]
    assert stamps[0].tolist() == [7, 1, 3]  # step, batch row 1 (request row 2), position
    assert ring[1].tolist() == [SENTINEL] * 8 and stamps[1].tolist() == [SENTINEL] * 3
    assert reason_label(BIT) == "verify_padding_slot_read"


def test_padding_rows_and_clean_rows_are_silent():
    table = _table()
    table[0, :] = 0  # the padding row: a padded batch's row 0 reads nothing
    ring, count, _ = _run([0, 0, 3], [12, 4, 12], table)
    assert count == 0 and ring.eq(SENTINEL).all()
    ring, count, _ = _run([1, 2, 3], [12, 12, 0], _table())
    assert count == 0


def test_sliding_window_before_the_window_is_silent_inside_is_reported():
    table = _table()
    table[1, :6] = 0  # positions 0..5 nulled behind the window (an engine drops them legitimately)
    ring, count, _ = _run([1], [10], table, window=4)  # reads [6, 10)
    assert count == 0
    table[1, 6] = 0  # the window's first position
    table[1, 8] = 0
    ring, count, stamps = _run([1], [10], table, window=4)
    assert count == 2 and ring[:2, 2].tolist() == [6, 8] and stamps[:2, 1].tolist() == [0, 0]
    ring, count, _ = _run([1], [10], table, window=4, ring_window=True)  # a ring: reads [7, 10)
    assert count == 1 and ring[0, 2].item() == 8


def test_shared_positions_move_a_window_not_full_attention():
    """A row whose first extend tokens another row computes (``shared_lens``): its own first query sits that much
    later, and so does its window."""
    table = _table()
    table[1, :5] = 0  # behind the window of the row's own first query (P + S = 9, W = 4: reads [5, 9))
    ring, count, _ = _run([1], [6], table, window=4, shared=[3])
    assert count == 0
    ring, count, _ = _run([1], [6], table, window=4, shared=[0])  # without the share: [2, 6) holds holes 2..4
    assert count == 3
    ring, count, _ = _run([1], [6], table, window=0, shared=[3])  # full attention reads [0, 6) either way
    assert count == 5


def test_lut_resolves_holes_and_out_of_range_values_are_not_holes():
    table = _table(3, 8)
    lut = torch.arange(40, dtype=torch.int64) + 100
    lut[table[1, 5].long()] = 0  # the full slot of position 5 maps to the padding slot of the group
    table[1, 2] = 99  # past the LUT: the plan's error, not a hole here
    ring, count, stamps = _run([1], [8], table, window=6, lut=lut)
    assert count == 1
    assert ring[0].tolist() == [int(TAG), 0, 5, 0, -1, 0, int(table[1, 5]), BIT]


def test_fill_once_past_the_capacity():
    table = torch.zeros(3, 10, dtype=torch.int32)  # every position a hole
    ring, count, stamps = _run([2, 1], [4, 3], table, cap=5, write_index=2)
    assert count == 2 + 7
    assert ring[2:, 2].tolist() == [0, 1, 2]  # row 2's first positions, then the ring is full
    assert stamps[2:, 1].tolist() == [0, 0, 0]
    assert ring[:2].eq(SENTINEL).all() and stamps[:2].eq(SENTINEL).all()


def test_rows_outside_the_table_and_prefixes_past_its_width():
    table = torch.zeros(3, 5, dtype=torch.int32)
    ring, count, _ = _run([7, -1], [4, 4], table)  # not in the table: the plan's to refuse
    assert count == 0
    ring, count, _ = _run([1], [9], table)  # cut at the width
    assert count == 5


def test_refuses_bad_arguments_before_touching_anything():
    ring, widx, stamps = _outputs()
    good = dict(req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([2]), req_to_token=_table(),
                swa_window_size=0, full_to_swa_index_mapping=None, violation_ring=ring, violation_write_index=widx,
                stamps=stamps, step=torch.tensor([1]), kernel_kind=0)
    cases = [
        (dict(req_to_token=_table().float()), KvCanaryTypeError, "req_to_token must be"),
        (dict(prefix_lens=torch.tensor([1, 2])), KvCanaryValueError, "prefix_lens has 2 rows"),
        (dict(violation_ring=torch.zeros(16, 7, dtype=torch.int64)), KvCanaryValueError, "violation_ring must be int64"),
        (dict(stamps=torch.zeros(15, 3, dtype=torch.int64)), KvCanaryValueError, "stamps must be int64"),
        (dict(step=torch.tensor([1, 2])), KvCanaryValueError, "step must hold exactly 1"),
        (dict(swa_window_size=1.5), KvCanaryTypeError, "swa_window_size must be an int"),
        (dict(full_to_swa_index_mapping=torch.zeros(4, dtype=torch.int32)), KvCanaryTypeError, "full_to_swa"),
        (dict(ring_window=1), KvCanaryTypeError, "ring_window must be a bool"),
        (dict(shared_lens=torch.tensor([1, 2])), KvCanaryValueError, "shared_lens has 2 rows"),
    ]
    for change, error, text in cases:
        with pytest.raises(error, match=f"kv-canary: launch_padding_read_check_kernel {text}"):
            launch_padding_read_check_kernel(**{**good, **change})
    assert ring.eq(SENTINEL).all() and int(widx[0]) == 0


def _random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    n_rows = int(torch.randint(2, 7, (1,), generator=g))
    wide = seed % 4 == 0  # rows spanning several position blocks of the kernel
    width = int(torch.randint(1100, 2600, (1,), generator=g)) if wide else int(torch.randint(1, 40, (1,), generator=g))
    bs = int(torch.randint(0 if seed == 5 else 1, 9, (1,), generator=g))
    table = torch.randint(-2, 30, (n_rows, width), generator=g, dtype=torch.int64)
    table = torch.where(torch.rand(n_rows, width, generator=g) < 0.15, 0, table)  # holes: some 18 %
    table = table.to(torch.int32 if seed % 2 else torch.int64)
    if seed % 5 == 1:  # a column-strided view of a wider table
        table = torch.cat([table, table], dim=1)[:, ::2]
    rows = torch.randint(-1, n_rows + 1, (bs,), generator=g)
    prefix = torch.randint(-2, width + 4, (bs,), generator=g)
    window = [0, 1500][seed // 4 % 2] if wide else [0, 0, 1, 3, 17, 900][seed % 6]
    lut = None
    if seed % 3 == 0:
        lut = torch.randint(0, 12, (int(torch.randint(0, 35, (1,), generator=g)),), generator=g)
        lut = torch.where(torch.rand(lut.shape[0], generator=g) < 0.3, 0, lut)
    shared = torch.randint(0, 5, (bs,), generator=g) if seed % 4 == 1 else None
    return dict(req_pool_indices=rows.to(torch.int32 if seed % 3 == 2 else torch.int64), prefix_lens=prefix,
                req_to_token=table, swa_window_size=window, full_to_swa_index_mapping=lut,
                ring_window=bool(seed % 7 == 3), shared_lens=shared), g


def _sorted_pairs(ring: torch.Tensor, stamps: torch.Tensor, lo: int, hi: int) -> list:
    return sorted(zip(map(tuple, ring[lo:hi].tolist()), map(tuple, stamps[lo:hi].tolist())))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
@pytest.mark.parametrize("seed", range(24))
def test_triton_matches_twin_on_random_inputs(seed):
    from tests.ops.test_triton_interpret import _numpy_scalar_index_fix

    _numpy_scalar_index_fix()
    args, g = _random_case(seed)
    write_index = int(torch.randint(0, 4, (1,), generator=g))
    cap = 4096 if seed % 8 else 6  # a small ring: overflow (counts must agree, the kept subset may differ)
    out = {}
    for name in ("torch", "triton"):
        ring, widx, stamps = _outputs(cap, write_index)
        with selected_backend(name):
            launch_padding_read_check_kernel(**args, violation_ring=ring, violation_write_index=widx, stamps=stamps,
                                             step=torch.tensor([seed + 3]), kernel_kind=CanaryLaunchTag.HEAD_K_SWA)
        out[name] = (ring, widx, stamps)
    (ra, wa, sa), (rb, wb, sb) = out["torch"], out["triton"]
    assert torch.equal(wa, wb)
    hi = min(int(wa[0]), cap)
    assert torch.equal(ra[hi:], rb[hi:]) and torch.equal(sa[hi:], sb[hi:])  # nothing stored past the rows
    assert torch.equal(ra[:write_index], rb[:write_index]) and torch.equal(sa[:write_index], sb[:write_index])
    if int(wa[0]) <= cap:  # no overflow: the same rows and stamps, in any order
        assert _sorted_pairs(ra, sa, write_index, hi) == _sorted_pairs(rb, sb, write_index, hi)
    else:
        assert (rb[write_index:, 7] == BIT).all()


def test_random_inputs_match_a_scalar_oracle():
    """The twin against loops over Python ints (the contract read literally)."""
    for seed in range(40):
        args, _ = _random_case(seed)
        ring, widx, stamps = _outputs(4096)
        launch_padding_read_check_kernel(**args, violation_ring=ring, violation_write_index=widx, stamps=stamps,
                                         step=torch.tensor([5]), kernel_kind=3)
        table, lut = args["req_to_token"].tolist(), args["full_to_swa_index_mapping"]
        lut = None if lut is None else lut.tolist()
        w, want = args["swa_window_size"], []
        for r, (rp, p) in enumerate(zip(args["req_pool_indices"].tolist(), args["prefix_lens"].tolist())):
            if rp == 0 or not 0 <= rp < len(table):
                continue
            shared = 0 if args["shared_lens"] is None else int(args["shared_lens"][r])
            lo = 0 if w <= 0 else max(p + shared - w + int(args["ring_window"]), 0)
            for pos in range(lo, min(p, len(table[0]))):
                raw = table[rp][pos]
                slot = raw if lut is None or raw < 0 else (lut[raw] if raw < len(lut) else -1)
                if slot == 0:
                    want.append(([3, 0, pos, 0, -1, 0, raw, BIT], [5, r, pos]))
        n = int(widx[0])
        assert n == len(want), seed
        assert list(zip(ring[:n].tolist(), stamps[:n].tolist())) == [(a, b) for a, b in want], seed
