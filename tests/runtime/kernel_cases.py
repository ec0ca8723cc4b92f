"""Seeded inputs for the fused runtime kernels (`kvcanary.runtime.kernels`), shared by the interpreter
parity tests (tests/runtime/test_kernels.py) and the CUDA ones (tests/gpu/test_runtime_kernels.py).
Everything is built on the CPU from a generator, then moved to ``device``."""
from __future__ import annotations

import torch

from kvcanary.ops import VerifyPlan
from kvcanary.runtime import kernels
from kvcanary.runtime.groups import NEVER_WRITTEN, SlotRecords
from kvcanary.runtime.sweep import OWNER_HISTORY

RECORD_FIELDS = ("position", "prev_slot", "step", "owner")


def records_state(rec: SlotRecords) -> dict[str, torch.Tensor]:
    """The four record arrays (trash row included), cloned to the CPU."""
    return {k: getattr(rec, k).cpu().clone() for k in RECORD_FIELDS}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-identical tensors per key; the message names the first differing indices."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].cpu(), b[k].cpu()
        assert x.shape == y.shape and x.dtype == y.dtype, (k, x.shape, y.shape, x.dtype, y.dtype)
        diff = (x != y).nonzero().flatten()[:8].tolist()
        assert torch.equal(x, y), f"{k} differs at {diff}: {x.flatten()[diff].tolist()} vs {y.flatten()[diff].tolist()}"


def records_like(rec: SlotRecords, device) -> SlotRecords:
    """A fresh `SlotRecords` on ``device`` holding ``rec``'s four arrays."""
    out = SlotRecords(rec.num_slots, torch.device(device))
    for k in RECORD_FIELDS:
        getattr(out, k).copy_(getattr(rec, k))
    return out


def random_offsets(gen: torch.Generator, bs: int, cap: int, max_len: int = 5) -> torch.Tensor:
    """Write-plan offsets int64 [cap + 1]: cumulative lengths (0..max_len, ~30% empty) of ``bs`` rows, zeros
    past ``bs`` (as the plan leaves them)."""
    lens = torch.randint(0, max_len + 1, (bs,), generator=gen)
    lens[torch.rand(bs, generator=gen) < 0.3] = 0
    offsets = torch.zeros(cap + 1, dtype=torch.int64)
    offsets[1 : bs + 1] = lens.cumsum(0)
    return offsets


def random_records(gen: torch.Generator, num_slots: int, device="cpu") -> SlotRecords:
    """Half the slots written with small random fields, the rest (and the trash row) never written."""
    rec = SlotRecords(num_slots, torch.device("cpu"))
    written = torch.rand(num_slots + 1, generator=gen) < 0.5
    for k in RECORD_FIELDS:
        getattr(rec, k).copy_(torch.where(written, torch.randint(-1, 50, (num_slots + 1,), generator=gen), NEVER_WRITTEN))
        getattr(rec, k)[num_slots] = NEVER_WRITTEN  # the trash row is never written
    return records_like(rec, device)


