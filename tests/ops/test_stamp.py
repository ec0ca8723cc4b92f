"""The stamp op (``launch_stamp_violation_rows``): hand cases built with the real plan / verify /
write twins on real buffers, then corrupted; launcher errors.

Each scenario prefills a small request table through plan + write, runs one decode step (plan,
verify with the token check, write with the input assert) under one launch tag, and stamps the
rows that step appended. ``SCENARIOS`` is reused by the interpreter suite (twin vs Triton).
Stacked rings ([k, cap, 8], shared plans) are built from the scenarios and checked against one
single-ring call per ring, on the twin and on the Triton kernel under the interpreter.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from kvcanary.ops import (
    CanaryLaunchTag,
    FailReason,
    RealKvHashMode,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel_torch_reference,
    launch_stamp_violation_rows,
    stamp_violation_rows_torch_reference,
)
from kvcanary.ops.constants import VIOLATION_FIELD_FAIL_REASON_BITS, WRITE_FAIL_REASONS

from .triton_cases import clone_context, make_case, run_plan

SENTINEL = -55
STEP = 41


def _context(num_slots: int, ring_cap: int) -> VerifyOrWriteContext:
    return VerifyOrWriteContext(
        canary_buf=torch.zeros(num_slots, 32, dtype=torch.uint8), kernel_kind=CanaryLaunchTag.HEAD_K_FULL,
        violation_ring=torch.full((ring_cap, 8), -77, dtype=torch.int64),
        violation_write_index=torch.zeros(1, dtype=torch.int32),
        slot_run_counter=torch.zeros(1, dtype=torch.int64), kernel_run_counter=torch.zeros(1, dtype=torch.int64),
        real_kv_sources=(), real_kv_hash_mode=RealKvHashMode.NONE,
        enable_chain_position_assert=torch.ones(1, dtype=torch.int32),
    )


@dataclass
class World:
    """A request table (rows x positions -> slots), the tokens each position holds, one canary
    buffer and ring; ``step`` runs plan -> verify -> write the way a forward would."""

    rtt: torch.Tensor                 # int32 [max_reqs, max_len]
    tokens: torch.Tensor              # int32 [max_reqs, max_len]
    ctx: VerifyOrWriteContext
    window: int = 0
    itype: torch.dtype = torch.int64
    last: dict = field(default_factory=dict)

    @classmethod
    def make(cls, *, max_reqs=5, max_len=24, ring_cap=32, window=0, itype=torch.int64, seed=0):
        g = torch.Generator().manual_seed(seed)
        num_slots = max_reqs * max_len + 8
        rtt = (torch.randperm(num_slots - 8, generator=g)[: max_reqs * max_len] + 8).reshape(max_reqs, max_len)
        tokens = torch.randint(100, 50000, (max_reqs, max_len), generator=g)
        return cls(rtt=rtt.to(torch.int32), tokens=tokens.to(torch.int32), ctx=_context(num_slots, ring_cap),
                   window=window, itype=itype)

    def plan(self, rows, prefix, extend, *, valid=None):
        bs = len(rows)
        vp, wp = VerifyPlan.allocate(256, "cpu"), WritePlan.allocate(max(bs, 1), "cpu")
        t = lambda v: torch.tensor(v, dtype=self.itype)  # noqa: E731
        launch_canary_plan_kernels_torch_reference(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=t(rows), prefix_lens=t(prefix),
            extend_seq_lens=t(extend), req_to_token=self.rtt, swa_window_size=self.window,
            full_to_swa_index_mapping=None, verify_capacity=256, req_to_verify_expected_tokens=self.tokens,
            req_to_verify_expected_tokens_valid_lens=t(valid if valid is not None else [p + e for p, e in zip(prefix, extend)]),
            kv_token_id_vs_position_offset=0,
        )
        return vp, wp

    def write_inputs(self, rows, prefix, extend):
        ids, pos, loc = [], [], []
        for r, p, e in zip(rows, prefix, extend):
            if r == 0 or e <= 0:
                continue
            for q in range(p, p + e):
                ids.append(int(self.tokens[r, q]))
                pos.append(q)
                loc.append(int(self.rtt[r, q]))
        t = lambda v: torch.tensor(v, dtype=self.itype)  # noqa: E731
        return t(ids), t(pos), t(loc)

    def write(self, wp, rows, prefix, extend, *, expected_tokens=None, loc_override=None, pos_override=None):
        ids, pos, loc = self.write_inputs(rows, prefix, extend)
        if loc_override:
            for i, s in loc_override.items():
                loc[i] = s
        if pos_override:
            for i, q in pos_override.items():
                pos[i] = q
        assert_on = expected_tokens is not None
        launch_canary_write_kernel_torch_reference(
            context=self.ctx, plan=wp, input_ids=ids, positions=pos, out_cache_loc=loc,
            enable_write_input_assert=assert_on, expected_input_tokens=expected_tokens if assert_on else None,
            expected_input_positions=pos.clone() if assert_on else None,
        )
        return ids, pos, loc

    def prefill(self, rows, lengths, prefix=None):
        prefix = prefix or [0] * len(rows)
        _vp, wp = self.plan(rows, prefix, [n - p for n, p in zip(lengths, prefix)])
        self.write(wp, rows, prefix, [n - p for n, p in zip(lengths, prefix)])

    def decode(self, rows, prefix, *, bad_tokens=(), loc_override=None, pos_override=None):
        """One step (verify + write one token per row) under one tag; returns stamp kwargs."""
        extend = [1 if r != 0 else 0 for r in rows]
        rows_from = self.ctx.violation_write_index.clone()
        vp, wp = self.plan(rows, prefix, extend)
        launch_canary_verify_kernel_torch_reference(context=self.ctx, plan=vp, check_verify_expected_token=True)
        ids, _, _ = self.write_inputs(rows, prefix, extend)
        expected = ids.clone()
        for i in bad_tokens:
            expected[i] += 1
        _ids, pos, loc = self.write(wp, rows, prefix, extend, expected_tokens=expected, loc_override=loc_override,
                                    pos_override=pos_override)
        t = lambda v: torch.tensor(v, dtype=self.itype)  # noqa: E731
        return dict(
            violation_ring=self.ctx.violation_ring, violation_write_index=self.ctx.violation_write_index,
            rows_from=rows_from.to(torch.int32), step=torch.tensor([STEP]), verify_plan=vp, write_plan=wp,
            out_cache_loc=loc, positions=pos, req_pool_indices=t(rows), prefix_lens=t(prefix),
            swa_window_size=self.window,
        )

    def corrupt(self, rp: int, position: int, field: int = 0) -> int:
        """Flip one field of the record of request row ``rp`` at ``position``; returns the slot."""
        slot = int(self.rtt[rp, position])
        self.ctx.canary_buf.view(torch.int64)[slot, field] ^= 1
        return slot


def stamp(kwargs: dict, impl=stamp_violation_rows_torch_reference) -> torch.Tensor:
    cap = kwargs["violation_ring"].shape[0]
    out = torch.full((cap, 3), SENTINEL, dtype=torch.int64)
    impl(stamps=out, **kwargs)
    return out


def _rows(kwargs) -> list:
    lo = int(kwargs["rows_from"][0])
    hi = min(int(kwargs["violation_write_index"][0]), kwargs["violation_ring"].shape[0])
    return kwargs["violation_ring"][lo:hi].tolist()


# --------------------------------------------------------------------------- scenarios


def scenario_shared_prefix():
    """Rows 1 and 2 share their first 4 slots; a token flip at position 2 is read by both."""
    w = World.make()
    w.rtt[2, :4] = w.rtt[1, :4]
    w.tokens[2, :4] = w.tokens[1, :4]
    w.prefill([1], [6])
    w.prefill([2], [5], prefix=[4])
    w.corrupt(1, 2)
    kw = w.decode([1, 2], [6, 5])
    # plan order: row 0 = positions 0..5 of request row 1, row 1 = positions 0..4 of row 2
    return kw, [(0, 2), (0, 3), (1, 2), (1, 3)]


def scenario_redirected_slot():
    """Request row 1's position 5 points at the slot request row 2 holds at position 3: the
    row with the position bit belongs to row 1 (batch row 1), not to row 2's own entry."""
    w = World.make(seed=1)
    w.prefill([1, 2], [8, 8])
    w.rtt[1, 5] = w.rtt[2, 3]
    kw = w.decode([2, 1], [8, 8])
    rows = _rows(kw)
    redirected = int(w.rtt[2, 3])
    want = []
    for r in rows:
        if r[1] == redirected and r[7] & FailReason.VERIFY_POSITION_MISMATCH:
            want.append((1, 5))
        elif r[1] == redirected:
            want.append((0, 3))
        elif r[2] == 6:  # position 6 of row 1 chains from the redirected slot
            want.append((1, 6))
        else:
            want.append(None)
    return kw, want


