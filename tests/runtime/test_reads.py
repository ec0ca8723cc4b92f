"""`ReadCheck` -> ``read_table_mismatch`` rows: appended in batch order, fill-once past the ring's capacity, stamped
with the reading row, counted per tag and per reason, decoded into `Violation` fields."""
import torch

from kvcanary.runtime import BatchDescription, GroupBatch, GroupSpec, ReadCheck
from kvcanary.runtime.reads import READ_TABLE_MISMATCH, reason_label, reason_labels

from tests.runtime.conftest import ManualEngine, make_canary


def _check(mismatch, slot, position, expected, reads, owned):
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return ReadCheck(mismatch=torch.tensor(mismatch), slot=t(slot), position=t(position), expected_slot=t(expected),
                     reads=t(reads), owned=t(owned))


def _batch(engine: ManualEngine, check, rows=(1, 2, 3)):
    bs = len(rows)
    return BatchDescription(
        req_pool_indices=torch.tensor(rows), prefix_lens=torch.zeros(bs, dtype=torch.int64),
        extend_lens=torch.ones(bs, dtype=torch.int64), input_ids=torch.arange(1, bs + 1),
        positions=torch.zeros(bs, dtype=torch.int64),
        groups={"full": GroupBatch(req_to_token=engine.table, out_cache_loc=torch.arange(10, 10 + bs),
                                   read_check=check)},
        request_ids=tuple(f"r{r}" for r in rows),
    )


def test_disagreeing_rows_become_attributed_violations():
    canary = make_canary([GroupSpec(name="full", num_slots=64)], max_requests=4, max_context=64)
    engine = ManualEngine(canary, max_requests=4)
    with canary.forward(engine.batch(1, 0, [5, 6, 7], [20, 21, 22], rid="writer")):
        pass  # slot 21 now holds position 1, token 6
    check = _check([False, True, True], [0, 21, 0], [0, 9, 4], [-1, -1, 33], [3, 5, 3], [3, 4, 4])
    with canary.forward(_batch(engine, check)):
        pass
    found = [v for v in canary.violations() if int(v.reasons) & READ_TABLE_MISMATCH]
    assert [(v.request_id, v.request_row, v.slot) for v in found] == [("r2", 2, 21), ("r3", 3, 0)]
    surplus, gap = found
    assert surplus.launch_tag.name == "HEAD_K_FULL" and surplus.reason_label == "read_table_mismatch"
    assert (surplus.stored_position, surplus.stored_token, surplus.expected_position) == (1, 6, 9)
    assert (surplus.reads, surplus.owned_reads, surplus.expected_slot) == (5, 4, None)
    assert (gap.expected_slot, gap.reads, gap.owned_reads, gap.expected_position) == (33, 3, 4, 4)
    counters = canary.counters()
    assert counters["by_reason"] == {"read_table_mismatch": 2} and counters["by_tag"] == {"HEAD_K_FULL": 2}
    assert "the request owns slot 33 there" in gap.readable() and "fail_reason=read_table_mismatch" in gap.log_line()


def test_past_the_ring_capacity_rows_are_counted_not_kept():
    canary = make_canary([GroupSpec(name="full", num_slots=64)], max_requests=8, max_context=64, ring_capacity=2)
    engine = ManualEngine(canary, max_requests=8)
    rows = (1, 2, 3, 4, 5)
    check = _check([True] * 5, [11, 12, 13, 14, 15], [1, 2, 3, 4, 5], [-1] * 5, [2] * 5, [1] * 5)
    with canary.forward(_batch(engine, check, rows)):
        pass
    counters = canary.counters()
    assert counters["by_tag"] == {"HEAD_K_FULL": 5} and counters["ring_overflow"] == 3
    assert [v.slot for v in canary.violations()] == [11, 12]  # the first rows, in batch order


def test_clean_check_and_labels():
    canary = make_canary([GroupSpec(name="full", num_slots=64)], max_requests=4, max_context=64)
    engine = ManualEngine(canary, max_requests=4)
    with canary.forward(_batch(engine, _check([False] * 3, [0] * 3, [0] * 3, [-1] * 3, [1] * 3, [1] * 3))):
        pass
    assert canary.counters()["total"] == 0
    assert reason_label(READ_TABLE_MISMATCH | 1) == "verify_chain_hash+read_table_mismatch"
    assert reason_labels(2) == ["verify_position"] and reason_label(0) == "none"