def random_write(gen: torch.Generator, num_slots: int, rows: int, n: int, step: int, shift: int = 0,
                 device="cpu", owner_span: int = 37, max_len: int = 5) -> dict:
    """One write's keyword arguments for `kernels.record_write_twin` / `launch_record_write`: ``out_loc`` with
    duplicates (slots drawn from a third of the space), padding (-1), other negatives, slots past the slot
    space and slot 0; seeds with chain heads (-1) and context anchors (>= num_slots); tokens past the write
    range (rows of 0..``max_len`` tokens). ``shift`` > 0 starts the offsets there (no plan does: token 0
    then chains from the last token)."""
    cap = rows + 3
    offsets = random_offsets(gen, rows, cap, max_len)
    offsets[: rows + 1] += shift
    out_loc = torch.randint(1, max(2, num_slots // 3), (n,), generator=gen)
    r = torch.rand(n, generator=gen)
    out_loc[r < 0.15] = -1
    out_loc[(r >= 0.15) & (r < 0.2)] = -7
    out_loc[(r >= 0.2) & (r < 0.25)] = num_slots + int(torch.randint(0, 3, (1,), generator=gen))
    out_loc[(r >= 0.25) & (r < 0.28)] = 0
    seeds = torch.randint(0, num_slots, (cap,), generator=gen)
    seeds[torch.rand(cap, generator=gen) < 0.3] = -1
    seeds[torch.rand(cap, generator=gen) < 0.2] = num_slots + int(torch.randint(0, cap, (1,), generator=gen))
    row, local, valid = kernels.token_rows_twin(offsets, rows, n, torch.arange(n))
    args = dict(seeds=seeds, row=row, local=local, valid=valid, out_loc=out_loc,
                positions=torch.randint(0, 400, (n,), generator=gen), step=torch.tensor([step]))
    return {**{k: v.to(device) for k, v in args.items()}, "owner_span": owner_span}


def chained_records(gen: torch.Generator, num_slots: int, device="cpu") -> SlotRecords:
    """Records of chains over a random slot order (each slot's predecessor holds the previous position and
    was written no later; a chain starts at ~10% of slots), then damage: never-written slots, predecessors
    rewritten later (stale links), moved positions, the trash row as predecessor (anchors), extra heads."""
    rec = SlotRecords(num_slots, torch.device("cpu"))
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    i = torch.arange(num_slots - 1)
    start = torch.rand(num_slots - 1, generator=gen) < 0.1
    start[0] = True
    first = torch.cummax(torch.where(start, i, 0), 0).values  # index of the chain's first slot
    pos = i - first
    rec.position[perm] = pos
    rec.prev_slot[perm] = torch.where(start, -1, perm.roll(1))
    rec.step[perm] = 10 + pos // 4
    rec.owner[perm] = 1000 + i
    r = torch.rand(num_slots + 1, generator=gen)
    slot = torch.arange(num_slots + 1)
    rec.step[(r < 0.1) & (slot > 0)] = NEVER_WRITTEN
    rec.step[(r >= 0.1) & (r < 0.2)] += 50
    rec.position[(r >= 0.2) & (r < 0.25)] += 3
    rec.prev_slot[(r >= 0.25) & (r < 0.3)] = num_slots
    rec.prev_slot[(r >= 0.3) & (r < 0.33)] = -1
    for k in RECORD_FIELDS:
        getattr(rec, k)[num_slots] = NEVER_WRITTEN  # the trash row is never written
    return records_like(rec, device)


class SweepState:
    """The device state one sweep slice reads and moves: plan, owner history, verified, cursor."""

    def __init__(self, size: int, device) -> None:
        self.plan = VerifyPlan.allocate(size, device)
        self.history = torch.full((OWNER_HISTORY, size), -1, dtype=torch.int64, device=device)
        self.verified = torch.zeros(1, dtype=torch.int64, device=device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)
        self.done = torch.zeros(1, dtype=torch.int32, device=device)

    def args(self) -> dict:
        return dict(plan=self.plan, owner_history=self.history, verified=self.verified, cursor=self.cursor)

    def launch_args(self, ticket: bool = True) -> dict:
        """`args` for the Triton launch: with the ticket counter (the cursor moved by the slice kernel) or without."""
        return dict(self.args(), done=self.done if ticket else None)

    def snapshot(self) -> dict[str, torch.Tensor]:
        p = self.plan
        return dict(slots=p.verify_slot_indices.cpu().clone(), positions=p.verify_expected_positions.cpu().clone(),
                    prev=p.verify_prev_slot_indices.cpu().clone(), history=self.history.cpu().clone(),
                    verified=self.verified.cpu().clone(), cursor=self.cursor.cpu().clone(),
                    done=self.done.cpu().clone())