def scenario_swa_window():
    """Window 4: each row verifies positions [P - 4, P); a flip at position 8 of the second row."""
    w = World.make(window=4, seed=2)
    w.prefill([3, 4], [10, 10])
    w.corrupt(4, 8, field=1)  # stored position 8 -> 9: position row at 8, chain row at 9
    kw = w.decode([3, 4], [10, 10])
    return kw, [(1, 8), (1, 9)]


def scenario_padding_rows():
    """A padding row (request row 0) between two requests contributes no entries."""
    w = World.make(seed=3, itype=torch.int32)
    w.prefill([1, 2], [7, 7])
    w.corrupt(2, 4)
    kw = w.decode([1, 0, 2], [7, 7, 7])
    return kw, [(2, 4), (2, 5)]


def scenario_write_rows():
    """Input-assert rows of the second and third requests (write rows: expected position -1)."""
    w = World.make(seed=4)
    w.prefill([1, 2, 3], [5, 6, 7])
    kw = w.decode([1, 2, 3], [5, 6, 7], bad_tokens=(1, 2))
    return kw, [(1, -1), (2, -1)]


def scenario_mixed_ring():
    """Verify rows, then write rows (a chain-position row follows the input-assert row)."""
    w = World.make(seed=5)
    w.prefill([1, 2], [6, 6])
    w.corrupt(2, 1)
    kw = w.decode([1, 2], [6, 6], bad_tokens=(0,), pos_override={1: 9})
    rows = _rows(kw)
    assert any(r[7] & 24 for r in rows) and any(not r[7] & 24 for r in rows)
    want = []
    for r in rows:
        if r[7] & 24:
            want.append((0, -1) if r[2] == 6 and r[7] & FailReason.WRITE_TOKEN_MISMATCH else (1, -1))
        else:
            want.append((1, r[2]))
    return kw, want


