"""Record copy, export and import (``kvcanary.ops.copy``): hand cases, errors, a scalar oracle
fed by hypothesis, export -> import round trips, and twin vs Triton parity (the interpreter on
CPU when ``TRITON_INTERPRET=1``, the real kernels on a CUDA device)."""
from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcanary.ops import (
    CANARY_RECORDS_MAGIC,
    CANARY_RECORDS_VERSION,
    canary_copy_slots_torch_reference,
    canary_records_from_bytes,
    canary_records_to_bytes,
    export_canary_records,
    export_canary_records_torch_reference,
    import_canary_records,
    import_canary_records_torch_reference,
    launch_canary_copy_slots_kernel,
)

if importlib.util.find_spec("triton") is not None:  # only a missing Triton skips the parity tests
    from kvcanary.ops.triton import copy as triton_copy
else:
    triton_copy = None

INTERPRETER = triton_copy is not None and os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="needs Triton with TRITON_INTERPRET=1 (set by conftest without a GPU)")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or triton_copy is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device and compiled Triton",
)

# Table kinds: a 32-byte canary buffer, a wide one (bytes past 32 must survive), an int64 table.
KINDS = ("u8x32", "u8x48", "i64x5")


def make_table(kind: str, num_slots: int, g: torch.Generator) -> torch.Tensor:
    width = {"u8x32": 32, "u8x48": 48, "i64x5": 40}[kind]
    raw = torch.randint(0, 256, (num_slots, width), dtype=torch.uint8, generator=g)
    return raw.view(torch.int64) if kind.startswith("i64") else raw


