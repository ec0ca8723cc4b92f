"""Canary records that move with KV: Canary.copy_slots / export_records / import_records (runtime/moves.py)."""
import pytest
import torch

from kvcanary.ops import CanaryLaunchTag, FailReason
from kvcanary.ops.copy_format import canary_records_from_bytes, canary_records_to_bytes
from kvcanary.runtime import CanaryViolationError

PROMPT = [11, 12, 13, 14, 15, 16]


def _prefill(eng, slots, row=1, rid="a", tokens=PROMPT):
    eng.forward(eng.batch(row, 0, tokens[: len(slots)], slots, rid=rid))


def _copy_kv(eng, src, dst):
    for k, v in eng.kv.values():
        k[dst] = k[src]
        v[dst] = v[src]


def test_copied_slots_serve_a_forked_request_silently(manual):
    eng = manual()
    _prefill(eng, [1, 2, 3, 4, 5, 6])
    _copy_kv(eng, [4, 5, 6], [20, 21, 22])
    report = eng.canary.copy_slots("full", [4, 5, 6], [20, 21, 22], request_ids=["b"], verify=True, label="fork")
    assert (report.moved, report.verified, report.clean, report.kind) == (3, 3, True, "copy")
    # the fork shares slots 1-3 and reads its copies 20-22, then decodes one token into slot 23
    eng.table[2, :3] = torch.tensor([1, 2, 3], dtype=torch.int32)
    eng.tokens[2, :6] = torch.tensor(PROMPT, dtype=torch.int32)
    eng.forward(eng.batch(2, 3, PROMPT[3:], [20, 21, 22], rid="b"))  # rewrite the copies: HEAD verifies nothing new
    eng.forward(eng.batch(2, 6, [17], [23], rid="b"))
    eng.forward(eng.batch(1, 6, [18], [7], rid="a"))
    assert eng.canary.counters()["total"] == 0
    assert eng.canary.sweep({"full": torch.tensor([1, 2, 3, 4, 5, 6, 7, 20, 21, 22, 23])}).complete
    assert eng.canary.counters()["total"] == 0
    rec = eng.canary.groups["full"].records
    assert rec.prev_slot[[20, 21, 22]].tolist() == [3, 20, 21]  # the shared predecessor kept, the copied ones remapped


def test_kv_copied_without_records_is_caught(manual):
    eng = manual()
    _prefill(eng, [1, 2, 3, 4, 5, 6])
    _copy_kv(eng, [4, 5, 6], [20, 21, 22])  # the engine copies KV, nobody tells the canary
    eng.table[2, :6] = torch.tensor([1, 2, 3, 20, 21, 22], dtype=torch.int32)
    eng.tokens[2, :6] = torch.tensor(PROMPT, dtype=torch.int32)
    eng.forward(eng.batch(2, 6, [17], [23], rid="b"))
    vs = eng.canary.violations()
    assert vs and vs[0].launch_tag == CanaryLaunchTag.HEAD_K_FULL and vs[0].slot == 20 and vs[0].request_id == "b"


def test_copy_swap_moves_records_and_slot_records(manual):
    eng = manual()
    _prefill(eng, [1, 2, 3])
    g = eng.canary.groups["full"]
    before = [b.clone() for b in (g.head_buf, g.tail_bufs["k"], g.tail_bufs["v"])]
    pos_before = g.records.position.clone()
    eng.canary.copy_slots("full", torch.tensor([1, 3, 0]), torch.tensor([3, 1, 5]))
    for b, old in zip((g.head_buf, g.tail_bufs["k"], g.tail_bufs["v"]), before):
        assert torch.equal(b[1], old[3]) and torch.equal(b[3], old[1]) and torch.equal(b[5], old[5])
    assert g.records.position[[1, 3]].tolist() == pos_before[[3, 1]].tolist()
    assert int(g.records.position[5]) == -1  # padding entry skipped


def test_export_import_round_trip_through_bytes_is_clean(manual):
    eng = manual()
    _prefill(eng, [1, 2, 3, 4, 5, 6])
    records = canary_records_from_bytes(canary_records_to_bytes(eng.canary.export_records("full", [1, 2, 3, 4, 5, 6])))
    assert records.shape == (7, 20)  # header row + 6 slots; HEAD, TAIL k, TAIL v, deep k, deep v (4 words each)
    dst = [30, 31, 32, 33, 34, 35]
    _copy_kv(eng, [1, 2, 3, 4, 5, 6], dst)
    report = eng.canary.import_records("full", dst, records, positions=range(6), tokens=PROMPT, request_ids=["d"],
                                       label="xfer")
    assert report.clean and report.verified == 6
    eng.tokens[2, :6] = torch.tensor(PROMPT, dtype=torch.int32)
    eng.table[2, :6] = torch.tensor(dst, dtype=torch.int32)
    eng.forward(eng.batch(2, 6, [17], [36], rid="d"))
    assert eng.canary.counters()["total"] == 0


