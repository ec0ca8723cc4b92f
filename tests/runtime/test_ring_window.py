"""A ring sliding-window group (`GroupSpec.ring_window`): a chunk's writes overwrite the ring slots of the
positions leaving the window, which its first queries read. HEAD verifies them; TAIL skips exactly them.

A hand-driven engine: window W = 4, each request a ring of 4 slots (position p in slot base + 1 + p % 4).
"""
from __future__ import annotations

import pytest
import torch

from kvcanary.engines.sim.engine import kv_bytes
from kvcanary.errors import KvCanaryValueError
from kvcanary.ops.constants import CanaryLaunchTag
from kvcanary.runtime import BatchDescription, GroupBatch, GroupSpec
from tests.runtime.conftest import make_canary

W, ROW, STALE = 4, 1, 9


def ring(p: int, base: int = 0) -> int:
    return base + 1 + p % W


class RingEngine:
    def __init__(self, *, ring_window: bool) -> None:
        spec = GroupSpec(name="swa", num_slots=16, sliding_window=W, layer_ids=(0,), ring_window=ring_window)
        self.canary = make_canary([spec], max_requests=4, max_context=32)
        self.table = torch.zeros(4, 32, dtype=torch.int32)
        self.tokens = torch.zeros(4, 32, dtype=torch.int32)
        self.kv = {0: (torch.zeros(16, 32, dtype=torch.uint8), torch.zeros(16, 32, dtype=torch.uint8))}
        self.canary.set_kv_cache("swa", self.kv)

    def forward(self, prefix: int, tokens: list[int], *, row: int = ROW, rid: str = "req", base: int = 0) -> None:
        """The chunk ``[prefix, prefix + len(tokens))`` (at most W tokens): reads ``[prefix - W + 1, prefix)``
        (the table), then stores its tokens into their ring slots."""
        n = len(tokens)
        slots = [ring(p, base) for p in range(prefix, prefix + n)]
        self.tokens[row, prefix : prefix + n] = torch.tensor(tokens, dtype=torch.int32)
        batch = BatchDescription(
            req_pool_indices=torch.tensor([row]), prefix_lens=torch.tensor([prefix]), extend_lens=torch.tensor([n]),
            input_ids=torch.tensor(tokens), positions=torch.arange(prefix, prefix + n),
            groups={"swa": GroupBatch(req_to_token=self.table, out_cache_loc=torch.tensor(slots))},
            request_ids=(rid,), token_table=self.tokens, token_table_lens=torch.tensor([prefix + n]),
        )
        with self.canary.forward(batch):
            loc = torch.tensor(slots)
            for side, t in enumerate(self.kv[0]):
                t[loc] = kv_bytes(batch.input_ids, batch.positions, 0, side, 32)
        self.table[row, prefix : prefix + n] = torch.tensor(slots, dtype=torch.int32)
        if prefix + n - W >= 0:
            self.table[row, : prefix + n - W + 1] = 0  # left the window (the next plan's P - W is padding)

    def violations(self):
        self.canary.close()
        return self.canary.violations()


def run(engine: RingEngine) -> None:
    engine.forward(0, [11, 12, 13, 14])  # prefill: positions 0..3 in slots 1..4
    engine.forward(4, [15, 16, 17])  # reads 1..3; overwrites the slots of 0, 1, 2 (positions 4, 5, 6)
    engine.forward(7, [18])  # decode


def test_ring_chunk_is_silent_with_ring_window():
    engine = RingEngine(ring_window=True)
    run(engine)
    assert engine.violations() == []


def test_without_ring_window_tail_reports_exactly_the_recycled_positions():
    engine = RingEngine(ring_window=False)
    run(engine)
    found = engine.violations()
    # without ring_window the group claims its window reads [P - W, P): the position P - W this engine maps to the
    # padding slot (forwards 2 and 3) is a live read through it (docs/design.md §3.12)
    holes = [v for v in found if v.reason_label == "verify_padding_slot_read"]
    assert [(v.launch_tag, v.step, v.stored_position) for v in holes] == [
        (CanaryLaunchTag.HEAD_K_SWA, 2, 0), (CanaryLaunchTag.HEAD_K_SWA, 3, 3)]
    found = [v for v in found if v not in holes]
    assert {v.launch_tag for v in found} == {CanaryLaunchTag.TAIL_K_SWA, CanaryLaunchTag.TAIL_V_SWA}
    assert {v.reason_label for v in found} == {"verify_real_kv_hash"}
    # forward 2 (P=4, E=3) recycles positions [P - W, P + E - W) = [0, 3); position 0 is not read
    assert sorted({(v.step, v.stored_position) for v in found}) == [(2, 1), (2, 2)]


def test_a_stale_read_of_a_recycled_position_is_caught_at_head():
    engine = RingEngine(ring_window=True)
    engine.forward(0, [21, 22, 23, 24], row=2, rid="old", base=STALE - 1)  # earlier KV: slot 9 holds position 0
    engine.forward(0, [11, 12, 13, 14])
    engine.table[ROW, 2] = STALE  # the chunk reads position 2 (leaving the window) from a stale slot
    engine.forward(4, [15, 16, 17])
    found = engine.violations()
    assert found and all(v.step == 3 and v.request_id == "req" for v in found)
    # the stale slot (position 2 leaves the window during the chunk): HEAD only, every structural check
    assert [(v.launch_tag, v.slot, v.expected_position, v.reason_label) for v in found if v.slot == STALE] == [
        (CanaryLaunchTag.HEAD_K_SWA, STALE, 2, "verify_chain_hash+verify_position+verify_token")]
    # position 3 chains from the stale slot and stays in the window: HEAD and both TAIL sides still check it
    assert sorted((v.launch_tag, v.expected_position, v.reason_label) for v in found if v.slot != STALE) == [
        (CanaryLaunchTag.HEAD_K_SWA, 3, "verify_chain_hash"), (CanaryLaunchTag.TAIL_K_SWA, 3, "verify_chain_hash"),
        (CanaryLaunchTag.TAIL_V_SWA, 3, "verify_chain_hash")]


def test_ring_window_needs_a_sliding_window():
    with pytest.raises(KvCanaryValueError, match="ring_window needs a sliding window"):
        GroupSpec(name="full", num_slots=16, ring_window=True)