def scenario_rows_from_middle():
    """Rows of an earlier step stay as they are: only the new step's rows are stamped (the first
    flip is still there and read again)."""
    w = World.make(seed=6)
    w.prefill([1, 2], [6, 6])
    w.corrupt(1, 3)
    w.decode([1, 2], [6, 6])
    w.prefill([1, 2], [7, 7], prefix=[6, 6])
    w.corrupt(2, 2)
    kw = w.decode([1, 2], [7, 7])
    assert int(kw["rows_from"][0]) > 0
    return kw, [(0, 3), (0, 4), (1, 2), (1, 3)]


def scenario_ring_overflow():
    """More rows than the ring holds: rows up to the capacity are stamped, nothing past it."""
    w = World.make(seed=7, ring_cap=3)
    w.prefill([1, 2], [6, 6])
    for q in (0, 2, 4):
        w.corrupt(1, q)
    kw = w.decode([1, 2], [6, 6])
    assert int(kw["violation_write_index"][0]) > 3
    return kw, [(0, 0), (0, 1), (0, 2)]


def scenario_sweep_without_plans():
    """A sweep tag: no plans, every row gets (step, -1, -1)."""
    w = World.make(seed=8)
    w.prefill([1], [6])
    w.corrupt(1, 3)
    kw = w.decode([1], [6])
    for k in ("verify_plan", "write_plan", "out_cache_loc", "positions", "req_pool_indices", "prefix_lens"):
        kw[k] = None
    kw["swa_window_size"] = 0
    return kw, [(-1, -1)] * len(_rows(kw))