def _received(manual, corrupt):
    eng = manual()
    _prefill(eng, [1, 2, 3, 4, 5, 6])
    _prefill(eng, [7, 8, 9, 10, 11, 12], row=2, rid="old", tokens=[21, 22, 23, 24, 25, 26])
    src = [1, 2, 3, 4, 5, 6]
    records = eng.canary.export_records("full", src)
    dst = [40, 41, 42, 43, 44, 45]
    src, records = corrupt(eng, src, records)
    _copy_kv(eng, src, dst)
    report = eng.canary.import_records("full", dst, records, positions=range(6), tokens=PROMPT,
                                       request_ids=["recv"], label="xfer-7")
    assert report.violations, "the faulted transfer must be caught on receipt"
    for v in report.violations:
        assert v.launch_tag.phase == "move" and v.request_id == "recv" and v.forward_kind == "import:xfer-7"
        assert v.step == report.step
    return report


def test_zeroed_block_in_flight_is_caught(manual):
    def zero(eng, src, records):
        for k, v in eng.kv.values():
            k[src[2]] = 0
        return src, records

    report = _received(manual, zero)
    assert {v.slot for v in report.violations} == {42}
    assert all(v.reasons == FailReason.VERIFY_REAL_KV_HASH_MISMATCH for v in report.violations)
    assert {v.launch_tag for v in report.violations} == {CanaryLaunchTag.MOVE_K_FULL}


def test_out_of_order_blocks_are_caught(manual):
    def swap(eng, src, records):  # blocks [0:3] and [3:6] arrive swapped, each with its own records
        order = [3, 4, 5, 0, 1, 2]
        return [src[i] for i in order], torch.cat([records[:1], records[1:][order]])

    report = _received(manual, swap)
    assert all(v.reasons & FailReason.VERIFY_POSITION_MISMATCH for v in report.violations)
    assert {v.slot for v in report.violations} == {40, 41, 42, 43, 44, 45}


def test_stale_block_from_previous_request_is_caught(manual):
    def stale(eng, src, records):  # the second block comes from the previous request (KV and records)
        old = eng.canary.export_records("full", [7, 8, 9, 10, 11, 12])
        records = records.clone()
        records[4:] = old[4:]
        return src[:3] + [10, 11, 12], records

    report = _received(manual, stale)
    assert {v.slot for v in report.violations} == {43, 44, 45}
    assert all(v.reasons & FailReason.VERIFY_TOKEN_MISMATCH for v in report.violations)
    assert any(v.reasons & FailReason.VERIFY_CHAIN_HASH_MISMATCH for v in report.violations)


def test_raise_mode_raises_after_installing(manual):
    eng = manual(mode="raise")
    _prefill(eng, [1, 2, 3])
    records = eng.canary.export_records("full", [1, 2, 3])
    with pytest.raises(CanaryViolationError):
        eng.canary.import_records("full", [50, 51, 52], records)  # KV never landed there


def test_bad_input(manual):
    eng = manual()
    _prefill(eng, [1, 2, 3])
    records = eng.canary.export_records("full", [1, 2, 3])
    with pytest.raises(ValueError, match="kv-canary: import_records records hold 3 slot"):
        eng.canary.import_records("full", [50, 51], records)
    with pytest.raises(ValueError, match="kv-canary: import_records request_lens"):
        eng.canary.import_records("full", [50, 51, 52], records, request_lens=[1, 1])
    with pytest.raises(ValueError, match="kv-canary: copy_slots src has 2 entries"):
        eng.canary.copy_slots("full", [1, 2], [5])
    with pytest.raises(ValueError, match="kv-canary: no group"):
        eng.canary.export_records("swa", [1])
    eng.canary.before_forward(eng.batch(1, 3, [14], [4]))
    with pytest.raises(RuntimeError, match="inside an open forward"):
        eng.canary.copy_slots("full", [1], [9])
    eng.canary.after_forward()
    assert eng.canary.counters()["total"] == 0


def test_a_copy_from_a_never_written_slot_leaves_the_destination_never_written(manual):
    """A fork copies whole blocks, the parent's unwritten tail too: the copies of unwritten slots stay unwritten
    (the sweep counts them unrecorded), they do not pass for slots written at the copy's step."""
    eng = manual()
    _prefill(eng, [1, 2, 3])
    _copy_kv(eng, [2, 3, 4], [20, 21, 22])
    eng.canary.copy_slots("full", [2, 3, 4], [20, 21, 22], request_ids=["b"], label="fork")  # 4: never written
    rec = eng.canary.groups["full"].records
    assert rec.step[22].item() == -1 and rec.position[22].item() == -1 and rec.step[21].item() > 0
    report = eng.canary.sweep({"full": torch.tensor([20, 21, 22])})
    assert (report.verified, report.unrecorded) == ({"full": 2}, {"full": 1})
    assert eng.canary.violations() == []
