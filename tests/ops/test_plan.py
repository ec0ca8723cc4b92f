"""Hand cases for the plan op (docs/design.md §3.5), on the twin and on the public launcher."""
from __future__ import annotations

import pytest
import torch

from kvcanary.ops import (
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
)

PLANS = pytest.mark.parametrize(
    "plan_op", [launch_canary_plan_kernels_torch_reference, launch_canary_plan_kernels], ids=["twin", "launcher"]
)
OLD = -9


def outputs(vcap=16, wcap=4):
    vp = VerifyPlan.allocate(vcap, "cpu")
    wp = WritePlan.allocate(wcap, "cpu")
    for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
              vp.verify_prev_slot_indices, wp.write_offsets, wp.write_seed_slot_indices):
        t.fill_(OLD)
    vp.verify_num_valid.fill_(OLD)
    vp.enable.fill_(OLD)
    wp.write_num_valid_reqs.fill_(OLD)
    return vp, wp


def table(rows):
    """req_to_token int32: row i = given list (row 0 padding), padded with zeros to the width."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


def call(plan_op, vp, wp, rp, prefix, extend, r2t, *, dtype=torch.int64, W=0, lut=None, tokens=None,
         valid=None, offset=0):
    plan_op(
        verify_plan_out=vp, write_plan_out=wp,
        req_pool_indices=torch.tensor(rp, dtype=dtype), prefix_lens=torch.tensor(prefix, dtype=dtype),
        extend_seq_lens=torch.tensor(extend, dtype=dtype), req_to_token=r2t, swa_window_size=W,
        full_to_swa_index_mapping=None if lut is None else torch.tensor(lut, dtype=torch.int64),
        verify_capacity=vp.verify_slot_indices.shape[0],
        req_to_verify_expected_tokens=tokens,
        req_to_verify_expected_tokens_valid_lens=None if valid is None else torch.tensor(valid, dtype=dtype),
        kv_token_id_vs_position_offset=offset,
    )


def verify_entries(vp):
    n = int(vp.verify_num_valid[0])
    return list(zip(vp.verify_slot_indices[:n].tolist(), vp.verify_expected_tokens[:n].tolist(),
                    vp.verify_expected_positions[:n].tolist(), vp.verify_prev_slot_indices[:n].tolist()))


R2T = table([[0] * 8, [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28], [31, 32, 33, 34, 35, 36, 37, 38]])


@PLANS
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_prefill_and_decode_batch(plan_op, dtype):
    vp, wp = outputs(vcap=8, wcap=4)
    # row 2: prefill (no prefix); row 1: decode after 3 cached tokens; row 3: chunked prefill after 2
    call(plan_op, vp, wp, [2, 1, 3], [0, 3, 2], [4, 1, 3], R2T, dtype=dtype)
    assert verify_entries(vp) == [(11, -1, 0, -1), (12, -1, 1, 11), (13, -1, 2, 12), (31, -1, 0, -1), (32, -1, 1, 31)]
    assert int(vp.enable[0]) == 1
    assert vp.verify_slot_indices[5:].tolist() == [OLD] * 3  # past total: old values kept
    assert wp.write_offsets.tolist() == [0, 4, 5, 8, 0]
    assert wp.write_seed_slot_indices.tolist() == [-1, 13, 32, OLD]
    assert int(wp.write_num_valid_reqs[0]) == 3


@PLANS
def test_padding_rows_and_empty_extends(plan_op):
    vp, wp = outputs(vcap=8, wcap=4)
    # row 0 is padding (inactive, even with lengths); row 1 has no extend; row 2 negative extend
    call(plan_op, vp, wp, [0, 1, 2, 3], [2, 2, 1, 1], [5, 0, -3, 2], R2T)
    assert verify_entries(vp) == [(11, -1, 0, -1), (12, -1, 1, 11), (21, -1, 0, -1), (31, -1, 0, -1)]
    assert wp.write_offsets.tolist() == [0, 0, 0, 0, 2]
    assert wp.write_seed_slot_indices.tolist() == [-1, -1, -1, 31]
    assert int(wp.write_num_valid_reqs[0]) == 4


@PLANS
def test_empty_plan_enables_and_sets_zero(plan_op):
    vp, wp = outputs(vcap=4, wcap=2)
    call(plan_op, vp, wp, [1], [0], [3], R2T)
    assert int(vp.verify_num_valid[0]) == 0 and int(vp.enable[0]) == 1
    assert vp.verify_slot_indices.tolist() == [OLD] * 4
    assert wp.write_offsets.tolist() == [0, 3, 0]
    assert wp.write_seed_slot_indices.tolist() == [-1, OLD]


@PLANS
def test_empty_batch(plan_op):
    vp, wp = outputs(vcap=4, wcap=2)
    call(plan_op, vp, wp, [], [], [], R2T)
    assert int(vp.verify_num_valid[0]) == 0 and int(vp.enable[0]) == 1
    assert wp.write_offsets.tolist() == [0, 0, 0]
    assert wp.write_seed_slot_indices.tolist() == [OLD, OLD]
    assert int(wp.write_num_valid_reqs[0]) == 0


@PLANS
def test_verify_overflow_disables_and_leaves_arrays(plan_op):
    vp, wp = outputs(vcap=4, wcap=2)
    call(plan_op, vp, wp, [1, 2], [3, 2], [1, 1], R2T)
    assert int(vp.verify_num_valid[0]) == 4 and int(vp.enable[0]) == 0
    for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions, vp.verify_prev_slot_indices):
        assert t.tolist() == [OLD] * 4
    assert wp.write_offsets.tolist() == [0, 1, 2]
    assert wp.write_seed_slot_indices.tolist() == [13, 22]
    # exactly at capacity fits
    vp, wp = outputs(vcap=5, wcap=2)
    call(plan_op, vp, wp, [1, 2], [3, 2], [1, 1], R2T)
    assert int(vp.verify_num_valid[0]) == 5 and int(vp.enable[0]) == 1


@PLANS
def test_overflow_recovers_next_step(plan_op):
    vp, wp = outputs(vcap=2, wcap=2)
    call(plan_op, vp, wp, [1], [3], [1], R2T)
    assert int(vp.enable[0]) == 0
    call(plan_op, vp, wp, [1], [1], [1], R2T)
    assert int(vp.enable[0]) == 1 and verify_entries(vp) == [(11, -1, 0, -1)]


@PLANS
def test_write_capacity_truncates_offsets_and_seeds(plan_op):
    vp, wp = outputs(vcap=16, wcap=2)
    call(plan_op, vp, wp, [1, 2, 3], [1, 2, 3], [2, 3, 4], R2T)
    assert wp.write_offsets.tolist() == [0, 2, 5]  # last element is a start offset, not the total
    assert wp.write_seed_slot_indices.tolist() == [11, 22]
    assert int(wp.write_num_valid_reqs[0]) == 3
    assert int(vp.verify_num_valid[0]) == 6


@PLANS
def test_swa_window_with_lut(plan_op):
    lut = list(range(100, 140))  # full slot -> swa slot (+100)
    r2t = table([[0] * 8, [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]])
    vp, wp = outputs(vcap=8, wcap=2)
    call(plan_op, vp, wp, [1, 2], [5, 1], [1, 2], r2t, W=2, lut=lut)
    # window head links to its real predecessor (position 2), not -1
    assert verify_entries(vp) == [(104, -1, 3, 103), (105, -1, 4, 104), (109, -1, 0, -1)]
    assert wp.write_seed_slot_indices.tolist() == [105, 109]
    assert wp.write_offsets.tolist() == [0, 1, 3]


@PLANS
def test_window_larger_than_prefix(plan_op):
    vp, wp = outputs(vcap=8, wcap=1)
    call(plan_op, vp, wp, [1], [2], [1], R2T, W=10, lut=list(range(40)))
    assert verify_entries(vp) == [(11, -1, 0, -1), (12, -1, 1, 11)]


@PLANS
def test_lut_without_window_translates_and_negative_passes_through(plan_op):
    lut = [0] * 40
    for i in range(40):
        lut[i] = 1000 + i
    r2t = table([[0] * 4, [5, -1, 7, 8]])
    vp, wp = outputs(vcap=8, wcap=1)
    call(plan_op, vp, wp, [1], [4], [1], r2t, W=0, lut=lut)
    assert verify_entries(vp) == [(1005, -1, 0, -1), (-1, -1, 1, 1005), (1007, -1, 2, -1), (1008, -1, 3, 1007)]
    assert wp.write_seed_slot_indices.tolist() == [1008]


def test_twin_window_without_lut_does_not_translate():
    vp, wp = outputs(vcap=8, wcap=1)
    call(launch_canary_plan_kernels_torch_reference, vp, wp, [1], [5], [1], R2T, W=2)
    assert verify_entries(vp) == [(14, -1, 3, 13), (15, -1, 4, 14)]
    assert wp.write_seed_slot_indices.tolist() == [15]


@PLANS
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_expected_tokens_with_offset_and_valid_lens(plan_op, dtype):
    tok = torch.tensor([[0] * 6, [100, 101, -102, 103, 104, 105], [200, 201, 202, 203, 204, 205]], dtype=torch.int32)
    vp, wp = outputs(vcap=16, wcap=2)
    # valid lengths are indexed by batch row r (row 0 -> request row 2, row 1 -> request row 1)
    call(plan_op, vp, wp, [2, 1], [3, 4], [1, 1], R2T, tokens=tok, valid=[2, 4], offset=1, dtype=dtype)
    assert [e[1] for e in verify_entries(vp)] == [201, -1, -1, 101, -102, 103, -1]
    call(plan_op, vp, wp, [2, 1], [3, 4], [1, 1], R2T, tokens=tok, valid=[6, 6], offset=-1, dtype=dtype)
    assert [e[1] for e in verify_entries(vp)] == [-1, 200, 201, -1, 100, 101, -102]
    call(plan_op, vp, wp, [2, 1], [3, 4], [1, 1], R2T, tokens=tok, valid=[0, 3], offset=0, dtype=dtype)
    assert [e[1] for e in verify_entries(vp)] == [-1, -1, -1, 100, 101, -102, -1]


@PLANS
def test_inputs_never_modified(plan_op):
    r2t = R2T.clone()
    tok = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    rp, pre, ext, val = torch.tensor([1, 3]), torch.tensor([2, 3]), torch.tensor([1, 2]), torch.tensor([5, 5])
    lut = torch.arange(40, dtype=torch.int64)
    before = [t.clone() for t in (r2t, tok, rp, pre, ext, val, lut)]
    vp, wp = outputs()
    plan_op(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=rp, prefix_lens=pre, extend_seq_lens=ext,
            req_to_token=r2t, swa_window_size=2, full_to_swa_index_mapping=lut, verify_capacity=16,
            req_to_verify_expected_tokens=tok, req_to_verify_expected_tokens_valid_lens=val,
            kv_token_id_vs_position_offset=0)
    for a, b in zip((r2t, tok, rp, pre, ext, val, lut), before):
        assert torch.equal(a, b)
    assert verify_entries(vp) == [(11, 6, 0, -1), (12, 7, 1, 11), (32, 19, 1, 31), (33, 20, 2, 32)]


@PLANS
def test_plan_outputs_as_views(plan_op):
    big = torch.full((5, 20), OLD, dtype=torch.int64)
    small = torch.full((6,), OLD, dtype=torch.int32)
    vp = VerifyPlan(verify_slot_indices=big[0, 2:10], verify_expected_tokens=big[1, 2:10],
                    verify_expected_positions=big[2, 2:10], verify_prev_slot_indices=big[3, 2:10],
                    verify_num_valid=small[0:1], enable=small[2:3])
    wp = WritePlan(write_offsets=big[4, 0:3], write_seed_slot_indices=big[4, 10:12], write_num_valid_reqs=small[4:5])
    before = big.clone()
    call(plan_op, vp, wp, [1], [2], [3], R2T)
    assert big[0, :4].tolist() == [OLD, OLD, 11, 12] and big[0, 4:].eq(OLD).all()
    assert big[3, 2:4].tolist() == [-1, 11]
    assert big[4, :3].tolist() == [0, 3, 0] and big[4, 10:12].tolist() == [12, OLD]
    assert small.tolist() == [2, OLD, 1, OLD, 1, OLD]
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[0:4, 2:4] = False
    mask[4, 0:3] = False
    mask[4, 10] = False
    assert torch.equal(big[mask], before[mask])
