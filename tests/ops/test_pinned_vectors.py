"""Pinned vectors of docs/design.md §3.2, through the hash functions and through the real write/verify ops."""
from __future__ import annotations

import pytest
import torch

from kvcanary.ops import (
    CANARY_CHAIN_ANCHOR,
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    RealKvHashMode,
    RealKvSource,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
    splitmix64,
    splitmix64_mix3,
)

from . import oracle

SPLITMIX64_VECTORS = [
    (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF),
    (0x1, 0x5692161D100B05E5),
    (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C),
    (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B),
    (0x8000000000000000, 0x25C26EA579CEA98A),
    (0xC0FFEE1234567890, 0xDE7FAE23A9A1B716),
]
H0 = 0xDE7FAE23A9A1B716
CHAIN_10_20_30 = [0xDE7FAE23A9A1B716, 0xCD6D3FC64AB68B75, 0x2C17D4BB20B967A5]
FP_BYTES = bytes([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF])
FP_VALUE = 0x6041580849E6407D
FP_LANES_VALUE = 0xB47914CA5612EAE5  # the same strip in LANES mode (extension: deep fingerprints)
LANES_TWO_SOURCES = (bytes(range(48)), bytes(255 - i for i in range(32)), 0xB28A8FBE0126F676)  # 6 and 4 words
LANES_ZEROS_VALUE = 0x9CA5D45CAD892F08  # one all-zero 16-byte strip: LANES keys words, so not 0

WRITES = [launch_canary_write_kernel, launch_canary_write_kernel_torch_reference]
VERIFIES = [launch_canary_verify_kernel, launch_canary_verify_kernel_torch_reference]


def s64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


@pytest.mark.parametrize("x, want", SPLITMIX64_VECTORS)
def test_splitmix64_pinned(x, want):
    assert splitmix64(x) == want
    assert oracle.sm64(x) == want


@pytest.mark.parametrize("x, want", SPLITMIX64_VECTORS)
def test_splitmix64_accepts_negative_python_ints(x, want):
    assert splitmix64(s64(x)) == want
    assert splitmix64(x + (5 << 64)) == want


def test_splitmix64_of_zero_is_zero():
    assert splitmix64(0) == 0


def test_chain_head_h0():
    assert splitmix64(CANARY_CHAIN_ANCHOR) == H0


def test_mix3_is_three_finalisers_and_takes_negative_ints():
    a, b, c = 0x0123456789ABCDEF, -5, 7
    want = splitmix64(splitmix64(splitmix64(a) ^ ((1 << 64) - 5)) ^ 7)
    assert splitmix64_mix3(a, b, c) == want
    assert splitmix64_mix3(s64(0xFEDCBA9876543210), 10, 0) == splitmix64_mix3(0xFEDCBA9876543210, 10, 0)
    assert 0 <= splitmix64_mix3(-1, -1, -1) < 1 << 64


def test_mix3_chain_10_20_30():
    h = H0
    got = [h]
    for tok, pos in [(10, 0), (20, 1)]:
        h = splitmix64_mix3(h, tok, pos)
        got.append(h)
    assert got == CHAIN_10_20_30


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_write_chain_10_20_30(write, dtype, make_context, make_write_plan):
    ctx = make_context(num_slots=8)
    plan = make_write_plan([3], [-1])
    write(
        context=ctx, plan=plan,
        input_ids=torch.tensor([10, 20, 30], dtype=dtype),
        positions=torch.tensor([0, 1, 2], dtype=dtype),
        out_cache_loc=torch.tensor([5, 2, 7], dtype=dtype),
        enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
    )
    f = ctx.canary_buf.view(torch.int64)
    assert [int(f[s, CANARY_FIELD_PREV_HASH]) for s in (5, 2, 7)] == [s64(v) for v in CHAIN_10_20_30]
    assert [int(f[s, CANARY_FIELD_TOKEN]) for s in (5, 2, 7)] == [10, 20, 30]
    assert [int(f[s, CANARY_FIELD_POSITION]) for s in (5, 2, 7)] == [0, 1, 2]
    assert [int(f[s, CANARY_FIELD_REAL_KV_HASH]) for s in (5, 2, 7)] == [0, 0, 0]
    assert int(ctx.slot_run_counter[0]) == 3 and int(ctx.kernel_run_counter[0]) == 1
    assert int(ctx.violation_write_index[0]) == 0


def _fp_source(dtype: torch.dtype, num_slots: int = 4) -> RealKvSource:
    raw = torch.zeros(num_slots, 16, dtype=torch.uint8)
    raw[2] = torch.tensor(list(FP_BYTES), dtype=torch.uint8)
    return RealKvSource(tensor=raw.view(dtype), page_size=1, num_bytes_per_token=16, read_bytes=16)