def make_tables(num_slots: int, kinds=KINDS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [make_table(k, num_slots, g) for k in kinds]


def words(t: torch.Tensor) -> list[list[int]]:
    """The four record words of every row, as Python ints."""
    f = t if t.dtype == torch.int64 else t.view(torch.int64)
    return f[:, :4].tolist()


def rest(t: torch.Tensor) -> torch.Tensor:
    """Bytes past the record (must never change)."""
    return (t.view(torch.uint8) if t.dtype == torch.int64 else t)[:, 32:].clone()


def counters(kernel: int = 40, slots: int = 70):
    """Counters as one-element views of a larger array (neighbours must stay put)."""
    arr = torch.tensor([-5, slots, -6, kernel, -7], dtype=torch.int64)
    return arr, arr[1:2], arr[3:4]


# ----------------------------------------------------------------------------- scalar oracle


def oracle_copy(tables_words, src, dst, num_valid=None):
    """Copy by the contract, one entry at a time on Python lists: (new words, entries copied)."""
    n = len(dst) if num_valid is None else min(max(num_valid, 0), len(dst))
    before = copy.deepcopy(tables_words)
    after = copy.deepcopy(tables_words)
    copied = 0
    for i in range(n):
        s, d = src[i], dst[i]
        if s <= 0 or d <= 0:
            continue
        for t in range(len(after)):
            after[t][d] = list(before[t][s])
        copied += 1
    return after, copied


def oracle_export(tables_words, slots):
    rows = [[CANARY_RECORDS_MAGIC, CANARY_RECORDS_VERSION, len(slots), len(tables_words)] + [0] * (4 * len(tables_words) - 4)]
    for s in slots:
        rows.append([w for t in tables_words for w in (t[s] if s > 0 else [0, 0, 0, 0])])
    return rows


def oracle_import(tables_words, slots, payload):
    after = copy.deepcopy(tables_words)
    copied = 0
    for i, s in enumerate(slots):
        if s <= 0:
            continue
        for t in range(len(after)):
            after[t][s] = list(payload[i][4 * t : 4 * t + 4])
        copied += 1
    return after, copied


# ----------------------------------------------------------------------------- implementations

COPY_IMPLS = [
    pytest.param("twin", id="twin"),
    pytest.param("launcher", id="launcher"),
    pytest.param("triton", id="triton-interp", marks=needs_interpreter),
]


def copy_impl(name):
    if name == "twin":
        return canary_copy_slots_torch_reference
    if name == "launcher":
        return launch_canary_copy_slots_kernel
    return triton_copy.launch_copy_slots


def export_impl(name):
    return {"twin": export_canary_records_torch_reference, "launcher": export_canary_records}.get(name) or triton_copy.launch_export_records


def import_impl(name):
    return {"twin": import_canary_records_torch_reference, "launcher": import_canary_records}.get(name) or triton_copy.launch_import_records


def run_copy(impl_name, tables, src, dst, num_valid=None, dtype=torch.int64):
    """Run one copy on clones; returns (tables, counter array) after it."""
    tabs = [t.clone() for t in tables]
    arr, slot_c, kern_c = counters()
    copy_impl(impl_name)(
        canary_bufs=tuple(tabs), src_slots=torch.tensor(src, dtype=dtype), dst_slots=torch.tensor(dst, dtype=dtype),
        num_valid=None if num_valid is None else torch.tensor([num_valid], dtype=torch.int32),
        slot_run_counter=slot_c, kernel_run_counter=kern_c,
    )
    return tabs, arr


def check_copy(impl_name, tables, src, dst, num_valid=None, dtype=torch.int64):
    """Run a copy and compare everything with the oracle; returns the new tables."""
    tabs, arr = run_copy(impl_name, tables, src, dst, num_valid, dtype)
    want, copied = oracle_copy([words(t) for t in tables], src, dst, num_valid)
    assert [words(t) for t in tabs] == want
    for before, after in zip(tables, tabs):
        assert torch.equal(rest(before), rest(after))
    assert arr.tolist() == [-5, 70 + copied, -6, 41, -7]
    return tabs


# ----------------------------------------------------------------------------- hand cases: copy


@pytest.mark.parametrize("impl", COPY_IMPLS)
def test_copy_chain_in_one_launch_reads_state_before_launch(impl):
    tables = make_tables(8)
    w0 = [words(t) for t in tables]
    tabs = check_copy(impl, tables, [1, 2], [2, 3])
    assert [words(t)[2] for t in tabs] == [w[1] for w in w0]
    assert [words(t)[3] for t in tabs] == [w[2] for w in w0]  # b's old record, not a's


@pytest.mark.parametrize("impl", COPY_IMPLS)
def test_copy_swap_and_rotation(impl):
    tables = make_tables(8, seed=1)
    w0 = [words(t) for t in tables]
    tabs = check_copy(impl, tables, [1, 2], [2, 1])
    assert [words(t)[1] for t in tabs] == [w[2] for w in w0]
    assert [words(t)[2] for t in tabs] == [w[1] for w in w0]
    check_copy(impl, tables, [3, 4, 5], [4, 5, 3])


@pytest.mark.parametrize("impl", COPY_IMPLS)
def test_copy_duplicate_destinations_last_entry_wins(impl):
    tables = make_tables(8, seed=2)
    w0 = [words(t) for t in tables]
    tabs = check_copy(impl, tables, [1, 2, 3], [5, 5, 5])  # counts 3
    assert [words(t)[5] for t in tabs] == [w[3] for w in w0]
    tabs = check_copy(impl, tables, [3, 1, 0, 2], [6, 6, 6, -1])  # the padding entries don't win
    assert [words(t)[6] for t in tabs] == [w[1] for w in w0]


@pytest.mark.parametrize("impl", COPY_IMPLS)
def test_copy_padding_entries_are_skipped_and_slot0_never_written(impl):
    tables = make_tables(8, seed=3)
    tabs = check_copy(impl, tables, [0, 1, -1, 2, 0, -3], [3, 0, 4, -5, 0, 0])  # all padding: counts 0
    assert all(torch.equal(a, b) for a, b in zip(tables, tabs))


@pytest.mark.parametrize("impl", COPY_IMPLS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_copy_num_valid_caps_entries(impl, dtype):
    tables = make_tables(8, seed=4)
    for nv in (-3, 0, 1, 2, 3, 9):
        check_copy(impl, tables, [1, 2, 3], [4, 5, 6], num_valid=nv, dtype=dtype)


def test_launcher_never_reads_entries_past_num_valid():
    tables = make_tables(8, seed=5)
    check_copy("launcher", tables, [1, 2, 999], [4, 5, 999], num_valid=2)


@pytest.mark.parametrize("impl", COPY_IMPLS)
def test_copy_without_counters_and_empty(impl):
    tables = make_tables(6, seed=6)
    tabs = [t.clone() for t in tables]
    copy_impl(impl)(canary_bufs=tuple(tabs), src_slots=torch.tensor([1]), dst_slots=torch.tensor([2]))
    assert [words(t)[2] for t in tabs] == [words(t)[1] for t in tables]
    arr, slot_c, kern_c = counters()
    copy_impl(impl)(canary_bufs=tuple(tabs), src_slots=torch.zeros(0, dtype=torch.int64),
                    dst_slots=torch.zeros(0, dtype=torch.int64), slot_run_counter=slot_c, kernel_run_counter=kern_c)
    assert arr.tolist() == [-5, 70, -6, 41, -7]


@pytest.mark.parametrize("impl", COPY_IMPLS)
def test_copy_five_tables(impl):
    """More tables than one Triton launch handles (four)."""
    tables = make_tables(9, kinds=KINDS + ("u8x32", "i64x5"), seed=7)
    check_copy(impl, tables, [1, 2, 3, 4, 5], [2, 3, 7, 7, 8])


# ----------------------------------------------------------------------------- launcher errors


def _copy_args(tables, **kw):
    args = dict(canary_bufs=tuple(tables), src_slots=torch.tensor([1, 2]), dst_slots=torch.tensor([3, 4]))
    args.update(kw)
    return args


def _assert_untouched(tables, snapshot, arr=None):
    assert all(torch.equal(a, b) for a, b in zip(tables, snapshot))
    if arr is not None:
        assert arr.tolist() == [-5, 70, -6, 40, -7]


@pytest.mark.parametrize(
    "field, src, dst, nv, message",
    [
        ("src", [1, 8], [3, 4], None, "src_slots[1]=8 is out of range for tables of 8 slots"),
        ("dst", [1, 2], [3, 12], None, "dst_slots[1]=12 is out of range for tables of 8 slots"),
        ("dst", [1, 2, 3], [3, 4, 9], 3, "dst_slots[2]=9 is out of range for tables of 8 slots"),
        ("src", [0, 9], [0, 4], None, "src_slots[1]=9 is out of range for tables of 8 slots"),
    ],
)
def test_copy_out_of_range_raises_and_changes_nothing(field, src, dst, nv, message):
    tables = make_tables(8)
    snapshot = [t.clone() for t in tables]
    arr, slot_c, kern_c = counters()
    with pytest.raises(ValueError) as err:
        launch_canary_copy_slots_kernel(
            **_copy_args(tables, src_slots=torch.tensor(src), dst_slots=torch.tensor(dst),
                         num_valid=None if nv is None else torch.tensor([nv], dtype=torch.int32),
                         slot_run_counter=slot_c, kernel_run_counter=kern_c)
        )
    assert str(err.value) == f"kv-canary: launch_canary_copy_slots_kernel {message}"
    _assert_untouched(tables, snapshot, arr)


def test_twin_may_raise_index_error_out_of_range():
    tables = make_tables(8)
    for src, dst in (([9], [1]), ([1], [9]), ([1, 2], [3, 8])):
        with pytest.raises(IndexError):
            canary_copy_slots_torch_reference(canary_bufs=tables, src_slots=torch.tensor(src), dst_slots=torch.tensor(dst))


@pytest.mark.parametrize(
    "kw, exc, message",
    [
        (dict(src_slots=torch.tensor([1, 2, 3])), ValueError, "src_slots has 3 entries, dst_slots has 2"),
        (dict(src_slots=torch.tensor([1.0, 2.0])), TypeError, "src_slots must be torch.int32 or torch.int64, got torch.float32"),
        (dict(dst_slots=torch.tensor([[3, 4]])), ValueError, "dst_slots must be 1-D, got shape (1, 2)"),
        (dict(dst_slots=torch.tensor([3, 0, 4, 0])[::2]), ValueError, "dst_slots must be contiguous, got shape (2,) strides (2,)"),
        (dict(num_valid=torch.tensor([1])), TypeError, "num_valid must be torch.int32, got torch.int64"),
        (dict(slot_run_counter=torch.zeros(2, dtype=torch.int64)), ValueError,
         "slot_run_counter must hold exactly 1 element(s), got shape (2,)"),
        (dict(canary_bufs=[]), TypeError, "canary_bufs must be a non-empty tuple of tensors, got list"),
        (dict(canary_bufs=(torch.zeros(8, 24, dtype=torch.uint8),)), ValueError,
         "canary_bufs[0] rows must hold at least 4 int64 fields, got 3"),
        (dict(canary_bufs=(torch.zeros(8, 36, dtype=torch.uint8),)), ValueError,
         "canary_bufs[0] rows must start on 8-byte boundaries, got row stride 36 bytes"),
        (dict(canary_bufs=(torch.zeros(8, 4, dtype=torch.float64),)), TypeError,
         "canary_bufs[0] must be torch.uint8 or torch.int64, got torch.float64"),
        (dict(canary_bufs=(torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(9, 32, dtype=torch.uint8))), ValueError,
         "canary_bufs[1] has 9 slots, canary_bufs[0] has 8"),
        (dict(canary_bufs=(torch.zeros(8, 8, dtype=torch.int64)[:, ::2],)), ValueError,
         "canary_bufs[0] rows must be contiguous, got strides (8, 2)"),
    ],
)
def test_copy_argument_errors(kw, exc, message):
    tables = make_tables(8)
    snapshot = [t.clone() for t in tables]
    with pytest.raises(exc) as err:
        launch_canary_copy_slots_kernel(**_copy_args(tables, **kw))
    text = str(err.value)
    assert text.startswith("kv-canary: launch_canary_copy_slots_kernel ") and text.endswith(message), text
    _assert_untouched(tables, snapshot)


def test_copy_rejects_overlapping_tables():
    base = torch.zeros(8, 64, dtype=torch.uint8)
    for tables in ((base, base), (base[:, :32], base[:, 16:48]), (base[:, 32:], base)):
        with pytest.raises(ValueError, match=r"^kv-canary: launch_canary_copy_slots_kernel canary_bufs\[0\] and canary_bufs\[1\] overlap in memory$"):
            launch_canary_copy_slots_kernel(**_copy_args(tables))
    # Neighbouring views of one allocation are fine.
    launch_canary_copy_slots_kernel(**_copy_args((base[:, :32], base[:, 32:])))


# ----------------------------------------------------------------------------- export / import

EXPORT_IMPLS = COPY_IMPLS


@pytest.mark.parametrize("impl", EXPORT_IMPLS)
def test_export_layout_header_and_padding_rows(impl):
    tables = make_tables(8, seed=8)
    slots = [3, 0, 7, -2, 3]
    records = export_impl(impl)(canary_bufs=tuple(tables), slots=torch.tensor(slots, dtype=torch.int32))
    assert records.dtype == torch.int64 and tuple(records.shape) == (6, 12)
    assert records.tolist() == oracle_export([words(t) for t in tables], slots)
    assert canary_records_to_bytes(records)[:8] == b"KVCANARY"


@pytest.mark.parametrize("impl", EXPORT_IMPLS)
def test_export_into_caller_owned_out(impl):
    tables = make_tables(8, seed=18)
    out = torch.full((4, 12), -9, dtype=torch.int64)
    for slots in ([1, 2, 3], [0, 7, 2]):
        got = export_impl(impl)(canary_bufs=tuple(tables), slots=torch.tensor(slots), out=out)
        assert got is out and out.tolist() == oracle_export([words(t) for t in tables], slots)


@pytest.mark.parametrize(
    "out, exc, message",
    [
        (torch.zeros(4, 8, dtype=torch.int64), ValueError, "out must have shape (4, 12), got (4, 8)"),
        (torch.zeros(4, 12, dtype=torch.int32), TypeError, "out must be torch.int64, got torch.int32"),
        (torch.zeros(12, 4, dtype=torch.int64).t(), ValueError, "out must be contiguous, got shape (4, 12) strides (1, 4)"),
    ],
)
def test_export_out_errors(out, exc, message):
    with pytest.raises(exc) as err:
        export_canary_records(canary_bufs=tuple(make_tables(8)), slots=torch.tensor([1, 2, 3]), out=out)
    assert str(err.value) == f"kv-canary: export_canary_records {message}"


@pytest.mark.parametrize("impl", EXPORT_IMPLS)
def test_export_import_round_trip_restores_bytes(impl):
    tables = make_tables(16, seed=9)
    slots = torch.tensor([5, 6, 7, 8, 0, 9])
    records = export_impl(impl)(canary_bufs=tuple(tables), slots=slots)
    wire = canary_records_from_bytes(canary_records_to_bytes(records))
    assert torch.equal(wire, records)
    # The receiver places them in its own slots; the record bytes land exactly, the rest stays.
    received = make_tables(16, seed=10)
    dst = torch.tensor([11, 2, 3, -1, 15, 1])  # entry 3: padding on the receiver's side
    arr, slot_c, kern_c = counters()
    import_impl(impl)(canary_bufs=tuple(received), slots=dst, records=wire, slot_run_counter=slot_c, kernel_run_counter=kern_c)
    for src_t, got, before in zip(tables, received, make_tables(16, seed=10)):
        for s, d in zip(slots.tolist(), dst.tolist()):
            if s > 0 and d > 0:
                assert words(got)[d] == words(src_t)[s]
        assert words(got)[15] == [0, 0, 0, 0]  # the sender's padding slot ships a zero record
        untouched = [r for r in range(16) if r not in (11, 2, 3, 15, 1)]
        assert [words(got)[r] for r in untouched] == [words(before)[r] for r in untouched]
        assert torch.equal(rest(got), rest(before))
    assert arr.tolist() == [-5, 75, -6, 41, -7]
    # Same slots on both sides: identical bytes.
    fresh = [torch.zeros_like(t) for t in tables]
    import_impl(impl)(canary_bufs=tuple(fresh), slots=slots, records=wire)
    for f, t in zip(fresh, tables):
        idx = torch.tensor([5, 6, 7, 8, 9])
        assert torch.equal(f.view(torch.uint8)[idx, :32], t.view(torch.uint8)[idx, :32])


@pytest.mark.parametrize("impl", EXPORT_IMPLS)
def test_import_duplicates_last_wins_and_padding(impl):
    tables = make_tables(8, seed=11)
    records = export_impl(impl)(canary_bufs=tuple(tables), slots=torch.tensor([1, 2, 3, 4]))
    received = make_tables(8, seed=12)
    dst = [6, 6, -1, 0]
    want, copied = oracle_import([words(t) for t in received], dst, records[1:].tolist())
    import_impl(impl)(canary_bufs=tuple(received), slots=torch.tensor(dst), records=records)
    assert [words(t) for t in received] == want and copied == 2
    assert words(received[0])[6] == words(tables[0])[2]


def _records(tables, n=2):
    return export_canary_records(canary_bufs=tuple(tables), slots=torch.arange(1, n + 1))


@pytest.mark.parametrize(
    "mutate, exc, message",
    [
        (lambda r: r.__setitem__((0, 0), 0x1234), ValueError,
         "records header magic is 0x0000000000001234, expected 0x5952414E4143564B (not a kvcanary record export, or another byte order)"),
        (lambda r: r.__setitem__((0, 1), 2), ValueError, "records layout version 2 is not supported (this kvcanary reads version 1)"),
        (lambda r: r.__setitem__((0, 2), 3), ValueError, "records hold 3 slot(s), slots has 2"),
        (lambda r: r.__setitem__((0, 3), 2), ValueError, "records hold 2 table(s) per slot, canary_bufs has 3"),
        (lambda r: r[:, :8], ValueError, "records shape (3, 8) does not match its header (n=2, tables=3 -> (3, 12))"),
        (lambda r: r[:2], ValueError, "records shape (2, 12) does not match its header (n=2, tables=3 -> (3, 12))"),
        (lambda r: r.to(torch.float64), TypeError, "records must be torch.int64, got torch.float64"),
        (lambda r: r.flatten(), ValueError, "records must be int64 [1 + n, 4 * num_buffers] with a header row, got shape (36,)"),
    ],
)
def test_import_rejects_mismatched_layout_and_changes_nothing(mutate, exc, message):
    tables = make_tables(8, seed=13)
    records = _records(tables).clone()
    out = mutate(records)
    records = records if out is None else out
    snapshot = [t.clone() for t in tables]
    arr, slot_c, kern_c = counters()
    for impl in (import_canary_records, import_canary_records_torch_reference):
        with pytest.raises(exc) as err:
            impl(canary_bufs=tuple(tables), slots=torch.tensor([3, 4]), records=records,
                 slot_run_counter=slot_c, kernel_run_counter=kern_c)
        assert str(err.value) == f"kv-canary: import_canary_records {message}"
        _assert_untouched(tables, snapshot, arr)


def test_import_and_export_out_of_range_raise_before_anything_changes():
    tables = make_tables(8, seed=14)
    records = _records(tables)
    snapshot = [t.clone() for t in tables]
    arr, slot_c, kern_c = counters()
    with pytest.raises(ValueError) as err:
        import_canary_records(canary_bufs=tuple(tables), slots=torch.tensor([3, 8]), records=records,
                              slot_run_counter=slot_c, kernel_run_counter=kern_c)
    assert str(err.value) == "kv-canary: import_canary_records slots[1]=8 is out of range for tables of 8 slots"
    _assert_untouched(tables, snapshot, arr)
    with pytest.raises(ValueError) as err:
        export_canary_records(canary_bufs=tuple(tables), slots=torch.tensor([0, 1, 20]))
    assert str(err.value) == "kv-canary: export_canary_records slots[2]=20 is out of range for tables of 8 slots"


def test_records_bytes_errors():
    records = _records(make_tables(8))
    data = canary_records_to_bytes(records)
    assert len(data) == 3 * 12 * 8
    with pytest.raises(ValueError, match=r"^kv-canary: canary_records_from_bytes got 280 bytes, the header \(n=2, tables=3\) needs 288$"):
        canary_records_from_bytes(data[:-8])
    with pytest.raises(ValueError, match=r"^kv-canary: canary_records_from_bytes needs a whole number of int64 words"):
        canary_records_from_bytes(data[:-3])
    swapped = b"".join(data[i : i + 8][::-1] for i in range(0, len(data), 8))  # another byte order
    with pytest.raises(ValueError, match=r"^kv-canary: canary_records_from_bytes records header magic is 0x4B5643414E415259"):
        canary_records_from_bytes(swapped)
    with pytest.raises(TypeError, match=r"^kv-canary: canary_records_to_bytes"):
        canary_records_to_bytes(records.to(torch.int32))


# ----------------------------------------------------------------------------- properties vs the oracle


@st.composite
def copy_cases(draw, max_tables=5):
    num_slots = draw(st.integers(2, 10))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=max_tables))
    n = draw(st.integers(0, 12))
    slot = st.integers(-2, num_slots - 1)
    src = draw(st.lists(slot, min_size=n, max_size=n))
    dst = draw(st.lists(slot, min_size=n, max_size=n))
    num_valid = draw(st.one_of(st.none(), st.integers(-1, n + 2)))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    seed = draw(st.integers(0, 2**16))
    return make_tables(num_slots, kinds=kinds, seed=seed), src, dst, num_valid, dtype


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(copy_cases())
def test_property_copy_twin_and_launcher_match_oracle(case):
    tables, src, dst, num_valid, dtype = case
    for impl in ("twin", "launcher"):
        check_copy(impl, tables, src, dst, num_valid, dtype)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(copy_cases(), st.data())