SCENARIOS = {
    name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")
}


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario(name):
    kw, want = SCENARIOS[name]()
    rows = _rows(kw)
    assert rows, "the scenario must produce violation rows"
    assert len(want) == len(rows), (rows, want)
    out = stamp(kw)
    lo = int(kw["rows_from"][0])
    cap = kw["violation_ring"].shape[0]
    hi = min(int(kw["violation_write_index"][0]), cap)
    assert (out[:lo] == SENTINEL).all() and (out[hi:] == SENTINEL).all()
    got = [tuple(x) for x in out[lo:hi].tolist()]
    for g, wnt, row in zip(got, want, rows):
        assert g[0] == STEP
        if wnt is not None:
            assert g[1:] == wnt, (g, wnt, row)


def test_launcher_matches_twin_and_leaves_inputs():
    kw, _ = scenario_mixed_ring()
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    a = stamp(kw)
    b = stamp(kw, impl=launch_stamp_violation_rows)
    assert torch.equal(a, b)
    for k, v in before.items():
        assert torch.equal(kw[k], v), k


def test_no_rows_writes_nothing():
    w = World.make(seed=9)
    w.prefill([1], [6])
    kw = w.decode([1], [6])
    assert int(kw["violation_write_index"][0]) == int(kw["rows_from"][0])
    assert (stamp(kw) == SENTINEL).all()
    kw["rows_from"] = kw["violation_write_index"] + 3  # past the index: nothing either
    assert (stamp(kw) == SENTINEL).all()


def _good_args():
    kw, _ = scenario_write_rows()
    kw["stamps"] = torch.zeros(kw["violation_ring"].shape[0], 3, dtype=torch.int64)
    return kw


@pytest.mark.parametrize("change,exc,msg", [
    (dict(violation_ring=torch.zeros(4, 7, dtype=torch.int64)), ValueError, "violation_ring must be int64 [cap, 8]"),
    (dict(violation_ring=torch.zeros(32, 8, dtype=torch.int32)), TypeError, "violation_ring must be torch.int64"),
    (dict(violation_write_index=torch.zeros(1, dtype=torch.int64)), TypeError, "violation_write_index must be torch.int32"),
    (dict(rows_from=torch.zeros(2, dtype=torch.int32)), ValueError, "rows_from must hold exactly 1"),
    (dict(step=torch.zeros(1, dtype=torch.int32)), TypeError, "step must be torch.int64"),
    (dict(stamps=torch.zeros(31, 3, dtype=torch.int64)), ValueError, "stamps must be int64 [cap, 3]"),
    (dict(stamps=torch.zeros(3, 32, dtype=torch.int64).t()), ValueError, "stamps must be contiguous"),
    (dict(swa_window_size=True), TypeError, "swa_window_size must be an int"),
    (dict(prefix_lens=None), ValueError, "needs req_pool_indices and prefix_lens with verify_plan"),
    (dict(positions=None), ValueError, "needs out_cache_loc and positions with write_plan"),
    (dict(positions=torch.zeros(1, dtype=torch.int64)), ValueError, "positions has 1 entries"),
    (dict(out_cache_loc=torch.zeros(3, dtype=torch.int16)), TypeError, "out_cache_loc must be torch.int32 or torch.int64"),
    (dict(verify_plan=object()), TypeError, "plan must be a VerifyPlan"),
])
def test_launcher_errors(change, exc, msg):
    kw = _good_args()
    kw.update(change)
    stamps_before = kw["stamps"].clone()
    with pytest.raises(exc, match="^kv-canary: launch_stamp_violation_rows") as info:
        launch_stamp_violation_rows(**kw)
    assert msg in str(info.value)
    assert torch.equal(kw["stamps"], stamps_before) or kw["stamps"].shape != stamps_before.shape


