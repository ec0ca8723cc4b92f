"""No live read through the padding slot (docs/design.md §3.12), end to end through `Canary.before_forward` /
`after_forward`: a live request whose prefix position maps to slot 0 is one ``verify_padding_slot_read`` violation
naming that request (latency 0: the forward that reads it); padding rows, positions behind a sliding window and the
clean twin stay silent; the config switch turns the check off; the Triton launchers (interpreter) agree."""
from __future__ import annotations

import os

import pytest
import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.ops import FailReason
from kvcanary.runtime import BatchDescription, CanaryConfig, GroupBatch, GroupSpec

from tests.runtime.conftest import ManualEngine, make_canary

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PADDING_READ = FailReason.VERIFY_PADDING_SLOT_READ


def _prefill_two(engine: ManualEngine) -> None:
    """Request rows 1 and 2 hold 6 positions each (slots 10..15 and 20..25)."""
    engine.forward(engine.batch(1, 0, [11, 12, 13, 14, 15, 16], list(range(10, 16)), rid="a"))
    engine.forward(engine.batch(2, 0, [21, 22, 23, 24, 25, 26], list(range(20, 26)), rid="b"))


def _decode(engine: ManualEngine, rows=(0, 1, 2), slots=(0, 16, 26), at: int = 6) -> BatchDescription:
    """One decode step at position ``at`` of the live rows; a padding row 0 (a padded batch) claims the same prefix
    and computes nothing."""
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    live = [(r, s) for r, s in zip(rows, slots) if r]
    ids = [at + 1 + 10 * r for r, _ in live]
    for (r, s), tok in zip(live, ids):
        engine.table[r, at] = s
        engine.tokens[r, at] = tok
    return BatchDescription(
        req_pool_indices=t(list(rows)), prefix_lens=t([at] * len(rows)), extend_lens=t([1 if r else 0 for r in rows]),
        input_ids=t(ids), positions=t([at] * len(ids)),
        groups={"full": GroupBatch(req_to_token=engine.table, out_cache_loc=t([s for _, s in live]))},
        request_ids=tuple(None if r == 0 else "ab"[r - 1] for r in rows), token_table=engine.tokens,
        token_table_lens=t([at + 1 if r else 0 for r in rows]), forward_kind="decode",
    )


def _step(engine: ManualEngine, batch: BatchDescription) -> None:
    engine.canary.before_forward(batch)
    engine.store(batch)
    engine.canary.after_forward()


def test_hole_in_a_live_prefix_is_one_violation_naming_the_request(manual):
    engine = manual()
    _prefill_two(engine)
    engine.table[2, 3] = 0  # request b's position 3 now resolves to the padding slot
    engine.table[0, :] = 0  # the padding row's table is all padding: never read
    step = engine.canary.step + 1
    _step(engine, _decode(engine))
    found = engine.canary.violations()
    assert len(found) == 1, [v.log_line() for v in found]
    v = found[0]
    assert v.reasons == PADDING_READ and v.reason_label == "verify_padding_slot_read"
    assert (v.request_id, v.request_row, v.step) == ("b", 2, step)  # latency 0, the reading request
    assert (v.launch_tag.name, v.group, v.op, v.slot) == ("HEAD_K_FULL", "full", "verify", 0)
    assert (v.stored_position, v.expected_position, v.expected_slot) == (3, 3, 0)
    assert v.forward_kind == "decode"
    counters = engine.canary.counters()
    assert counters["by_reason"] == {"verify_padding_slot_read": 1} and counters["by_tag"] == {"HEAD_K_FULL": 1}
    assert "fail_reason=verify_padding_slot_read" in v.log_line() and "request_id=b" in v.log_line()
    assert "resolves to the padding slot" in v.readable() and "padding / null slot" in v.readable()


def test_clean_twin_and_padding_rows_are_silent(manual):
    engine = manual()
    _prefill_two(engine)
    engine.table[0, :] = 0  # the padding row claims a prefix of 6 over an all-padding table row
    _step(engine, _decode(engine))
    _step(engine, _decode(engine, rows=(2, 0, 1), slots=(27, 0, 17), at=7))
    assert engine.canary.violations() == [] and engine.canary.counters()["total"] == 0


def test_the_switch_turns_the_check_off(manual):
    engine = manual(padding_read_check=False)
    _prefill_two(engine)
    engine.table[1, 2] = 0
    _step(engine, _decode(engine))
    assert engine.canary.counters()["total"] == 0  # the verify skips slot 0, as SGLang's op does
    assert CanaryConfig.from_env({"KVCANARY_PADDING_READ_CHECK": "0"}).padding_read_check is False
    with pytest.raises(KvCanaryValueError, match="kv-canary: padding_read_check must be True or False"):
        CanaryConfig(padding_read_check=1)


def _swa_canary(window: int, *, ring: bool = False):
    spec = GroupSpec(name="swa", num_slots=64, sliding_window=window, ring_window=ring)
    return make_canary([spec], max_requests=4, max_context=64)