def test_property_export_import_match_oracle(case, data):
    tables, slots, dst, _nv, dtype = case
    records = export_canary_records_torch_reference(canary_bufs=tuple(tables), slots=torch.tensor(slots, dtype=dtype))
    assert records.tolist() == oracle_export([words(t) for t in tables], slots)
    received = make_tables(tables[0].shape[0], kinds=[_kind(t) for t in tables], seed=data.draw(st.integers(0, 99)))
    want, copied = oracle_import([words(t) for t in received], dst, records[1:].tolist())
    arr, slot_c, kern_c = counters()
    import_canary_records(canary_bufs=tuple(received), slots=torch.tensor(dst, dtype=dtype),
                          records=canary_records_from_bytes(canary_records_to_bytes(records)),
                          slot_run_counter=slot_c, kernel_run_counter=kern_c)
    assert [words(t) for t in received] == want
    assert arr.tolist() == [-5, 70 + copied, -6, 41, -7]


def _kind(t: torch.Tensor) -> str:
    return "i64x5" if t.dtype == torch.int64 else f"u8x{t.shape[1]}"


# ----------------------------------------------------------------------------- Triton parity (interpreter)


@needs_interpreter
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(copy_cases())
def test_property_triton_interpreter_matches_twin(case):
    tables, src, dst, num_valid, dtype = case
    a, arr_a = run_copy("twin", tables, src, dst, num_valid, dtype)
    b, arr_b = run_copy("triton", tables, src, dst, num_valid, dtype)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(arr_a, arr_b)
    s = torch.tensor(src, dtype=dtype)
    ra = export_canary_records_torch_reference(canary_bufs=tuple(tables), slots=s)
    rb = triton_copy.launch_export_records(canary_bufs=tuple(tables), slots=s)
    assert torch.equal(ra, rb)
    ia, ib = [t.clone() for t in tables], [t.clone() for t in tables]
    d = torch.tensor(dst, dtype=dtype)
    import_canary_records_torch_reference(canary_bufs=tuple(ia), slots=d, records=ra)
    triton_copy.launch_import_records(canary_bufs=tuple(ib), slots=d, records=ra)
    assert all(torch.equal(x, y) for x, y in zip(ia, ib))