def test_twin_is_lenient_without_plans_or_batch_tensors():
    kw, _ = scenario_shared_prefix()
    kw["prefix_lens"] = None  # verify rows cannot be attributed: (step, -1, -1), no error
    out = stamp(kw)
    lo, hi = int(kw["rows_from"][0]), int(kw["violation_write_index"][0])
    assert out[lo:hi].tolist() == [[STEP, -1, -1]] * (hi - lo)


# --------------------------------------------------------------------------- stacked rings

PAD = 1  # the stack is rows [PAD, PAD + k) of larger ring / stamp tensors, the counts slices of larger ones


def stacked(kw: dict) -> dict:
    """Four rings sharing ``kw``'s plans, as ``[4, cap, 8]`` and ``[4]`` slices of larger tensors:
    ring 0 is ``kw``'s ring; ring 1 has only older rows (index == rows_from == 3); ring 2 has the
    step's new rows reversed after two older ones (rows_from 2, index maybe past cap); ring 3 only
    the new write rows (index 0 when there are none)."""
    ring = kw["violation_ring"]
    cap = ring.shape[0]
    lo, index = int(kw["rows_from"][0]), int(kw["violation_write_index"][0])
    new = ring[lo:min(index, cap)]
    writes = new[(new[:, VIOLATION_FIELD_FAIL_REASON_BITS] & WRITE_FAIL_REASONS) != 0]
    big = torch.full((PAD + 5, cap, 8), -77, dtype=torch.int64)
    rings = big[PAD:PAD + 4]
    rings[0] = ring
    rings[1, :3] = ring[:3]
    rings[2, :2] = ring[:2]
    rev = new.flip(0)[: max(cap - 2, 0)]
    rings[2, 2:2 + rev.shape[0]] = rev
    rings[3, : writes.shape[0]] = writes
    counts = torch.full((2 * PAD + 9,), 99, dtype=torch.int32)
    ends, starts = counts[PAD:PAD + 4], counts[PAD + 5:PAD + 9]
    ends.copy_(torch.tensor([index, 3, 2 + new.shape[0], writes.shape[0]]))
    starts.copy_(torch.tensor([lo, 3, 2, 0]))
    return {**kw, "violation_ring": rings, "violation_write_index": ends, "rows_from": starts}


def stamp_stacked(kw: dict, impl=stamp_violation_rows_torch_reference) -> torch.Tensor:
    """Stamps of one stacked call, into a ``[k, cap, 3]`` slice of a larger sentinel tensor
    (the rows around the slice are checked untouched)."""
    k, cap = kw["violation_ring"].shape[:2]
    big = torch.full((PAD + k + 1, cap, 3), SENTINEL, dtype=torch.int64)
    impl(stamps=big[PAD:PAD + k], **kw)
    assert (big[:PAD] == SENTINEL).all() and (big[PAD + k:] == SENTINEL).all()
    return big[PAD:PAD + k]


def stamp_per_ring(kw: dict) -> torch.Tensor:
    """Stamps of one single-ring twin call per ring of a stacked ``kw``."""
    rings, ends, starts = kw["violation_ring"], kw["violation_write_index"], kw["rows_from"]
    out = torch.full((rings.shape[0], rings.shape[1], 3), SENTINEL, dtype=torch.int64)
    for t in range(rings.shape[0]):
        stamp_violation_rows_torch_reference(**{**kw, "violation_ring": rings[t].clone(), "stamps": out[t],
                                                "violation_write_index": ends[t:t + 1].clone(),
                                                "rows_from": starts[t:t + 1].clone()})
    return out


