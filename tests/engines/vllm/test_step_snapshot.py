"""`StepSnapshot`: a forward's device inputs copied in bind, so the adapter checks the forward after vLLM launched it
(``check_after_forward``): what the engine's buffers hold afterwards does not change what is checked."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kvcanary.engines.vllm.forward_view import WorkerView, v2_step
from kvcanary.engines.vllm.layout import FULL, GroupLayout
from kvcanary.engines.vllm.step_snapshot import StepSnapshot

from .vllm_support import head_filled

LAYER = "model.layers.0.self_attn.attn"
LAYOUT = GroupLayout(name=FULL, index=0, layer_names=(LAYER,), layer_ids=(0,), block_size=4, manager_block_size=4,
                     num_blocks=16, sliding_window=0)


def _engine_step(bt: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, seq_lens=None):
    """A V2 runner's forward over the engine's own (persistent) buffers: rows a (5 cached + 1 new), b (3-token prefill)."""
    batch = SimpleNamespace(num_reqs=2, req_ids=["a", "b"], num_scheduled_tokens=np.array([1, 3], dtype=np.int32),
                            num_computed_tokens_np=np.array([5, 0], dtype=np.int32), input_ids=ids, positions=pos,
                            seq_lens=seq_lens)
    return v2_step(batch, {LAYER: SimpleNamespace(block_table=bt[:2], slot_mapping=slots)}, graph_mode="FULL")


def _buffers():
    bt = torch.zeros(4, 8, dtype=torch.int32)
    bt[0, :2] = torch.tensor([3, 7])
    bt[1, :1] = torch.tensor([9])
    slots = torch.tensor([29, 36, 37, 38, -1, -1], dtype=torch.int64)
    ids = torch.tensor([105, 200, 201, 202, 0, 0], dtype=torch.int32)
    pos = torch.tensor([5, 0, 1, 2, 0, 0], dtype=torch.int64)
    return bt, slots, ids, pos


def _view() -> WorkerView:
    view = WorkerView(runner=None, layouts=[LAYOUT], max_requests=4, max_context=32, device=torch.device("cpu"))
    view.apply(tokens={"a": (0, list(range(100, 106))), "b": (0, list(range(200, 203)))}, finished=(), preempted=())
    return view


def test_the_forward_checked_is_the_one_bound_whatever_the_buffers_hold_afterwards():
    bt, slots, ids, pos = _buffers()
    seq_lens = torch.tensor([6, 3, 0, 0], dtype=torch.int32)
    snap = StepSnapshot([LAYOUT], min_rows=5).take(_engine_step(bt, slots, ids, pos, seq_lens), num_tokens=4)
    # after the forward: the injector restores an entry, a drafter rewrites the slot mapping, the next step's inputs land
    bt[0, 1] = 11
    slots.fill_(3)
    ids.fill_(7)
    pos.fill_(9)
    seq_lens.fill_(1)
    assert snap.attn_metadata[LAYER].block_table[:2].tolist() == [[3, 7, 0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0, 0]]
    assert snap.seq_lens.tolist() == [6, 3] and snap.graph_mode == "FULL" and snap.req_ids == ("a", "b")
    desc = head_filled(_view().describe(snap))
    ra, rb = desc.req_pool_indices.tolist()
    table = desc.groups[FULL].req_to_token
    assert table[ra, :6].tolist() == [12, 13, 14, 15, 28, 29] and table[rb, :3].tolist() == [36, 37, 38]
    assert desc.input_ids.tolist() == [105, 200, 201, 202] and desc.positions.tolist() == [5, 0, 1, 2]
    assert desc.groups[FULL].out_cache_loc.tolist() == [29, 36, 37, 38]


def test_same_description_as_from_the_engines_buffers():
    bt, slots, ids, pos = _buffers()
    step = _engine_step(bt, slots, ids, pos)
    direct = head_filled(_view().describe(step))
    snapped = head_filled(_view().describe(StepSnapshot([LAYOUT], min_rows=5).take(step, num_tokens=4)))
    for field in ("req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "token_table_lens"):
        assert torch.equal(getattr(direct, field), getattr(snapped, field)), field
    assert torch.equal(direct.groups[FULL].req_to_token, snapped.groups[FULL].req_to_token)
    assert torch.equal(direct.groups[FULL].out_cache_loc, snapped.groups[FULL].out_cache_loc)


def test_block_table_keeps_its_address_up_to_min_rows_and_grows_past_them():
    bt, slots, ids, pos = _buffers()
    snapshot = StepSnapshot([LAYOUT], min_rows=3)
    first = snapshot.take(_engine_step(bt, slots, ids, pos), num_tokens=4).attn_metadata[LAYER].block_table
    again = snapshot.take(_engine_step(bt, slots, ids, pos), num_tokens=2).attn_metadata[LAYER].block_table
    assert first.data_ptr() == again.data_ptr() and first.untyped_storage().nbytes() == 3 * 8 * 4
    view = _view()
    assert view._held_block_table(LAYOUT, first) is view._held_block_table(LAYOUT, again)  # one BlockTable for HEAD
    wide = torch.zeros(5, 8, dtype=torch.int32)
    meta = {LAYER: SimpleNamespace(block_table=wide, slot_mapping=slots)}
    many = SimpleNamespace(num_reqs=5, req_ids=list("abcde"), num_scheduled_tokens=np.ones(5, dtype=np.int32),
                           num_computed_tokens_np=np.zeros(5, dtype=np.int32), input_ids=ids, positions=pos)
    grown = snapshot.take(v2_step(many, meta), num_tokens=5).attn_metadata[LAYER].block_table
    assert grown.shape == (5, 8) and grown.data_ptr() != first.data_ptr()