@needs_interpreter
def test_triton_interpreter_many_blocks_with_aliasing_and_duplicates():
    """Several programs: chains, swaps and duplicates across block boundaries."""
    num_slots, n = 4096, 3000
    tables = make_tables(num_slots, seed=15)
    g = torch.Generator().manual_seed(16)
    src = torch.randint(-5, num_slots, (n,), generator=g)
    dst = torch.randint(-5, num_slots, (n,), generator=g)
    dst[2000:2600] = src[:600]  # sources rewritten by later entries in other blocks
    dst[2600:] = dst[:400]  # duplicates across blocks
    for nv in (None, 2777):
        a, arr_a = run_copy("twin", tables, src.tolist(), dst.tolist(), nv)
        b, arr_b = run_copy("triton", tables, src.tolist(), dst.tolist(), nv)
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(arr_a, arr_b)


@needs_interpreter
def test_triton_kernels_treat_out_of_range_slots_as_padding():
    """What a captured launch (no host range check) does with a bad slot: never stores it."""
    tables = make_tables(8, seed=17)
    tabs = [t.clone() for t in tables]
    arr, slot_c, kern_c = counters()
    triton_copy.launch_copy_slots(canary_bufs=tuple(tabs), src_slots=torch.tensor([1, 9, 2]),
                                  dst_slots=torch.tensor([8, 3, 4]), slot_run_counter=slot_c, kernel_run_counter=kern_c)
    want, _ = oracle_copy([words(t) for t in tables], [0, 0, 2], [0, 0, 4])
    assert [words(t) for t in tabs] == want and arr.tolist() == [-5, 71, -6, 41, -7]
    records = triton_copy.launch_export_records(canary_bufs=tuple(tables), slots=torch.tensor([8, 1]))
    assert records[1].tolist() == [0] * 12 and records[2].tolist() == [w for t in tables for w in words(t)[1]]