def _swa_batch(table, tokens, *, prefix: int, slot: int) -> BatchDescription:
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    table[1, prefix] = slot
    tokens[1, prefix] = 100 + prefix
    return BatchDescription(
        req_pool_indices=t([1]), prefix_lens=t([prefix]), extend_lens=t([1]), input_ids=t([100 + prefix]),
        positions=t([prefix]), groups={"swa": GroupBatch(req_to_token=table, out_cache_loc=t([slot]))},
        request_ids=("w",), token_table=tokens, token_table_lens=t([prefix + 1]),
        forward_kind="prefill" if prefix == 0 else "decode",
    )


@pytest.mark.parametrize("ring", [False, True])
def test_sliding_window_positions_behind_the_window_are_silent_inside_reported(ring):
    canary = _swa_canary(4, ring=ring)
    table = torch.zeros(4, 64, dtype=torch.int32)
    tokens = torch.zeros(4, 64, dtype=torch.int32)
    for p in range(10):  # one token per forward, slots 30 + p
        with canary.forward(_swa_batch(table, tokens, prefix=p, slot=30 + p)):
            pass
        if p >= 4:
            table[1, p - 4] = 0  # the engine nulls what the window no longer reads (the window is [P - 4, P))
    # P = 10: the window reads [6, 10) ([7, 10) for a ring); positions 0..5 are nulled behind it
    assert canary.counters()["total"] == 0
    table[1, 7] = 0  # inside the window: a live read through the padding slot
    with canary.forward(_swa_batch(table, tokens, prefix=10, slot=40)):
        pass
    found = canary.violations()
    assert [(v.reasons, v.request_id, v.stored_position, v.launch_tag.name) for v in found] == [
        (PADDING_READ, "w", 7, "HEAD_K_SWA")]


def test_ring_window_head_position_is_not_a_read():
    """A ring window's first position ``P - W``: its slot is the one the forward's first token overwrites, no query
    reads it (the transformers adapter maps it to slot 0 on purpose)."""
    canary = _swa_canary(4, ring=True)
    table = torch.zeros(4, 64, dtype=torch.int32)
    tokens = torch.zeros(4, 64, dtype=torch.int32)
    for p in range(8):
        with canary.forward(_swa_batch(table, tokens, prefix=p, slot=30 + p)):
            pass
    table[1, 8 - 4] = 0
    with canary.forward(_swa_batch(table, tokens, prefix=8, slot=50)):
        pass
    assert canary.counters()["total"] == 0


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
def test_triton_launchers_report_the_same(manual, all_triton):
    engine = manual()
    _prefill_two(engine)
    engine.table[1, 0] = 0
    engine.table[1, 5] = 0
    _step(engine, _decode(engine))
    found = engine.canary.violations()
    assert sorted((v.request_id, v.stored_position) for v in found if v.reasons == PADDING_READ) == [("a", 0), ("a", 5)]


def test_shared_positions_start_the_window_at_the_rows_own_first_query():
    """vLLM's same-step prefix hit: a row claims the positions another row computes in the same forward
    (``shared_lens``), so its prefix is rebased below its first query; the engine may already have nulled the block
    behind that query's window. Without ``shared_lens`` the rebased window would reach into it."""
    canary = _swa_canary(4)
    table = torch.zeros(4, 64, dtype=torch.int32)
    tokens = torch.zeros(4, 64, dtype=torch.int32)
    for p in range(6):
        with canary.forward(_swa_batch(table, tokens, prefix=p, slot=30 + p)):
            pass
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    table[2, :6] = table[1, :6]
    table[2, 6:9] = t([36, 37, 38]).to(torch.int32)  # row 1 computes 6..8 this forward; row 2 claims them
    table[2, :3] = 0  # the engine nulled what row 2's own first query (position 9) no longer reads: [5, 9)
    tokens[2, :9] = tokens[1, :9]
    tokens[1, 6:9] = tokens[2, 6:9] = t([106, 107, 108]).to(torch.int32)
    tokens[2, 9] = 109
    table[1, 6:9] = table[2, 6:9]
    table[2, 9] = 39

    def batch(shared):
        return BatchDescription(
            req_pool_indices=t([1, 2]), prefix_lens=t([6, 6]), extend_lens=t([3, 4]),
            input_ids=t([106, 107, 108, 106, 107, 108, 109]), positions=t([6, 7, 8, 6, 7, 8, 9]),
            groups={"swa": GroupBatch(req_to_token=table, out_cache_loc=t([36, 37, 38, 36, 37, 38, 39]))},
            request_ids=("w", "s"), token_table=tokens, token_table_lens=t([9, 10]), forward_kind="prefill",
            shared_lens=shared,
        )

    with canary.forward(batch(t([0, 3]))):
        pass
    assert canary.counters()["total"] == 0
    with canary.forward(batch(None)):  # the same forward without the share: the window [2, 6) reaches the nulls
        pass
    found = canary.violations()
    assert sorted((v.request_id, v.stored_position, v.reason_label) for v in found) == [("s", 2, "verify_padding_slot_read")]