def test_fingerprint_vector_oracle():
    src = oracle.OracleSource(rows=[FP_BYTES], page_size=1, num_bytes_per_token=16, read_bytes=16)
    assert oracle.fingerprint([src], RealKvHashMode.PARTIAL, 0) == s64(FP_VALUE)
    assert oracle.fingerprint([src], RealKvHashMode.ALL, 0) == s64(FP_VALUE)


@pytest.mark.parametrize("write, verify", list(zip(WRITES, VERIFIES)))
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL, 1, 2])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
def test_fingerprint_vector_through_write_and_verify(write, verify, mode, dtype, make_context, make_write_plan, make_verify_plan):
    ctx = make_context(num_slots=4, sources=[_fp_source(dtype)], mode=mode)
    write(
        context=ctx, plan=make_write_plan([1], [-1]),
        input_ids=torch.tensor([10]), positions=torch.tensor([0]), out_cache_loc=torch.tensor([2]),
        enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
    )
    f = ctx.canary_buf.view(torch.int64)
    assert int(f[2, CANARY_FIELD_REAL_KV_HASH]) == s64(FP_VALUE)
    assert int(f[2, CANARY_FIELD_PREV_HASH]) == s64(H0)
    verify(context=ctx, plan=make_verify_plan([2], [0], [-1], [10]), check_verify_expected_token=True)
    assert int(ctx.violation_write_index[0]) == 0
    assert int(ctx.kernel_run_counter[0]) == 2 and int(ctx.slot_run_counter[0]) == 2


# --------------------------------------------------------------------------- LANES fingerprints (extension)
M64 = (1 << 64) - 1


