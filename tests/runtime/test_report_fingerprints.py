"""The readable report's real-KV line shows the fingerprints the check compared: a sweep row found by a deep
record (every byte of every layer) shows that record's values, not the TAIL record's (which covers fewer bytes
and still agrees), and a slot rewritten between the check and the report says so instead of showing two equal
values as a change."""
import torch

from kvcanary.ops import FailReason


def test_a_deep_only_flip_reports_the_deep_records_values(manual):
    eng = manual(sweep_interval=0)
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6, 7], slots=[10, 11, 12]))
    eng.kv[0][0][11, 20] ^= 8  # layer 0 K, byte 20: past the 16 bytes the TAIL fingerprint reads
    eng.canary.sweep({"full": torch.tensor([10, 11, 12])})
    (v,) = [v for v in eng.canary.violations() if v.launch_tag.side == "k"]
    assert v.slot == 11 and v.reasons == FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    assert v.stored_fingerprint != v.recomputed_fingerprint and v.fingerprint_scope == "layers [0, 1], every byte"
    block = v.readable()
    assert f"record 0x{v.stored_fingerprint:016x}, bytes now 0x{v.recomputed_fingerprint:016x} (layers [0, 1], every byte)" in block
    assert "equal now" not in block


def test_a_slot_rewritten_after_the_sweep_checked_it_says_the_values_are_equal_now(manual):
    eng = manual(sweep_interval=1)
    eng.canary.set_live_slots_provider(lambda: {"full": torch.tensor([10, 11])})
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6], slots=[10, 11]))
    eng.kv[0][0][11, 20] ^= 8
    # the next forward's sweep slice (at HEAD) checks slot 11; the same forward then rewrites it
    eng.forward(eng.batch(row=2, prefix=0, tokens=[9, 4], slots=[10, 11], rid="b"))
    found = [v for v in eng.canary.violations() if v.phase == "sweep"]
    assert found and {v.slot for v in found} == {11}
    v = found[0]
    assert v.stored_fingerprint == v.recomputed_fingerprint
    assert "equal now (read after the check): the slot was rewritten" in v.readable()
