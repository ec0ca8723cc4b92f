"""`WorkerView` pieces that span KV cache groups, without an engine: which prefix positions a row shares with another
row of the same forward (a sliding-window group does not count the positions behind its window), and the
``slots_reused`` count over several full-attention groups (one block pool)."""
from __future__ import annotations

import torch

from kvcanary.engines.vllm.forward_view import WorkerView
from kvcanary.engines.vllm.layout import GroupLayout

NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
B = 4  # tokens per block


def _layouts():
    full = GroupLayout(name="full", index=0, layer_names=NAMES[:1], layer_ids=(0,), block_size=B, manager_block_size=B,
                       num_blocks=40, sliding_window=0)
    full1 = GroupLayout(name="full.1", index=1, layer_names=NAMES[2:], layer_ids=(2,), block_size=B,
                        manager_block_size=B, num_blocks=40, sliding_window=0)
    swa = GroupLayout(name="swa", index=2, layer_names=NAMES[1:2], layer_ids=(1,), block_size=B, manager_block_size=B,
                      num_blocks=40, sliding_window=6, window_left=5)
    return full, full1, swa


def _view():
    return WorkerView(runner=None, layouts=list(_layouts()), max_requests=8, max_context=32,
                      device=torch.device("cpu"))


def test_same_step_share_ignores_positions_behind_a_sliding_window():
    """Rows 1 and 2 have the same 12-token prompt; row 1 computes it, row 2 hits all 12 positions in the same forward
    (vLLM caches a block when it is scheduled). In the sliding-window group vLLM hands row 2 a null block for what the
    window no longer reads (positions < 12 - 5: block 0): those positions still count as shared, so the whole prefix
    is claimed. Without the window rule only positions >= 4 would be, and 0..3 — written by row 1 in this very
    forward — would stay in the verified prefix (false violations before the records exist)."""
    view = _view()
    full, full1, swa = _layouts()
    blocks = {full: [1, 2, 3], full1: [4, 5, 6], swa: [7, 8, 9]}
    positions = torch.arange(12)
    written = {}
    for g, ids in blocks.items():
        slots = torch.tensor([ids[p // B] * B + p % B for p in range(12)])
        written[g.name] = slots
        view.req_to_token[g.name][1, :12] = slots.to(torch.int32)
        row2 = slots.clone()
        if g is swa:
            row2[:B] = 0  # a null block (dropped to padding): behind the window
        view.req_to_token[g.name][2, :12] = row2.to(torch.int32)
    shared = view._same_step_shares([1, 2], [0, 12], [1], written, positions)
    assert shared == [0, 12]
    view.req_to_token["full.1"][2, 5] = 0  # a full group's position not written by this forward: not shared
    assert view._same_step_shares([1, 2], [0, 12], [1], written, positions) == [0, 6]
    view.req_to_token["full.1"][2, 5] = written["full.1"][5]
    view.req_to_token["swa"][2, 9] = 0  # inside the window: the sliding group must see it written too
    assert view._same_step_shares([1, 2], [0, 12], [1], written, positions) == [0, 2]


def test_slots_reused_counts_over_every_full_group():
    """A block freed by one full group and handed to the other (one block pool) is reused memory; the sliding-window
    group's writes are not counted (as before the split)."""
    view = _view()
    from kvcanary.ops.paged import launch_mark_written_slots_kernel  # noqa: F401 — the kernel `_tables` launches

    def mark(group_slots):
        for name in view._full_groups:
            launch_mark_written_slots_kernel(slots=group_slots.get(name, torch.zeros(0, dtype=torch.int64)),
                                             ever_written=view._ever_written, rewritten=view._reused)

    assert view._full_groups == ["full", "full.1"]
    mark({"full": torch.arange(8, 12), "full.1": torch.arange(12, 16)})
    assert view.slots_reused() == 0
    mark({"full.1": torch.arange(8, 12)})  # full's block 2 now belongs to full.1
    assert view.slots_reused() == 4


def test_same_step_share_followed_by_blocks_cached_earlier_claims_the_rest_of_the_prefix():
    """Row 2 hits 12 positions: block 0 is the block row 1 computes in this forward (the earlier copy was evicted, so
    row 1 found no hit and recomputes it), blocks 1-2 were cached by an earlier request and are not written now. The
    claim runs from position 0 to the end of the prefix (a trailing-only claim would leave 0..3 in the verified
    prefix, read before row 1's records exist). A padding slot the row reads after that point stops it: then only the
    trailing run written here is claimed, as before."""
    view = _view()
    full, full1, swa = _layouts()
    positions = torch.arange(12)
    written, old = {}, {full: [11, 12], full1: [13, 14], swa: [15, 16]}
    for g, ids in {full: [1, 2, 3], full1: [4, 5, 6], swa: [7, 8, 9]}.items():
        slots = torch.tensor([ids[p // B] * B + p % B for p in range(12)])
        written[g.name] = slots
        view.req_to_token[g.name][1, :12] = slots.to(torch.int32)
        row2 = torch.tensor([([ids[0]] + old[g])[p // B] * B + p % B for p in range(12)])
        if g is swa:
            row2[:B] = 0  # behind the window (12 - 5): a null block
        view.req_to_token[g.name][2, :12] = row2.to(torch.int32)
    assert view._same_step_shares([1, 2], [0, 12], [1], written, positions) == [0, 12]
    view.req_to_token["full"][2, 9] = 0  # the padding slot inside what the row reads: nothing trailing is written here
    assert view._same_step_shares([1, 2], [0, 12], [1], written, positions) == [0, 0]
