"""Fused runtime glue (`kvcanary.runtime.kernels`): each Triton launcher vs its torch twin under the
Triton interpreter (CPU tensors, TRITON_INTERPRET=1), bit for bit — token rows, slot records, sweep
slices — on seeded random inputs with the edge cases named in each test, then the runtime end to end
on the Triton launchers (``dispatch.selected_backend("triton")``) against the runtime on the twins."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it on machines without a GPU
    pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcanary.ops import VerifyPlan  # noqa: E402
from kvcanary.runtime import kernels  # noqa: E402
from kvcanary.runtime.groups import NEVER_WRITTEN, SlotRecords  # noqa: E402
from kvcanary.runtime.sweep import OWNER_HISTORY  # noqa: E402
from kvcanary.ops.dispatch import selected_backend  # noqa: E402
from tests.ops.test_triton_interpret import _numpy_scalar_index_fix  # noqa: E402
from tests.runtime.conftest import make_sim, warm_sim  # noqa: E402
from tests.runtime.kernel_cases import (  # noqa: E402
    SweepState,
    assert_same,
    chained_records,
    random_offsets,
    random_records,
    random_write,
    records_like,
    records_state,
)
from tests.triton_variants import record_variants  # noqa: E402


# ---- token rows ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_token_rows_match_twin(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    cap = 40
    for bs in (0, 1, 2, 7, 33, cap):
        offsets = random_offsets(gen, bs, cap)
        total = int(offsets[bs])
        for n in {1, max(total, 1), total + 5, 1500}:  # padding tokens past the write range; several programs
            got = kernels.launch_token_rows(offsets, bs, n)
            want = kernels.token_rows_twin(offsets, bs, n, torch.arange(n))
            for g, w, name in zip(got, want, ("row", "local", "valid")):
                assert g.dtype == w.dtype and torch.equal(g, w), f"{name} bs={bs} n={n}"


@pytest.mark.parametrize("seed", range(4))
def test_token_rows_with_step_prologue_match_twin(seed: int) -> None:
    """The prologue folded into the token_rows launch (ring marks, request rows at ``step % H`` — negative
    steps wrap like torch.remainder —, the disabled-plan count) equals its torch ops; more rows than tokens
    and more tokens than rows both covered."""
    gen = torch.Generator().manual_seed(seed)
    for bs, max_rows, n, rings, step in ((3, 5, 40, 5, 7), (40, 1500, 12, 12, -3), (7, 64, 2000, 3, 1029)):
        offsets = random_offsets(gen, bs, max_rows)
        outs = []
        for fused in (False, True):
            g2 = torch.Generator().manual_seed(seed * 7 + bs)
            p = kernels.StepPrologue(
                rows_from=torch.randint(0, 9, (rings,), generator=g2, dtype=torch.int32),
                write_index=torch.randint(0, 99, (rings,), generator=g2, dtype=torch.int32),
                row_history=torch.randint(0, 9, (6, max_rows), generator=g2),
                step=torch.tensor([step]), rows=torch.randint(0, 50, (max_rows,), generator=g2),
                disabled=torch.randint(0, 5, (3,), generator=g2)[1:2],
                enable=torch.randint(0, 2, (1,), generator=g2, dtype=torch.int32))
            got = (kernels.launch_token_rows(offsets, bs, n, p) if fused
                   else kernels.token_rows(offsets, bs, n, torch.arange(n), p))
            outs.append((got, p))
        (want, pw), (got, pg) = outs
        for g, w in zip(got[:3], want[:3]):
            assert torch.equal(g, w)
        assert got.expected is got.positions is None
        for f in ("rows_from", "row_history", "disabled"):
            assert torch.equal(getattr(pg, f), getattr(pw, f)), (f, bs)
        assert not torch.equal(pw.row_history, torch.zeros_like(pw.row_history))


def test_token_rows_unsorted_offsets_probe_like_searchsorted() -> None:
    """Offsets that are not sorted (never planned, but the kernel must not diverge): same probes, same rows."""
    gen = torch.Generator().manual_seed(11)
    for bs in (3, 5, 16, 31):
        offsets = torch.randint(0, 12, (bs + 1,), generator=gen)
        got = kernels.launch_token_rows(offsets, bs, 20)
        want = kernels.token_rows_twin(offsets, bs, 20, torch.arange(20))
        for g, w in zip(got, want):
            assert torch.equal(g, w), (offsets.tolist(), g.tolist(), w.tolist())


# ---- expected tokens (write-input assert) --------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_expected_tokens_match_twin(seed: int, table_dtype) -> None:
    """The expectation computed by the token-rows launch (`TokenOracle`) equals the twins in sequence: positions
    inside and past the history length, past the table width, negative prefixes (never planned, but the kernel
    must agree), padding tokens past the write range; int32 and int64
    histories; with the step prologue and without; and positions only (no table)."""
    gen = torch.Generator().manual_seed(seed)
    reqs, width, cap = 9, 24, 30
    table = torch.randint(-5, 30000, (reqs, width), generator=gen).to(table_dtype)
    from_history = 0
    for bs in (1, 2, 7, cap):
        offsets = random_offsets(gen, bs, cap)
        n = int(offsets[bs]) + 3
        row, local, valid = kernels.token_rows_twin(offsets, bs, n, torch.arange(n))
        prefix = torch.randint(-2, width + 4, (bs,), generator=gen)
        rows = torch.randint(0, reqs, (bs,), generator=gen)
        lens = torch.randint(0, width + 6, (bs,), generator=gen)
        ids = torch.randint(0, 30000, (n + 4,), generator=gen)  # the static buffer: longer than the batch
        oracle = kernels.TokenOracle(prefix=prefix, rows=rows, lens=lens, table=table, input_ids=ids)
        want_exp, want_pos = kernels.expected_tokens_twin(row=row, local=local, prefix=prefix, rows=rows, lens=lens,
                                                          table=table, input_ids=ids[:n])
        for prologue in (None, _prologue(gen, rows=bs)):
            got = kernels.launch_token_rows(offsets, bs, n, prologue, oracle)
            for g, w, name in zip(got, (row, local, valid, want_exp, want_pos),
                                  ("row", "local", "valid", "expected", "positions")):
                assert g.dtype == w.dtype and torch.equal(g, w), f"{name} bs={bs}"
        only = kernels.launch_token_rows(offsets, bs, n, None, dataclasses.replace(oracle, table=None))
        assert only.expected is None and torch.equal(only.positions, want_pos)
        from_history += int((got.expected != ids[:n]).sum())
    assert from_history > 0, "the cases must take tokens from the history"


def test_expected_tokens_from_a_table_the_kernel_cannot_read() -> None:
    """A history whose rows are not contiguous (a column slice): the launch still finds the rows, and the
    expectation comes from the twin, equal to the twins in sequence."""
    gen = torch.Generator().manual_seed(3)
    offsets = random_offsets(gen, 5, 8)
    n = int(offsets[5]) + 2
    row, local, _ = kernels.token_rows_twin(offsets, 5, n, torch.arange(n))
    wide = torch.randint(0, 999, (6, 40), generator=gen)
    for table in (wide[:, ::2], wide[1:, 3:29:5]):
        kw = dict(prefix=torch.randint(0, 12, (5,), generator=gen), rows=torch.randint(0, table.shape[0], (5,), generator=gen),
                  lens=torch.randint(0, 30, (5,), generator=gen), table=table,
                  input_ids=torch.randint(0, 999, (n,), generator=gen))
        got = kernels.launch_token_rows(offsets, 5, n, None, kernels.TokenOracle(**kw))
        want = kernels.expected_tokens_twin(row=row, local=local, **kw)
        assert torch.equal(got.expected, want[0]) and torch.equal(got.positions, want[1])


def _prologue(gen: torch.Generator, *, rows: int) -> kernels.StepPrologue:
    return kernels.StepPrologue(
        rows_from=torch.zeros(3, dtype=torch.int32), write_index=torch.randint(0, 9, (3,), generator=gen, dtype=torch.int32),
        row_history=torch.zeros(4, rows, dtype=torch.int64), step=torch.tensor([5]),
        rows=torch.randint(0, 9, (rows,), generator=gen), disabled=torch.zeros(1, dtype=torch.int64),
        enable=torch.ones(1, dtype=torch.int32))


# ---- slot records -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_record_write_matches_twin(seed: int) -> None:
    """Several writes in a row on random records, incl. a step repeated with another batch and one going
    back (the claim scratch is never reset: keys grow with the records' epoch, not the step)."""
    gen = torch.Generator().manual_seed(100 + seed)
    num_slots = 64
    twin = random_records(gen, num_slots)
    fused = records_like(twin, "cpu")
    cases = [(5, 4, 30, 0), (5, 6, 45, 0), (6, 1, 7, 2), (3, 9, 60, 0), (7, 2, 1, 0), (8, 12, 1100, 0), (9, 5, 40, 3)]
    for i, (step, rows, n, shift) in enumerate(cases):
        write = random_write(gen, num_slots, rows, n, step, shift)
        kernels.record_write_twin(twin, **write)
        kernels.launch_record_write(fused, **write)
        assert_same(records_state(fused), records_state(twin))
        assert fused.epoch.tolist() == [i + 1, i + 1]


def test_record_write_last_duplicate_wins_and_skips() -> None:
    """Hand case: slot 5 written three times (the last, token 4, wins, chaining from token 3's slot);
    negative and invalid (past the write range) tokens leave the slot records alone, the trash row
    included; a row's first token chains from its seed, an anchor seed from the trash row."""
    num_slots = 16
    rec = SlotRecords(num_slots, torch.device("cpu"))
    offsets = torch.tensor([0, 3, 5, 5], dtype=torch.int64)  # rows 0..2: tokens 0-2, 3-4, none; token 5 padding
    row, local, valid, _, _ = kernels.launch_token_rows(offsets, 3, 6)
    write = dict(seeds=torch.tensor([-1, num_slots + 1, 2]), row=row, local=local, valid=valid,
                 out_loc=torch.tensor([5, -1, 5, 9, 5, 7]), positions=torch.tensor([10, 11, 12, 20, 21, 99]),
                 step=torch.tensor([4]), owner_span=100)
    kernels.launch_record_write(rec, **write)
    assert rec.position[5].item() == 21 and rec.prev_slot[5].item() == 9 and rec.owner[5].item() == 401
    assert rec.position[9].item() == 20 and rec.prev_slot[9].item() == num_slots  # anchor -> trash
    assert rec.step[7].item() == NEVER_WRITTEN  # token 5 is past the write range
    assert [getattr(rec, k)[num_slots].item() for k in ("position", "prev_slot", "owner", "step")] == [NEVER_WRITTEN] * 4
    twin = SlotRecords(num_slots, torch.device("cpu"))
    kernels.record_write_twin(twin, **write)
    assert_same(records_state(rec), records_state(twin))


def test_record_write_shares_scratch_with_twin() -> None:
    """Twin and kernel alternating on the same records (a CUDA canary falls back to the twin past
    MAX_RECORD_TOKENS) still agree with the twin alone."""
    gen = torch.Generator().manual_seed(7)
    num_slots = 48
    ref, mixed = SlotRecords(num_slots, torch.device("cpu")), SlotRecords(num_slots, torch.device("cpu"))
    for i in range(6):
        write = random_write(gen, num_slots, 5, 40, step=i)
        kernels.record_write_twin(ref, **write)
        (kernels.launch_record_write if i % 2 else kernels.record_write_twin)(mixed, **write)
        assert_same(records_state(mixed), records_state(ref))


# ---- sweep slices -------------------------------------------------------------------------------------

@pytest.mark.parametrize("ticket", [True, False], ids=["ticket", "advance-kernel"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_slots,interval", [(37, 4), (300, 3), (2600, 2), (5000, 2)])
def test_sweep_slice_matches_twin(seed: int, num_slots: int, interval: int, ticket: bool) -> None:
    """Consecutive slices over a full pass and past its wrap (the last slice of a pass reaches past the slot
    space into the trash row), steps past OWNER_HISTORY; several programs when a slice exceeds a block, the cursor
    moved by the last of them (ticket) or by the second kernel; the ticket counter back at 0 after each slice."""
    gen = torch.Generator().manual_seed(1000 * seed + num_slots)
    rec = chained_records(gen, num_slots)
    size = -(-num_slots // interval)
    span = size * interval
    live = torch.rand(num_slots + 1, generator=gen) < 0.7
    live[0] = live[-1] = False
    offsets = torch.arange(size)
    twin, fused = SweepState(size, "cpu"), SweepState(size, "cpu")
    for k in range(interval + 2):
        common = dict(records=rec, live_mask=live, offsets=offsets, span=span, step=torch.tensor([60 + 3 * k]))
        kernels.sweep_slice_twin(**common, **twin.args())
        kernels.launch_sweep_slice(**common, **fused.launch_args(ticket))
        assert_same(fused.snapshot(), twin.snapshot())
    assert fused.cursor.item() == (interval + 2) * size % span
    plan = fused.plan
    assert (plan.verify_prev_slot_indices == 0).any() and (plan.verify_prev_slot_indices > 0).any()  # broken + intact


def test_sweep_slice_hand_case() -> None:
    """Slot 3 chains from 2 (intact), slot 4 from 2 at the wrong position (unreachable: 0), slot 5 from
    a predecessor rewritten after it (0), slot 6 never written (padding), slot 7 a chain head (-1)."""
    rec = SlotRecords(8, torch.device("cpu"))
    for s, (pos, prev, step) in {2: (4, -1, 1), 3: (5, 2, 2), 4: (9, 2, 2), 5: (6, 1, 3), 1: (5, -1, 9),
                                 7: (0, -1, 4)}.items():
        rec.position[s], rec.prev_slot[s], rec.step[s], rec.owner[s] = pos, prev, step, 100 + s
    live = torch.ones(9, dtype=torch.bool)
    live[0] = live[-1] = False
    plan = VerifyPlan.allocate(6, "cpu")
    history = torch.full((OWNER_HISTORY, 6), -1, dtype=torch.int64)
    verified, cursor = torch.zeros(1, dtype=torch.int64), torch.tensor([2])
    kernels.launch_sweep_slice(records=rec, plan=plan, live_mask=live, cursor=cursor, offsets=torch.arange(6),
                               span=12, step=torch.tensor([OWNER_HISTORY + 1]), owner_history=history, verified=verified)
    assert plan.verify_slot_indices.tolist() == [2, 3, 4, 5, 0, 7]
    assert plan.verify_prev_slot_indices.tolist() == [-1, 2, 0, 0, -1, -1]
    assert plan.verify_expected_positions.tolist() == [4, 5, 9, 6, NEVER_WRITTEN, 0]
    assert history[1].tolist() == [102, 103, 104, 105, NEVER_WRITTEN, 107]
    assert verified.item() == 5 and cursor.item() == 8


# ---- the runtime with the kernels forced on ----------------------------------------------------------

def _runtime_state(canary) -> dict[str, torch.Tensor]:
    out = {}
    for name, g in canary.groups.items():
        for k, v in records_state(g.records).items():
            out[f"{name}.{k}"] = v
        for side, buf in g.tail_bufs.items():
            out[f"{name}.tail_{side}"] = buf.clone()
        out[f"{name}.head"] = g.head_buf.clone()
    for name, sl in canary.sweeper._slices.items():
        out[f"{name}.history"] = sl.owner_history.clone()
        out[f"{name}.cursor"] = sl.cursor.clone()
        out[f"{name}.verified"] = sl.verified.clone()
    return out


def test_runtime_with_kernels_matches_twins() -> None:
    """A simulated engine (full + sliding-window groups, a rotating sweep) run twice with the same seed:
    on the twins, then with every launch on the Triton launchers (`dispatch.selected_backend("triton")`:
    the runtime's glue kernels and the ops): same records, buffers, sweep state and violations (none)."""
    options = dict(canary_options=dict(sweep_interval=4), num_slots=160, swa_num_slots=96, max_requests=6,
                   max_context=64, sliding_window=16)

    def run():
        engine, canary = make_sim(**options)
        warm_sim(engine, steps=12)
        return _runtime_state(canary), canary.stats()

    twin_state, twin_stats = run()
    _numpy_scalar_index_fix()
    with selected_backend("triton"), record_variants() as launched:
        fused_state, fused_stats = run()
    assert {"_token_rows_kernel", "_record_claim_kernel", "_record_store_kernel", "_sweep_slice_kernel"} <= set(launched)
    assert_same(fused_state, twin_state)
    assert fused_stats.violations == twin_stats.violations == 0