def _tensors(kw: dict) -> dict:
    return {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}


def _check_stacked_rows(kw: dict, want: torch.Tensor) -> None:
    """The per-ring reference stamps what the stacked case was built for."""
    cap = want.shape[1]
    assert (want[0] != SENTINEL).any() and (want[1] == SENTINEL).all()
    end2 = min(cap, int(kw["violation_write_index"][2]))
    assert (want[2, :2] == SENTINEL).all() and (want[2, 2:end2] != SENTINEL).all()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_stacked_matches_per_ring_calls(name):
    kw = stacked(SCENARIOS[name]()[0])
    before = _tensors(kw)
    want = stamp_per_ring(kw)
    _check_stacked_rows(kw, want)
    single, _ = SCENARIOS[name]()
    assert torch.equal(want[0], stamp(single))
    for impl in (stamp_violation_rows_torch_reference, launch_stamp_violation_rows):
        got = stamp_stacked(kw, impl)
        assert torch.equal(got, want), (impl.__name__, got, want)
    for k, v in before.items():
        assert torch.equal(kw[k], v), k


def test_stacked_single_ring_equals_plain_form():
    kw, _ = scenario_mixed_ring()
    one = {**kw, "violation_ring": kw["violation_ring"][None],
           "violation_write_index": kw["violation_write_index"].clone(), "rows_from": kw["rows_from"].clone()}
    assert torch.equal(stamp_stacked(one, launch_stamp_violation_rows)[0], stamp(kw))


def _triton_launch_stamp():
    """``launch_stamp`` run by the Triton interpreter on CPU tensors (skips without it)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported")
    pytest.importorskip("triton")
    from . import test_triton_interpret  # noqa: F401  (its import patches the interpreter for numpy >= 2.4)
    from kvcanary.ops.triton import launch_stamp

    return launch_stamp


def fuzz_stamp_args(seed: int, nsrc: int, step: int, *, rows_from_shift: int = 0) -> dict:
    """Stamp arguments of a fuzz case (random buffer: many rows, ring overflow at times) after its plan, twin
    verify and twin write; ``rows_from`` is the index before them (plus ``rows_from_shift``). Skips the test
    when the case's plan raises."""
    case = make_case(seed, mode=seed % 3, nsrc=nsrc)
    _, err, (vp, wp) = run_plan(launch_canary_plan_kernels_torch_reference, case)
    if err is not None:
        pytest.skip("plan raised for this case")
    ctx = clone_context(case.ctx)
    rows_from = ctx.violation_write_index.clone()
    launch_canary_verify_kernel_torch_reference(context=ctx, plan=vp, check_verify_expected_token=True)
    launch_canary_write_kernel_torch_reference(context=ctx, plan=wp, **case.write_kwargs)
    return dict(
        violation_ring=ctx.violation_ring, violation_write_index=ctx.violation_write_index,
        rows_from=rows_from + rows_from_shift, step=torch.tensor([step]), verify_plan=vp, write_plan=wp,
        out_cache_loc=case.write_kwargs["out_cache_loc"], positions=case.write_kwargs["positions"],
        req_pool_indices=case.plan_kwargs["req_pool_indices"], prefix_lens=case.plan_kwargs["prefix_lens"],
        swa_window_size=case.plan_kwargs["swa_window_size"],
    )


def _fuzz_stacked(seed: int) -> dict:
    """A stacked case from the interpreter suite's fuzz batches (many rows, ring overflow at times)."""
    kw = fuzz_stamp_args(seed, seed % 2, 2000 + seed)
    if int(kw["violation_write_index"][0]) == int(kw["rows_from"][0]):
        pytest.skip("no violation rows for this case")
    return stacked(kw)


FUZZ_SEEDS = (0, 1, 3, 4, 5, 7, 8, 10)  # make_case seeds whose step appends violation rows


