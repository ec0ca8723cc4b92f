"""`ForwardBracket`: the canary's work around one engine forward.

::

    begin(batch)   stage (host reads of the [bs] arrays, device copies)          outside CUDA graphs
                   per group: plan -> HEAD verify (prefix vs. the table) -> HEAD write (new tokens)
    ... engine forward: stores K/V into batch.groups[g].out_cache_loc ...
    finish()       per group and hashed side: TAIL verify (prefix, real KV re-hashed)
                                              -> TAIL write (fingerprints of the KV just stored)

Plans are sized from the engine's limits; a batch that needs more entries grows them (logged and
counted in `capacity_growths`) — nothing is skipped. Each step leaves a `StepRecord` with the
drain so violation rows can be traced back to the batch row (request) that read or wrote the slot.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvcanary.ops import (
    REQ_POOL_IDX_PADDING,
    CanaryLaunchTag,
    FailReason,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_verify_kernel,
    launch_canary_write_kernel,
)
from kvcanary.runtime.batch import BatchDescription
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.counters import LaunchCounters
from kvcanary.runtime.groups import CanaryGroup
from kvcanary.runtime.violations import Attribution, ViolationDrain

logger = logging.getLogger("kvcanary")

_OWNER_PRUNE_EVERY = 16384


class RequestOwners:
    """Interns ``(request id, request row)`` pairs as int codes stored in the slot records."""

    def __init__(self) -> None:
        self._code: dict[tuple[Optional[str], int], int] = {}
        self._owner: dict[int, tuple[Optional[str], int]] = {}
        self._next = 0
        self._since_prune = 0

    def code(self, request_id: Optional[str], row: int) -> int:
        key = (request_id, row)
        c = self._code.get(key)
        if c is None:
            c = self._next
            self._next += 1
            self._code[key] = c
            self._owner[c] = key
            self._since_prune += 1
        return c

    def owner(self, code: int) -> tuple[Optional[str], Optional[int]]:
        return self._owner.get(code, (None, None))

    def maybe_prune(self, groups: dict[str, CanaryGroup]) -> None:
        """Forget owners no slot record refers to any more (bounded memory on long runs)."""
        if self._since_prune < _OWNER_PRUNE_EVERY:
            return
        self._since_prune = 0
        used = set()
        for g in groups.values():
            used.update(torch.unique(g.records.owner).tolist())
        for c in [c for c in self._owner if c not in used]:
            self._code.pop(self._owner.pop(c), None)


@dataclass
class _GroupStep:
    """One group's staged inputs and plans for one step."""

    verify_plan: VerifyPlan
    write_plan: WritePlan
    out_cache_loc: torch.Tensor  # int64 [num_tokens], group slot space
    verify_row_starts: list[int]  # entry offset of each batch row (len bs + 1)


@dataclass
class StepRecord:
    """What one step launched, kept until its violations are drained (see `attribute`)."""

    step: int
    forward_kind: str
    rows: list[int]
    request_ids: Optional[tuple[Optional[str], ...]]
    write_row_starts: list[int]
    positions: torch.Tensor
    groups: dict[str, _GroupStep] = field(default_factory=dict)

    def _request(self, r: int) -> tuple[Optional[str], Optional[int]]:
        rid = self.request_ids[r] if self.request_ids is not None else None
        return rid, self.rows[r]

    def attribute(self, *, tag: CanaryLaunchTag, op: str, rows: list[list[int]]) -> list[Attribution]:
        """Map violation rows to the batch row whose plan entry (verify) or input token (write)
        names the same slot; among several, the one consistent with the row's reasons."""
        g = self.groups.get(tag.group)
        if g is None:
            return [Attribution(None, None, None, self.step, self.forward_kind)] * len(rows)
        out = []
        if op == "verify":
            n = g.verify_row_starts[-1]
            slots = g.verify_plan.verify_slot_indices[:n].cpu()
            exp_pos = g.verify_plan.verify_expected_positions[:n].cpu()
            exp_tok = g.verify_plan.verify_expected_tokens[:n].cpu()
            # Rows of one slot come in plan order (several requests may share a cached slot):
            # each takes the next fitting entry after the one its predecessor row took.
            taken: dict[int, int] = {}
            for row in rows:
                slot, stored_pos, row_tok, bits = row[1], row[2], row[4], FailReason(row[7])
                cands = (slots == slot).nonzero().flatten().tolist()
                pos_bad = bool(bits & FailReason.VERIFY_POSITION_MISMATCH)

                def fits(i: int) -> bool:
                    tok_ok = row_tok == -1 or int(exp_tok[i]) == row_tok
                    return tok_ok and ((int(exp_pos[i]) != stored_pos) == pos_bad)

                fitting = [i for i in cands if fits(i)] or cands
                after = [i for i in fitting if i > taken.get(slot, -1)]
                best = (after or fitting or [None])[0]
                if best is not None:
                    taken[slot] = best
                if best is None:
                    out.append(Attribution(None, None, None, self.step, self.forward_kind))
                    continue
                r = bisect.bisect_right(g.verify_row_starts, best) - 1
                out.append(Attribution(*self._request(r), int(exp_pos[best]), self.step, self.forward_kind))
        else:
            n = self.write_row_starts[-1]
            locs = g.out_cache_loc[:n].cpu()
            pos = self.positions[:n].cpu()
            for row in rows:
                cands = ((locs == row[1]) & (pos == row[2])).nonzero().flatten().tolist()
                if not cands:
                    out.append(Attribution(None, None, row[6], self.step, self.forward_kind))
                    continue
                r = bisect.bisect_right(self.write_row_starts, cands[0]) - 1
                out.append(Attribution(*self._request(r), row[6], self.step, self.forward_kind))
        return out