def _plain_sm64(x: int) -> int:
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _plain_lanes(strips) -> int:
    """LANES fingerprint of one slot's strips (bytes), straight from the definition with Python ints."""
    total = 0
    for strip in strips:
        acc = 0
        for i in range(len(strip) // 8):
            w = int.from_bytes(strip[8 * i : 8 * i + 8], "little")
            acc = (acc + _plain_sm64(w ^ (((i + 1) * 0x9E3779B97F4A7C15) & M64))) & M64
        total = _plain_sm64(total ^ acc)
    return total


def _lanes_reference(strips, slot: int = 1) -> int:
    """`fingerprint_slots` in LANES mode of slot ``slot`` whose strips are ``strips`` (other slots random)."""
    from kvcanary.ops.reference.real_kv import fingerprint_slots

    sources = []
    for strip in strips:
        raw = torch.randint(0, 256, (3, len(strip)), dtype=torch.uint8)
        raw[slot] = torch.tensor(list(strip), dtype=torch.uint8)
        sources.append(RealKvSource(tensor=raw, page_size=1, num_bytes_per_token=len(strip), read_bytes=len(strip)))
    got = fingerprint_slots(tuple(sources), RealKvHashMode.LANES, torch.tensor([slot]), torch.device("cpu"))
    return int(got[0]) & M64


@pytest.mark.parametrize("strips, want", [
    ((FP_BYTES,), FP_LANES_VALUE),
    (LANES_TWO_SOURCES[:2], LANES_TWO_SOURCES[2]),
    ((bytes(16),), LANES_ZEROS_VALUE),
])
def test_lanes_pinned_vectors(strips, want):
    assert _plain_lanes(strips) == want
    assert _lanes_reference(strips) == want
    srcs = [oracle.OracleSource(rows=[s], page_size=1, num_bytes_per_token=len(s), read_bytes=len(s)) for s in strips]
    assert oracle.fingerprint(srcs, RealKvHashMode.LANES, 0) == s64(want)


@pytest.mark.parametrize("words", [2, 6, 8, 30, 64, 256])
def test_lanes_reference_matches_plain_python(words):
    g = torch.Generator().manual_seed(words)
    strips = [bytes(torch.randint(0, 256, (8 * words,), generator=g, dtype=torch.uint8).tolist()) for _ in range(3)]
    assert _lanes_reference(strips) == _plain_lanes(strips)
    swapped = strips[0][8:16] + strips[0][:8] + strips[0][16:]  # words 0 and 1 exchanged: the keys tell them apart
    assert strips[0][:8] == strips[0][8:16] or _lanes_reference([swapped]) != _lanes_reference(strips[:1])


@pytest.mark.parametrize("write, verify", list(zip(WRITES, VERIFIES)))
def test_lanes_vector_through_write_and_verify(write, verify, make_context, make_write_plan, make_verify_plan):
    ctx = make_context(num_slots=4, sources=[_fp_source(torch.uint8)], mode=RealKvHashMode.LANES)
    write(
        context=ctx, plan=make_write_plan([1], [-1]),
        input_ids=torch.tensor([10]), positions=torch.tensor([0]), out_cache_loc=torch.tensor([2]),
        enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
    )
    assert int(ctx.canary_buf.view(torch.int64)[2, CANARY_FIELD_REAL_KV_HASH]) == s64(FP_LANES_VALUE)
    verify(context=ctx, plan=make_verify_plan([2], [0], [-1], [10]), check_verify_expected_token=True)
    assert int(ctx.violation_write_index[0]) == 0


# --------------------------------------------------------------------------- §3.0 names, §3.1 constants
SPEC_NAMES = """
CANARY_CHAIN_ANCHOR REQ_POOL_IDX_PADDING TOKEN_TO_KV_SLOT_PADDING CANARY_FIELDS_PER_SLOT CANARY_FIELD_TOKEN
CANARY_FIELD_POSITION CANARY_FIELD_PREV_HASH CANARY_FIELD_REAL_KV_HASH VIOLATION_FIELDS VIOLATION_FIELD_KERNEL_KIND
VIOLATION_FIELD_SLOT_IDX VIOLATION_FIELD_POSITION VIOLATION_FIELD_STORED_TOKEN VIOLATION_FIELD_EXPECTED_TOKEN
VIOLATION_FIELD_STORED_CHAIN_HASH VIOLATION_FIELD_EXPECTED_AUX VIOLATION_FIELD_FAIL_REASON_BITS MAX_REAL_KV_SOURCES
FailReason RealKvHashMode CanaryLaunchTag splitmix64 splitmix64_mix3 RealKvSource VerifyOrWriteContext VerifyPlan
WritePlan launch_canary_plan_kernels launch_canary_write_kernel launch_canary_verify_kernel
launch_scatter_req_token_ids_kernel launch_canary_plan_kernels_torch_reference
launch_canary_write_kernel_torch_reference launch_canary_verify_kernel_torch_reference
scatter_req_token_ids_torch_reference
""".split()


def test_ops_package_exports_every_spec_name():
    import kvcanary.ops as ops

    missing = [n for n in SPEC_NAMES if not hasattr(ops, n)]
    assert missing == []


def test_constant_values():
    import kvcanary.ops as ops

    assert ops.CANARY_CHAIN_ANCHOR == 0xC0FFEE1234567890
    assert (ops.REQ_POOL_IDX_PADDING, ops.TOKEN_TO_KV_SLOT_PADDING) == (0, 0)
    assert ops.CANARY_FIELDS_PER_SLOT == 4
    assert (ops.CANARY_FIELD_TOKEN, ops.CANARY_FIELD_POSITION, ops.CANARY_FIELD_PREV_HASH,
            ops.CANARY_FIELD_REAL_KV_HASH) == (0, 1, 2, 3)
    assert ops.VIOLATION_FIELDS == 8
    assert [ops.VIOLATION_FIELD_KERNEL_KIND, ops.VIOLATION_FIELD_SLOT_IDX, ops.VIOLATION_FIELD_POSITION,
            ops.VIOLATION_FIELD_STORED_TOKEN, ops.VIOLATION_FIELD_EXPECTED_TOKEN, ops.VIOLATION_FIELD_STORED_CHAIN_HASH,
            ops.VIOLATION_FIELD_EXPECTED_AUX, ops.VIOLATION_FIELD_FAIL_REASON_BITS] == list(range(8))
    assert ops.MAX_REAL_KV_SOURCES == 4


def test_enums():
    from kvcanary.ops import CanaryLaunchTag, FailReason

    assert {m.name: int(m) for m in FailReason} == {
        "VERIFY_CHAIN_HASH_MISMATCH": 1, "VERIFY_POSITION_MISMATCH": 2, "VERIFY_REAL_KV_HASH_MISMATCH": 4,
        "WRITE_TOKEN_MISMATCH": 8, "WRITE_POSITION_MISMATCH": 16, "VERIFY_TOKEN_MISMATCH": 32,
        # appended (issue 10 item 5): slots outside the canary buffer
        "VERIFY_SLOT_OUT_OF_RANGE": 64, "WRITE_SLOT_OUT_OF_RANGE": 128,
        # appended (issue 36 item 4): a live read through the padding slot (set by the padding-read check only)
        "VERIFY_PADDING_SLOT_READ": 256}
    assert {m.name: int(m) for m in RealKvHashMode} == {"NONE": 0, "PARTIAL": 1, "ALL": 2, "LANES": 3}  # LANES: appended
    assert [m.name for m in sorted(CanaryLaunchTag)] == [
        "HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL", "SWEEP_K_FULL", "SWEEP_V_FULL",
        "HEAD_K_SWA", "HEAD_V_SWA", "TAIL_K_SWA", "TAIL_V_SWA", "SWEEP_K_SWA", "SWEEP_V_SWA",
        "MOVE_K_FULL", "MOVE_V_FULL", "MOVE_K_SWA", "MOVE_V_SWA"]  # MOVE_*: appended (issue 9)
    assert [int(m) for m in sorted(CanaryLaunchTag)] == list(range(16))


def test_fail_reason_labels():
    from kvcanary.ops import FailReason

    assert FailReason.VERIFY_REAL_KV_HASH_MISMATCH.label == "verify_real_kv_hash"
    assert FailReason.WRITE_TOKEN_MISMATCH.label == "write_token"
    both = FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH
    assert both.label == "verify_chain_hash+verify_position"
