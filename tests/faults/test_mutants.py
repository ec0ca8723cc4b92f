"""Tests aimed at the five runtime mutants an outside mutation audit found surviving (issue 11 item 7):
HEAD verify-token off, write-input assert off, attribution off by one at a request boundary, the
sweep's chain-link check off (the fifth, the transformers adapter's live-slot set dropping idle cached
blocks, is killed in tests/engines/test_transformers_sweep_live.py). Each was checked by hand against its
mutant applied to a copy of src/ (docs/mutation.md)."""
import dataclasses

import torch

from kvcanary.ops import CanaryLaunchTag, FailReason
from kvcanary.ops.constants import CANARY_FIELD_PREV_HASH
from kvcanary.faults.sim_campaign import SimCampaignConfig, SimDriver
from kvcanary.faults.sim import unique_cached_positions


def _driver(seed):
    d = SimDriver(SimCampaignConfig(seed=seed), seed, swa=False)
    for _ in range(16):
        d.step()
    assert d.canary.violations() == []
    return d


def test_head_verify_token_catches_a_history_only_mismatch():
    d = _driver(11)
    req, p = unique_cached_positions(d.engine)[0]
    old = int(d.engine.table.tokens[req.row, p])
    d.engine.table.tokens[req.row, p] = old % 31999 + 1  # the history now disagrees with the stored token

    d.step()
    head = [v for v in d.canary.violations() if v.launch_tag == CanaryLaunchTag.HEAD_K_FULL]
    assert head and head[0].reasons == FailReason.VERIFY_TOKEN_MISMATCH
    assert head[0].request_id == req.rid and head[0].stored_position == p and head[0].stored_token == old


def test_write_input_assert_catches_a_wrong_input_token_without_an_oracle():
    d = _driver(12)
    d.engine.batch_hooks.remove(d.engine.batch_hooks[-1])  # drop the oracle: the token history is the reference
    req = next(r for r in d.engine.running if r.generated >= 1 and r.max_new - r.generated >= 2)

    def hook(batch):
        r = batch.request_ids.index(req.rid)
        start = int(batch.extend_lens[:r].sum())
        ids = batch.input_ids.clone()
        ids[start] = ids[start] % 31999 + 1
        return dataclasses.replace(batch, input_ids=ids)

    d.engine.batch_hooks.insert(0, hook)
    d.step()
    writes = [v for v in d.canary.violations() if v.op == "write"]
    assert writes and writes[0].reasons & FailReason.WRITE_TOKEN_MISMATCH and writes[0].request_id == req.rid


def test_attribution_at_request_boundaries():
    """A redirect at the first cached position of a later batch row, and at the last cached position of
    the row before it: each violation is charged to its own request."""
    d = _driver(13)
    e = d.engine
    rows = [r for r in e.running if r.num_computed >= 6 and r.max_new - r.generated >= 2][:3]
    assert len(rows) == 3
    a, b, spare = rows
    target_b = spare.full_slots[2]
    target_a = spare.full_slots[3]
    last_a = a.num_computed - 1
    old_b, old_a = int(e.table.req_to_token[b.row, 0]), int(e.table.req_to_token[a.row, last_a])
    e.table.req_to_token[b.row, 0] = target_b
    e.table.req_to_token[a.row, last_a] = target_a
    d.step()
    e.table.req_to_token[b.row, 0], e.table.req_to_token[a.row, last_a] = old_b, old_a
    vs = [v for v in d.canary.violations() if v.launch_tag == CanaryLaunchTag.HEAD_K_FULL]
    on_b = [v for v in vs if v.slot == target_b and v.expected_position == 0]
    on_a = [v for v in vs if v.slot == target_a and v.stored_position == 3]
    assert on_b and all(v.request_id == b.rid and v.request_row == b.row for v in on_b)
    assert on_a and all(v.request_id == a.rid and v.request_row == a.row for v in on_a)


def test_sweep_chain_link_catches_a_broken_link(manual):
    eng = manual(sweep_interval=0)
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6, 7, 8], slots=[10, 11, 12, 13]))
    assert eng.canary.violations() == []
    g = eng.canary.groups["full"]
    for side in g.tail_sides:  # the sweep reads the TAIL records: break slot 11's stored link
        g.buffer("tail", side).view(torch.int64)[11, CANARY_FIELD_PREV_HASH] ^= 1
    eng.canary.sweep(live={"full": torch.tensor([10, 11, 12, 13])})
    vs = eng.canary.violations()
    assert vs and all(v.phase == "sweep" for v in vs)
    assert any(v.slot == 11 and v.reasons & FailReason.VERIFY_CHAIN_HASH_MISMATCH for v in vs)