class ForwardBracket:
    """Plans and launches the HEAD and TAIL checks of each forward (see the module docstring)."""

    def __init__(
        self,
        groups: dict[str, CanaryGroup],
        *,
        config: CanaryConfig,
        drain: ViolationDrain,
        counters: LaunchCounters,
        max_requests: int,
        max_context: int,
    ) -> None:
        self.groups = groups
        self.config = config
        self.drain = drain
        self.counters = counters
        self.device = next(iter(groups.values())).device
        self.owners = RequestOwners()
        self.chain_assert = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.no_chain_assert = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.capacity_growths = 0
        self.write_assert_skipped = 0
        self._warned: set[str] = set()
        self._verify_plans: dict[str, VerifyPlan] = {}
        self._write_plans: dict[str, WritePlan] = {}
        self._identity_luts: dict[str, torch.Tensor] = {}
        for name, g in groups.items():
            span = g.window if g.window else max_context
            self._verify_plans[name] = VerifyPlan.allocate(max(1, min(max_requests * span, g.num_slots)), self.device)
            self._write_plans[name] = WritePlan.allocate(max_requests, self.device)
        self._open: Optional[StepRecord] = None
        self._staged: Optional[dict] = None

    # ---- the two halves ----------------------------------------------------------------------
    def begin(self, batch: BatchDescription, *, step: int) -> None:
        """Stage ``batch``, then per group plan, HEAD verify and HEAD write."""
        self._check_groups(batch)
        if self.config.chain_position_warmup >= 0 and step > self.config.chain_position_warmup:
            if step == self.config.chain_position_warmup + 1:
                self.chain_assert.fill_(1)
        dev = self.device
        rows = [int(x) for x in batch.req_pool_indices.tolist()]
        prefix = [int(x) for x in batch.prefix_lens.tolist()]
        extend = [int(x) for x in batch.extend_lens.tolist()]
        active = [r != REQ_POOL_IDX_PADDING for r in rows]
        self._check_padding(rows, extend)
        writes = [e if a and e > 0 else 0 for a, e in zip(active, extend)]
        write_starts = [0]
        for e in writes:
            write_starts.append(write_starts[-1] + e)
        n_write = write_starts[-1]

        rp = batch.req_pool_indices.to(dev, torch.int64)
        pl = batch.prefix_lens.to(dev, torch.int64)
        el = batch.extend_lens.to(dev, torch.int64)
        input_ids = batch.input_ids.to(dev, torch.int64)
        positions = batch.positions.to(dev, torch.int64)
        record = StepRecord(
            step=step, forward_kind=batch.forward_kind, rows=rows, request_ids=batch.request_ids,
            write_row_starts=write_starts, positions=positions,
        )
        token_table = lens = None
        if self.config.verify_token and batch.token_table is not None:
            token_table = batch.token_table.to(dev, torch.int32)
            lens = batch.token_table_lens.to(dev, torch.int64)
        ends = torch.tensor(write_starts[1:], dtype=torch.int64, device=dev)
        token_row = torch.searchsorted(ends, torch.arange(n_write, device=dev), right=True)  # batch row per token
        expected_tokens, expected_positions = self._oracle(batch, rows, prefix, writes, token_row, input_ids, dev)

        owner_codes = [
            self.owners.code(batch.request_ids[r] if batch.request_ids else None, rows[r]) for r in range(len(rows))
        ]
        token_owner = torch.tensor(owner_codes, dtype=torch.int64, device=dev)[token_row]
        row_has_writes = torch.tensor([w > 0 for w in writes], device=dev)
        first_token = torch.tensor(write_starts[:-1], dtype=torch.int64, device=dev)[row_has_writes]

        for name, g in self.groups.items():
            gb = batch.groups[name]
            verify_counts = [min(p, g.window) if g.window else p for p in prefix]
            verify_starts = [0]
            for a, c in zip(active, verify_counts):
                verify_starts.append(verify_starts[-1] + (max(c, 0) if a else 0))
            vplan = self._verify_plan(name, verify_starts[-1])
            wplan = self._write_plan(name, len(rows))
            lut = gb.full_to_group_lut
            if lut is not None:
                lut = lut.to(dev, torch.int64)
            elif g.window:
                lut = self._identity_lut(g)
            launch_canary_plan_kernels(
                verify_plan_out=vplan,
                write_plan_out=wplan,
                req_pool_indices=rp,
                prefix_lens=pl,
                extend_seq_lens=el,
                req_to_token=gb.req_to_token if gb.req_to_token.dtype == torch.int32 else gb.req_to_token.to(torch.int32),
                swa_window_size=g.window,
                full_to_swa_index_mapping=lut,
                verify_capacity=vplan.capacity,
                req_to_verify_expected_tokens=token_table,
                req_to_verify_expected_tokens_valid_lens=lens,
                kv_token_id_vs_position_offset=0,
            )
            out_loc = gb.out_cache_loc.to(dev, torch.int64)[:n_write]
            if out_loc.shape[0] < n_write:
                raise ValueError(
                    f"kv-canary: group {name!r} out_cache_loc has {gb.out_cache_loc.shape[0]} slots, batch writes {n_write} tokens"
                )
            record.groups[name] = _GroupStep(vplan, wplan, out_loc, verify_starts)
            kw = dict(drain=self.drain, counters=self.counters)
            launch_canary_verify_kernel(
                context=g.context("head", "k", "verify", chain_assert=self.no_chain_assert, **kw),
                plan=vplan,
                check_verify_expected_token=token_table is not None,
            )
            launch_canary_write_kernel(
                context=g.context("head", "k", "write", chain_assert=self.chain_assert, **kw),
                plan=wplan,
                input_ids=input_ids[:n_write],
                positions=positions[:n_write],
                out_cache_loc=out_loc,
                enable_write_input_assert=expected_tokens is not None,
                expected_input_tokens=expected_tokens,
                expected_input_positions=expected_positions,
            )
            prev = torch.empty_like(out_loc)
            if n_write:
                prev[1:] = out_loc[:-1]
                prev[first_token] = wplan.write_seed_slot_indices[: len(rows)][row_has_writes]
            g.records.record(slots=out_loc, positions=positions[:n_write], prev_slots=prev, owners=token_owner, step=step)
        self.drain.register([t for g in self.groups.values() for t in g.tags() if t.phase != "sweep"], record)
        self.owners.maybe_prune(self.groups)
        self._open = record
        self._staged = dict(input_ids=input_ids[:n_write], positions=positions[:n_write])

    def finish(self) -> None:
        """TAIL verify (real KV re-hashed) and TAIL write (fingerprints) for the open step."""
        record, staged = self._take_open()
        for name, g in self.groups.items():
            gs = record.groups[name]
            self._warn_unhashed(g)
            for side in g.tail_sides:
                kw = dict(drain=self.drain, counters=self.counters, chain_assert=self.no_chain_assert)
                launch_canary_verify_kernel(
                    context=g.context("tail", side, "verify", **kw), plan=gs.verify_plan, check_verify_expected_token=False
                )
                launch_canary_write_kernel(
                    context=g.context("tail", side, "write", **kw),
                    plan=gs.write_plan,
                    input_ids=staged["input_ids"],
                    positions=staged["positions"],
                    out_cache_loc=gs.out_cache_loc,
                    enable_write_input_assert=False,
                    expected_input_tokens=None,
                    expected_input_positions=None,
                )

    def abandon(self) -> None:
        """The engine's forward raised: no TAIL for this step."""
        self._take_open()

    # ---- helpers -----------------------------------------------------------------------------
    def _take_open(self) -> tuple[StepRecord, dict]:
        if self._open is None or self._staged is None:
            raise RuntimeError("kv-canary: no forward is open")
        record, staged = self._open, self._staged
        self._open = self._staged = None
        return record, staged

    def _check_groups(self, batch: BatchDescription) -> None:
        have, want = set(batch.groups), set(self.groups)
        if have != want:
            raise ValueError(
                f"kv-canary: BatchDescription.groups has {sorted(have)}, the canary's groups are {sorted(want)}"
            )

    @staticmethod
    def _check_padding(rows: list[int], extend: list[int]) -> None:
        seen_padding_with_tokens = False
        for r, e in zip(rows, extend):
            if r == REQ_POOL_IDX_PADDING and e > 0:
                seen_padding_with_tokens = True
            elif r != REQ_POOL_IDX_PADDING and seen_padding_with_tokens:
                raise ValueError(
                    "kv-canary: padding rows (req_pool_indices == 0) with extend_lens > 0 must come after every real row"
                )

    def _oracle(self, batch, rows, prefix, writes, token_row, input_ids, dev):
        """Expected tokens / positions of the written entries for the write-input assert, or (None, None)."""
        if not self.config.write_input_assert:
            return None, None
        n = sum(writes)
        positions = torch.cat(
            [torch.arange(p, p + w, dtype=torch.int64) for p, w in zip(prefix, writes) if w]
        ).to(dev) if n else torch.zeros(0, dtype=torch.int64, device=dev)
        if batch.expected_input_ids is not None:
            return batch.expected_input_ids.to(dev, torch.int64)[:n], positions
        if batch.token_table is None:
            self.write_assert_skipped += 1
            self._warn_once(
                "oracle",
                "kv-canary: write_input_assert is on but the batch has neither expected_input_ids nor token_table; "
                "the write-input assert is skipped (counted in stats.write_assert_skipped)",
            )
            return None, None
        table = batch.token_table.to(dev)
        lens = batch.token_table_lens.to(dev, torch.int64)
        rp = torch.tensor(rows, dtype=torch.int64, device=dev)[token_row]
        col = torch.clamp(positions, max=table.shape[1] - 1)
        known = (positions < lens[token_row]) & (positions < table.shape[1])
        expected = torch.where(known, table[rp, col].to(torch.int64), input_ids[:n])
        return expected, positions

    def _verify_plan(self, name: str, needed: int) -> VerifyPlan:
        plan = self._verify_plans[name]
        if needed > plan.capacity:
            new_cap = 1 << (needed - 1).bit_length()
            logger.warning(
                "kv-canary: group %r batch needs %d verify entries, capacity %d; growing to %d (counted)",
                name, needed, plan.capacity, new_cap,
            )
            self.capacity_growths += 1
            plan = self._verify_plans[name] = VerifyPlan.allocate(new_cap, self.device)
        return plan

    def _write_plan(self, name: str, bs: int) -> WritePlan:
        plan = self._write_plans[name]
        if bs > plan.capacity:
            logger.warning(
                "kv-canary: group %r batch has %d rows, write capacity %d; growing (counted)", name, bs, plan.capacity
            )
            self.capacity_growths += 1
            plan = self._write_plans[name] = WritePlan.allocate(1 << (bs - 1).bit_length(), self.device)
        return plan

    def _identity_lut(self, g: CanaryGroup) -> torch.Tensor:
        lut = self._identity_luts.get(g.name)
        if lut is None:
            lut = self._identity_luts[g.name] = torch.arange(g.num_slots, dtype=torch.int64, device=self.device)
        return lut

    def _warn_unhashed(self, g: CanaryGroup) -> None:
        if g.hash_mode != 0 and not g.hashing:
            self._warn_once(
                f"unhashed:{g.name}",
                f"kv-canary: real_kv_hash is on but group {g.name!r} has no KV tensors (call set_kv_cache); "
                "TAIL checks run without fingerprints",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def memory_bytes(self) -> int:
        total = 0
        for p in self._verify_plans.values():
            total += 4 * p.capacity * 8 + 8
        for p in self._write_plans.values():
            total += (2 * p.capacity + 1) * 8 + 4
        return total + sum(t.numel() * 8 for t in self._identity_luts.values())