# ----------------------------------------------------------------------------- real GPU


@needs_cuda
@pytest.mark.parametrize("seed", range(4))
def test_gpu_triton_matches_twin(seed):
    num_slots, n = 50_000, 40_000
    tables = [t.cuda() for t in make_tables(num_slots, kinds=KINDS + ("u8x32", "u8x32"), seed=seed)]
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(-100, num_slots, (n,), generator=g)
    dst = torch.randint(-100, num_slots, (n,), generator=g)
    dst[30_000:] = src[:10_000]
    src, dst = src.cuda(), dst.cuda()
    outs = []
    for impl in (canary_copy_slots_torch_reference, triton_copy.launch_copy_slots):
        tabs = [t.clone() for t in tables]
        cnt = torch.zeros(2, dtype=torch.int64, device="cuda")
        impl(canary_bufs=tuple(tabs), src_slots=src, dst_slots=dst,
             num_valid=torch.tensor([37_123], dtype=torch.int32, device="cuda"),
             slot_run_counter=cnt[0:1], kernel_run_counter=cnt[1:2])
        outs.append((tabs, cnt))
    (a, ca), (b, cb) = outs
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(ca, cb)
    ra = export_canary_records_torch_reference(canary_bufs=tuple(tables), slots=src)
    rb = triton_copy.launch_export_records(canary_bufs=tuple(tables), slots=src)
    assert torch.equal(ra, rb)
    ia, ib = [t.clone() for t in tables], [t.clone() for t in tables]
    import_canary_records_torch_reference(canary_bufs=tuple(ia), slots=dst, records=ra)
    triton_copy.launch_import_records(canary_bufs=tuple(ib), slots=dst, records=ra)
    ic = [t.clone() for t in tables]
    import_canary_records(canary_bufs=tuple(ic), slots=dst, records=ra.cpu())  # from host memory
    assert all(torch.equal(x, y) for x, y in zip(ia, ic))
    assert all(torch.equal(x, y) for x, y in zip(ia, ib))