@pytest.mark.parametrize("case", [f"scenario:{n}" for n in sorted(SCENARIOS)] + [f"fuzz:{s}" for s in FUZZ_SEEDS])
def test_triton_stacked_matches_twin(case):
    launch_stamp = _triton_launch_stamp()
    kind, arg = case.split(":")
    kw = stacked(SCENARIOS[arg]()[0]) if kind == "scenario" else _fuzz_stacked(int(arg))
    before = _tensors(kw)
    want = stamp_per_ring(kw)
    got = stamp_stacked(kw, launch_stamp)
    assert torch.equal(got, want), (got, want)
    for k, v in before.items():
        assert torch.equal(kw[k], v), k


def _stacked_good_args() -> dict:
    kw = stacked(scenario_write_rows()[0])
    kw["stamps"] = torch.full((4, kw["violation_ring"].shape[1], 3), SENTINEL, dtype=torch.int64)
    return kw


@pytest.mark.parametrize("change,exc,msg", [
    (dict(violation_ring=torch.zeros(2, 4, 32, 8, dtype=torch.int64)), ValueError,
     "violation_ring must be int64 [cap, 8] or [k, cap, 8]"),
    (dict(violation_ring=torch.zeros(4, 32, 7, dtype=torch.int64)), ValueError, "got shape (4, 32, 7)"),
    (dict(violation_ring=torch.zeros(0, 32, 8, dtype=torch.int64)), ValueError, "with k >= 1, got shape (0, 32, 8)"),
    (dict(violation_ring=torch.zeros(4, 64, 8, dtype=torch.int64)[:, ::2]), ValueError,
     "violation_ring must be contiguous"),
    (dict(violation_ring=torch.zeros(4, 32, 8, dtype=torch.int32)), TypeError, "violation_ring must be torch.int64"),
    (dict(violation_write_index=torch.zeros(1, dtype=torch.int32)), ValueError,
     "violation_write_index must hold exactly k=4 elements (one per ring of violation_ring (4, 32, 8)), got shape (1,)"),
    (dict(rows_from=torch.zeros(5, dtype=torch.int32)), ValueError, "rows_from must hold exactly k=4 elements"),
    (dict(rows_from=torch.zeros(8, dtype=torch.int32)[::2]), ValueError, "rows_from must be contiguous"),
    (dict(violation_write_index=torch.zeros(4, dtype=torch.int64)), TypeError,
     "violation_write_index must be torch.int32"),
    (dict(stamps=torch.zeros(32, 3, dtype=torch.int64)), ValueError,
     "stamps must be int64 [k, cap, 3] = [4, 32, 3] for violation_ring (4, 32, 8), got shape (32, 3)"),
    (dict(stamps=torch.zeros(3, 32, 3, dtype=torch.int64)), ValueError, "got shape (3, 32, 3)"),
    (dict(stamps=torch.zeros(4, 31, 3, dtype=torch.int64)), ValueError, "got shape (4, 31, 3)"),
    (dict(stamps=torch.zeros(4, 3, 32, dtype=torch.int64).transpose(1, 2)), ValueError, "stamps must be contiguous"),
    (dict(stamps=torch.zeros(4, 32, 3, dtype=torch.int32)), TypeError, "stamps must be torch.int64"),
])
def test_stacked_launcher_errors(change, exc, msg):
    kw = _stacked_good_args()
    kw.update(change)
    stamps_before = kw["stamps"].clone()
    with pytest.raises(exc, match="^kv-canary: launch_stamp_violation_rows") as info:
        launch_stamp_violation_rows(**kw)
    assert msg in str(info.value), str(info.value)
    assert torch.equal(kw["stamps"], stamps_before)


def test_stacked_good_args_stamp():
    """The base of ``test_stacked_launcher_errors`` is valid: it stamps without error."""
    kw = _stacked_good_args()
    launch_stamp_violation_rows(**kw)
    assert (kw["stamps"] != SENTINEL).any()
