"""HEAD's position -> slot tables from an engine's block table (`BlockTable`, docs/design.md §3.10) and its written-slot
marks (`RewriteCounter`): random forwards (prefills, decodes, finished requests whose blocks go to new ones, a
redirected block-table entry in half the seeds) give the same violations as the same forwards whose adapter fills
``req_to_token`` itself, the tables HEAD writes equal the op's, and the counter counts every slot written again."""
from __future__ import annotations

import random

import pytest
import torch

from kvcanary.engines.sim.engine import kv_bytes
from kvcanary.errors import KvCanaryValueError
from kvcanary.ops import launch_block_table_slots_kernel
from kvcanary.runtime import BatchDescription, BlockTable, GroupBatch, GroupSpec, RewriteCounter

from tests.runtime.conftest import make_canary

BLOCK, BLOCKS, ROWS, CTX = 4, 24, 6, 48


class _Engine:
    """One full-attention group, two layers; ``paged``: HEAD fills the table from the block table."""

    def __init__(self, paged: bool) -> None:
        self.paged = paged
        self.canary = make_canary([GroupSpec(name="full", num_slots=BLOCKS * BLOCK, layer_ids=(0, 1))],
                                  max_requests=ROWS, max_context=CTX)
        self.table = torch.zeros(ROWS, CTX, dtype=torch.int32)
        self.tokens = torch.zeros(ROWS, CTX, dtype=torch.int32)
        self.kv = {layer: tuple(torch.zeros(BLOCKS * BLOCK, 32, dtype=torch.uint8) for _ in range(2)) for layer in (0, 1)}
        self.canary.set_kv_cache("full", self.kv)
        self.rewrites = RewriteCounter(ever_written=torch.zeros(BLOCKS * BLOCK, dtype=torch.uint8),
                                       rewritten=torch.zeros(1, dtype=torch.int64))
        self.block_table = torch.zeros(ROWS, CTX // BLOCK, dtype=torch.int32)  # vLLM-like: batch row r, persistent

    def forward(self, rows, prefix, new_tokens, rids, bt) -> None:
        """``bt``: int32 [len(rows), nblk], the block table attention reads this forward (batch row order)."""
        seq = [p + len(t) for p, t in zip(prefix, new_tokens)]
        slots = [int(bt[i, q // BLOCK]) * BLOCK + q % BLOCK for i, (p, t) in enumerate(zip(prefix, new_tokens))
                 for q in range(p, p + len(t))]
        for row, p, t in zip(rows, prefix, new_tokens):
            self.tokens[row, p : p + len(t)] = torch.tensor(t, dtype=torch.int32)
        self.block_table.zero_()
        self.block_table[: len(rows)] = bt
        if self.paged:
            group = GroupBatch(req_to_token=self.table, out_cache_loc=torch.tensor(slots),
                               block_table=BlockTable(table=self.block_table, block_size=BLOCK),
                               rewrites=self.rewrites)
        else:
            launch_block_table_slots_kernel(block_table=bt, rows=torch.tensor(rows), seq_lens=torch.tensor(seq),
                                            block_size=BLOCK, width=max(seq), table_out=self.table)
            group = GroupBatch(req_to_token=self.table, out_cache_loc=torch.tensor(slots))
        ids = [x for t in new_tokens for x in t]
        batch = BatchDescription(
            req_pool_indices=torch.tensor(rows), prefix_lens=torch.tensor(prefix),
            extend_lens=torch.tensor([len(t) for t in new_tokens]), input_ids=torch.tensor(ids),
            positions=torch.tensor([q for p, t in zip(prefix, new_tokens) for q in range(p, p + len(t))]),
            groups={"full": group}, request_ids=tuple(rids), token_table=self.tokens,
            token_table_lens=torch.tensor(seq),
        )
        with self.canary.forward(batch):
            loc = torch.tensor(slots)
            for layer, (k, v) in self.kv.items():
                for side, t in enumerate((k, v)):
                    t[loc] = kv_bytes(batch.input_ids, batch.positions, layer, side, 32)

    def found(self) -> list[tuple]:
        return sorted((v.step, v.request_id, int(v.reasons), v.launch_tag, v.slot, v.stored_position, v.expected_position)
                      for v in self.canary.violations())


def _workload(seed: int, engines: list[_Engine]) -> tuple[int, bool]:
    """Random forwards on every engine alike; returns the slots written again (host count) and whether a block-table
    entry was redirected."""
    rng = random.Random(seed)
    free = list(range(1, BLOCKS))
    rng.shuffle(free)
    live: dict[str, dict] = {}
    written: set[int] = set()
    again = 0
    fault, redirected = seed % 2 == 1, False
    for step in range(14):
        for rid in [r for r in live if rng.random() < 0.2]:  # finished: its blocks go back to the pool
            free.extend(live.pop(rid)["blocks"])
        used_rows = {s["row"] for s in live.values()}
        if len(live) < 3 and rng.random() < 0.7:
            row = min(set(range(1, ROWS)) - used_rows)
            live[f"r{step}"] = dict(row=row, seq=0, blocks=[], todo=rng.randint(3, 12))
        if not live:
            continue
        rows, prefix, toks, rids, bts = [], [], [], [], []
        for rid, s in live.items():
            n = s.pop("todo", 1)
            while len(s["blocks"]) * BLOCK < s["seq"] + n:
                s["blocks"].append(free.pop())
            rows.append(s["row"])
            prefix.append(s["seq"])
            toks.append([rng.randint(1, 900) for _ in range(n)])
            rids.append(rid)
            bts.append(s["blocks"] + [0] * (CTX // BLOCK - len(s["blocks"])))
            for q in range(s["seq"], s["seq"] + n):
                slot = s["blocks"][q // BLOCK] * BLOCK + q % BLOCK
                again += slot in written
                written.add(slot)
            s["seq"] += n
        bt = torch.tensor(bts, dtype=torch.int32)
        if fault and step == 9 and prefix[0] >= BLOCK:  # attention reads another block for the first row's block 0
            bt[0, 0] = free[0]
            redirected = True
        for e in engines:
            e.forward(rows, prefix, toks, rids, bt)
    return again, redirected


@pytest.mark.parametrize("seed", range(6))
def test_block_table_batches_check_as_adapter_filled_tables_do(seed):
    paged, filled = _Engine(paged=True), _Engine(paged=False)
    again, redirected = _workload(seed, [paged, filled])
    assert paged.found() == filled.found()
    assert bool(paged.found()) == redirected
    assert int(paged.rewrites.rewritten[0]) == again
    live = paged.canary.static.inputs["full"]
    assert live.block_table is not None and live.req_to_token is paged.table


def test_head_writes_to_each_rows_length_only():
    e = _Engine(paged=True)
    e.table.fill_(-7)
    e.forward([2], [0], [[5, 6, 7, 8, 9]], ["a"], torch.tensor([[3, 5] + [0] * 10], dtype=torch.int32))
    assert e.table[2, :5].tolist() == [12, 13, 14, 15, 20] and e.table[2, 5:].tolist() == [-7] * (CTX - 5)
    assert e.table[0].tolist() == [-7] * CTX  # no row of the batch: untouched
    # a padded batch: the padding row (request row 0) claims a prefix but is never filled
    e.forward([2, 0], [5, 5], [[10], []], ["a", None], torch.tensor([[3, 5] + [0] * 10, [9] * 12], dtype=torch.int32))
    assert e.table[2, :6].tolist() == [12, 13, 14, 15, 20, 21] and e.table[0].tolist() == [-7] * CTX


def test_a_block_table_needs_an_int32_table():
    canary = make_canary([GroupSpec(name="full", num_slots=64)], max_requests=4, max_context=16)
    bt = BlockTable(table=torch.zeros(4, 4, dtype=torch.int32), block_size=4)
    batch = BatchDescription(
        req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([0]), extend_lens=torch.tensor([1]),
        input_ids=torch.tensor([3]), positions=torch.tensor([0]),
        groups={"full": GroupBatch(req_to_token=torch.zeros(4, 16, dtype=torch.int64), out_cache_loc=torch.tensor([4]),
                                   block_table=bt)},
        request_ids=("a",),
    )
    with pytest.raises(KvCanaryValueError, match="kv-canary: group 'full' has a block_table, so its req_to_token"):
        canary.static.stage(batch)
    with pytest.raises(KvCanaryValueError, match="kv-canary: BlockTable.block_size must be a positive int"):
        BlockTable(table=torch.zeros(2, 2, dtype=torch.int32), block_size=0)