@needs_cuda
def test_gpu_copy_and_export_replay_in_a_cuda_graph():
    num_slots, cap = 4096, 1024
    tables = [t.cuda() for t in make_tables(num_slots, seed=5)]
    reference = [t.clone() for t in tables]
    src = torch.zeros(cap, dtype=torch.int64, device="cuda")
    dst = torch.zeros(cap, dtype=torch.int64, device="cuda")
    nv = torch.zeros(1, dtype=torch.int32, device="cuda")
    cnt = torch.zeros(2, dtype=torch.int64, device="cuda")
    args = dict(canary_bufs=tuple(tables), src_slots=src, dst_slots=dst, num_valid=nv,
                slot_run_counter=cnt[0:1], kernel_run_counter=cnt[1:2])
    launch_canary_copy_slots_kernel(**args)  # warm-up (compiles)
    export_canary_records(canary_bufs=tuple(tables), slots=src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_canary_copy_slots_kernel(**args)
        exported = export_canary_records(canary_bufs=tuple(tables), slots=src)
    g = torch.Generator().manual_seed(6)
    ref_cnt = cnt.clone()
    for step in range(3):
        k = 300 + 200 * step
        s = torch.randint(1, num_slots, (cap,), generator=g)
        d = torch.randint(1, num_slots, (cap,), generator=g)
        src.copy_(s.cuda()); dst.copy_(d.cuda()); nv.fill_(k)
        graph.replay()
        canary_copy_slots_torch_reference(canary_bufs=tuple(reference), src_slots=s.cuda(), dst_slots=d.cuda(),
                                          num_valid=nv.clone(), slot_run_counter=ref_cnt[0:1], kernel_run_counter=ref_cnt[1:2])
        assert all(torch.equal(x, y) for x, y in zip(tables, reference)) and torch.equal(cnt, ref_cnt)
        assert torch.equal(exported, export_canary_records_torch_reference(canary_bufs=tuple(reference), slots=s.cuda()))
