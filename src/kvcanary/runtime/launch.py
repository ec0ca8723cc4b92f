"""`ForwardLaunches`: the canary's device work around one engine forward, read from static buffers.

::

    head()   paged groups: position -> slot tables from the engine's block tables, written slots marked
             per group: padding-read check (live read positions mapped to the padding slot; before the rings are marked)
             per group: plan (the first group's token -> row map also marks the rings) -> HEAD verify (prefix vs. the table)
             -> HEAD write (new tokens) -> slot records (position, predecessor, step, owner)
    ... engine forward: stores K/V into the staged out_loc slots ...
    tail()   per group: TAIL verify of every hashed side in one launch (prefix, real KV re-hashed; a ring window
             skips the positions the forward's own writes recycled, GroupSpec.ring_window) -> TAIL writes of every side (fingerprints of the KV just stored; with deep fingerprints also the LANES-mode
             fingerprints of every 4 layers, `store_deep_fingerprints`, checked later by the sweep); then stamp the step's ring rows

With timing jitter on (``CanaryConfig.jitter_fire_prob > 0``, docs/design.md §4.9) the HEAD and TAIL verify and
write launches get one `KernelJitter`: draws keyed by the device step number, counts in the launch counters'
jitter row. The plan, the slot records, the stamps and the sweep never stall.

Every launch reads the `StaticBatch` and device tensors only — no host reads — so both halves can be
captured in a CUDA graph. Outside capture, the launches are sliced to the staged batch's size (host-known
from its shape) so small batches cost little; inside capture they span the whole static capacity.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvcanary.ops import (
    KernelJitter,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_verify_kernel,
    launch_canary_verify_kernels,
    launch_canary_write_kernel,
    launch_block_table_slots_kernel,
    launch_canary_write_kernels,
    launch_mark_written_slots_kernel,
    launch_padding_read_check_kernel,
    launch_stamp_violation_rows,
)
from kvcanary.runtime import kernels
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.counters import LaunchCounters
from kvcanary.runtime.cuda_host import capturing
from kvcanary.runtime.deep_store import store_deep_fingerprints
from kvcanary.runtime.drain import ViolationRings
from kvcanary.runtime.groups import CanaryGroup
from kvcanary.runtime.staging import StaticBatch

logger = logging.getLogger("kvcanary")

ROW_HISTORY = 1024  # steps whose request rows stay on the device for attribution


@dataclass(frozen=True, kw_only=True)
class _Shape:
    """How much of the static buffers one launch reads: rows and tokens."""

    rows: int
    tokens: int


@dataclass(frozen=True, kw_only=True)
class _OpenStep:
    """What opening a step computed for every group's HEAD write and slot records: the token -> row map and the
    write-input assert's expectation (None: no assert)."""

    tokens_row: kernels.TokenRows
    expected_tokens: Optional[torch.Tensor] = None
    expected_positions: Optional[torch.Tensor] = None


class ForwardLaunches:
    """Plans and launches the HEAD and TAIL checks of each forward (see the module docstring)."""

    def __init__(
        self, groups: dict[str, CanaryGroup], *, config: CanaryConfig, rings: ViolationRings,
        counters: LaunchCounters, static: StaticBatch, verify_capacity: dict[str, int], owner_span: int,
        plans_disabled: Optional[torch.Tensor] = None,
    ) -> None:
        self.groups = groups
        self.config = config
        self.rings = rings
        self.counters = counters
        self.static = static
        self.owner_span = owner_span
        dev = static.device
        self.device = dev
        self.step = torch.zeros(1, dtype=torch.int64, device=dev)  # set by the host per step (fill_)
        # timing jitter of the HEAD / TAIL launches (None: off, the kernels are the ones without it)
        self.jitter: Optional[KernelJitter] = KernelJitter.create(
            fire_prob=config.jitter_fire_prob, max_cycles=config.jitter_max_cycles, seed=config.jitter_seed,
            launch_key=self.step, counters=counters.jitter_counters(),
        ) if config.jitter else None
        self.chain_assert = torch.zeros(1, dtype=torch.int32, device=dev)
        self.no_chain_assert = torch.zeros(1, dtype=torch.int32, device=dev)
        self.verify_plans = {n: VerifyPlan.allocate(verify_capacity[n], dev) for n in groups}
        self.write_plans = {n: WritePlan.allocate(static.max_rows, dev) for n in groups}
        # verify plans skipped for overflowing their capacity, per group (int64 [groups]; polled by the drain)
        self.plans_disabled = torch.zeros(len(groups), dtype=torch.int64, device=dev) if plans_disabled is None else plans_disabled
        self.row_history = torch.zeros(ROW_HISTORY, static.max_rows, dtype=torch.int64, device=dev)
        self._seq = torch.zeros(static.max_rows, dtype=torch.int64, device=dev)  # prefix + extend (`_fill_paged`)
        self._identity_luts = {
            n: torch.arange(g.num_slots, dtype=torch.int64, device=dev) for n, g in groups.items() if g.window
        }
        self._ring_slots: dict[str, torch.Tensor] = {}  # ring-window groups: the TAIL plan's slot column
        self.write_assert_skipped = 0
        self.plan_growths = 0
        self._warned: set[str] = set()
        self._shape = _Shape(rows=0, tokens=0)

    # ---- host-side setters (O(1), outside capture) -----------------------------------------------
    def set_step(self, step: int) -> None:
        self.step.fill_(step)
        warmup = self.config.chain_position_warmup
        if warmup >= 0 and step == warmup + 1:
            self.chain_assert.fill_(1)

    def grow_verify_plan(self, name: str) -> None:
        """Quadruple ``name``'s verify capacity (between steps; a plan over capacity disables its verify)."""
        old = self.verify_plans[name].capacity
        if self.static.frozen:
            self._warn_once(f"frozen:{name}", f"kv-canary: group {name!r} verify plan overflowed its capacity {old} "
                            "while graphs are captured; those verifies are skipped (counted in stats.plans_disabled)")
            return
        logger.warning("kv-canary: group %r verify plan overflowed its capacity %d (that verify was skipped, counted); "
                       "growing to %d", name, old, 4 * old)
        self.verify_plans[name] = VerifyPlan.allocate(4 * old, self.device)
        self.plan_growths += 1

    def resize(self) -> None:
        """Reallocate what is sized from the static buffers (after they grew)."""
        dev = self.device
        self.write_plans = {n: WritePlan.allocate(self.static.max_rows, dev) for n in self.groups}
        self.row_history = torch.zeros(ROW_HISTORY, self.static.max_rows, dtype=torch.int64, device=dev)
        self._seq = torch.zeros(self.static.max_rows, dtype=torch.int64, device=dev)

    # ---- the two halves ----------------------------------------------------------------------------
    def head(self, *, full: bool = False, limit: Optional[tuple[int, int]] = None,
             on_open: Optional[Callable[[], None]] = None, before_records: Optional[Callable[[], None]] = None) -> None:
        """Plan, HEAD verify + write, slot records, for every group. ``limit``: span ``(rows, tokens)`` of the
        static buffers (a graph bucket: everything past the staged batch is padding); else ``full`` or while
        capturing: the whole static capacity; else the staged batch's size. `tail` spans what `head` spanned.
        ``on_open``: called once the step is open (rings marked), before any HEAD check: work that must see the
        slot records and KV as the step found them (the sweep slice); ``before_records``: called before the
        first slot-record write (where a parallel branch joins)."""
        s = self.static
        self._shape = shape = self._head_shape(full, limit)
        bs, n = shape.rows, shape.tokens
        self._before_open(self._fill_paged, bs, n)
        oracle = self._oracle(bs, n)
        if self.config.padding_read_check:  # before the step opens: the stamp launches never restamp its rows
            self._before_open(self._check_padding_reads, s.rows[:bs], s.prefix[:bs])
        opened: Optional[_OpenStep] = None
        for gi, (name, g) in enumerate(self.groups.items()):
            vplan, wplan = self.verify_plans[name], self.write_plans[name]
            if opened is None:
                self._before_open(self._plan, name, g, vplan, wplan, bs)
                opened = self._open_step(gi, vplan, wplan, bs, n, oracle)
                if on_open is not None:
                    on_open()
            else:
                self._plan(name, g, vplan, wplan, bs)
                self.plans_disabled[gi : gi + 1] += 1 - vplan.enable
            out_loc = self._head_checks(name, g, vplan, wplan, opened, bs, n)
            if before_records is not None and gi == 0:
                before_records()
            self._record_slots(g, wplan, opened.tokens_row, out_loc, n)

    def _fill_paged(self, bs: int, n: int) -> None:
        """Groups with a `BlockTable`: their rows' ``req_to_token`` entries below ``prefix + extend``, from the
        block table, before anything reads them (not the padding row 0's); groups with a `RewriteCounter`: the forward's written slots marked
        (docs/design.md §3.10). Device only; nothing for groups without either."""
        s = self.static
        seq = None
        for name, inputs in s.inputs.items():
            bt = inputs.block_table
            if bt is not None and bs:
                if seq is None:  # padding rows (request row 0) read nothing, whatever lengths they claim
                    seq = torch.add(s.prefix[:bs], s.extend[:bs], out=self._seq[:bs]).mul_(s.rows[:bs] != 0)
                launch_block_table_slots_kernel(block_table=bt.table, rows=s.rows[:bs], seq_lens=seq,
                                                block_size=bt.block_size, width=None, table_out=inputs.req_to_token,
                                                drop_null=bt.drop_null)
            if inputs.rewrites is not None and n:
                launch_mark_written_slots_kernel(slots=s.out_loc[name][:n], ever_written=inputs.rewrites.ever_written,
                                                 rewritten=inputs.rewrites.rewritten)

    def _head_shape(self, full: bool, limit: Optional[tuple[int, int]]) -> _Shape:
        """The span of this step's launches (see `head`)."""
        s = self.static
        if limit is not None:
            return _Shape(rows=min(limit[0], s.max_rows), tokens=min(limit[1], s.max_tokens))
        if full or capturing():
            return _Shape(rows=s.max_rows, tokens=s.max_tokens)
        return _Shape(rows=s.num_rows, tokens=s.num_tokens)

    def _before_open(self, launch: Callable[..., None], *args) -> None:
        """Run ``launch(*args)`` before the step is open; if it raises, mark the rings before re-raising, so the
        stamps do not re-stamp the step before's rows."""
        try:
            launch(*args)
        except BaseException:
            self.rings.mark()
            raise

    def _plan(self, name: str, g: CanaryGroup, vplan: VerifyPlan, wplan: WritePlan, bs: int) -> None:
        """Group ``name``'s verify and write plans of the staged rows."""
        s = self.static
        inputs = s.inputs[name]
        lut = inputs.lut if inputs.lut is not None else self._identity_luts.get(name)
        token_table = self._token_table()
        launch_canary_plan_kernels(
            verify_plan_out=vplan, write_plan_out=wplan,
            req_pool_indices=s.rows[:bs], prefix_lens=s.prefix[:bs], extend_seq_lens=s.extend[:bs],
            req_to_token=inputs.req_to_token, swa_window_size=g.window, full_to_swa_index_mapping=lut,
            verify_capacity=vplan.capacity,
            req_to_verify_expected_tokens=token_table,
            req_to_verify_expected_tokens_valid_lens=s.token_lens[:bs] if token_table is not None else None,
            kv_token_id_vs_position_offset=0, check_request_rows_on_host=False,  # never wait for the stream
        )

    def _token_table(self) -> Optional[torch.Tensor]:
        """The token table the HEAD verify compares stored tokens with, or None (``verify_token`` off or no table)."""
        return self.static.token_table if self.config.verify_token else None

    def _open_step(self, gi: int, vplan: VerifyPlan, wplan: WritePlan, bs: int, n: int,
                   oracle: Optional[kernels.TokenOracle]) -> _OpenStep:
        """Open the step after the first group's plan: one token -> row map (rows and extends are shared by the
        groups), whose launch also marks the rings, records the request rows, counts this plan's disabled verify
        and computes the write-input assert's expectation."""
        s = self.static
        tokens_row = self._token_rows(wplan, bs, n, kernels.StepPrologue(
            rows_from=self.rings.rows_from, write_index=self.rings.write_index, row_history=self.row_history,
            step=self.step, rows=s.rows, disabled=self.plans_disabled[gi : gi + 1], enable=vplan.enable), oracle)
        if oracle is None:
            return _OpenStep(tokens_row=tokens_row)
        expected = s.expected_ids[:n] if oracle.table is None else tokens_row.expected
        return _OpenStep(tokens_row=tokens_row, expected_tokens=expected, expected_positions=tokens_row.positions)

    def _head_checks(self, name: str, g: CanaryGroup, vplan: VerifyPlan, wplan: WritePlan, opened: _OpenStep,
                     bs: int, n: int) -> torch.Tensor:
        """Group ``name``'s HEAD verify and write (after the context anchors' chain seeds); returns the staged
        ``out_loc`` slice the write used."""
        s = self.static
        if s.has_context and g.anchor_rows:
            self._chain_from_context_anchors(g, vplan, wplan, bs)
        out_loc = s.out_loc[name][:n]
        launch_canary_verify_kernel(
            context=self._context(g, "head", "k", "verify", self.no_chain_assert),
            plan=vplan, check_verify_expected_token=self._token_table() is not None, jitter=self.jitter,
        )
        launch_canary_write_kernel(
            context=self._context(g, "head", "k", "write", self.chain_assert),
            plan=wplan, input_ids=s.input_ids[:n], positions=s.positions[:n], out_cache_loc=out_loc,
            enable_write_input_assert=opened.expected_tokens is not None,
            expected_input_tokens=opened.expected_tokens, expected_input_positions=opened.expected_positions,
            jitter=self.jitter,
        )
        return out_loc

    def tail(self, *, run_checks: bool = True) -> None:
        """TAIL verify + write per hashed side (skipped when the forward raised), then stamp the rows."""
        s, shape = self.static, self._shape
        bs, n = shape.rows, shape.tokens
        for name, g in self.groups.items():
            vplan, wplan = self.verify_plans[name], self.write_plans[name]
            if run_checks:
                self._warn_unhashed(g)
                tplan = self._ring_tail_plan(name, g, vplan, bs) if g.spec.ring_window and bs else vplan
                launch_canary_verify_kernels(  # every side in one launch on CUDA (the plan read once)
                    contexts=[self._context(g, "tail", side, "verify", self.no_chain_assert) for side in g.tail_sides],
                    plan=tplan, check_verify_expected_token=False, jitter=self.jitter,
                )
                out_loc = s.out_loc[name][:n]
                launch_canary_write_kernels(  # K and V share a launch on CUDA
                    contexts=[self._context(g, "tail", side, "write", self.no_chain_assert) for side in g.tail_sides],
                    plan=wplan, input_ids=s.input_ids[:n], positions=s.positions[:n],
                    out_cache_loc=out_loc, enable_write_input_assert=False,
                    expected_input_tokens=None, expected_input_positions=None, jitter=self.jitter,
                )
                if g.deep:  # every layer's bytes (sweep-checked), without a chain walk of their own
                    store_deep_fingerprints(targets=g.deep_targets(), out_loc=out_loc, plan=wplan)
            tags = [g.tag("head")] + [g.tag("tail", side) for side in g.tail_sides]
            for ring_args in self.rings.stamp_launches(name, tags):  # one launch when the group's rings are adjacent
                launch_stamp_violation_rows(
                    **ring_args, step=self.step, verify_plan=vplan, write_plan=wplan,
                    out_cache_loc=s.out_loc[name][:n], positions=s.positions[:n],
                    req_pool_indices=s.rows[:bs], prefix_lens=s.prefix[:bs], swa_window_size=g.window,
                )

    # ---- helpers -----------------------------------------------------------------------------------
    def _ring_tail_plan(self, name: str, g: CanaryGroup, vplan: VerifyPlan, bs: int) -> VerifyPlan:
        """``vplan`` with the entries of positions below ``P + E - W`` (their ring slots now hold this forward's
        tokens) set to slot 0, which verify skips; the other columns are ``vplan``'s own tensors. Rows of the
        stamps keep reading ``vplan`` (HEAD rows of those entries stay attributed). Device ops only."""
        s = self.static
        rows, prefix, extend = s.rows[:bs], s.prefix[:bs], s.extend[:bs]
        counts = torch.where(rows != 0, prefix - (prefix - g.window).clamp(min=0), 0)  # entries per row (docs/design.md §3.5)
        entry = s.entry_arange(vplan.capacity)
        row = torch.searchsorted(counts.cumsum(0), entry, right=True).clamp_(max=bs - 1)
        gone = vplan.verify_expected_positions < (prefix + extend - g.window)[row]
        slots = self._ring_slots.get(name)
        if slots is None or slots.shape[0] != vplan.capacity:
            slots = self._ring_slots[name] = torch.empty_like(vplan.verify_slot_indices)
        slots.copy_(vplan.verify_slot_indices).masked_fill_(gone, 0)
        return VerifyPlan(verify_slot_indices=slots, verify_expected_tokens=vplan.verify_expected_tokens,
                          verify_expected_positions=vplan.verify_expected_positions,
                          verify_prev_slot_indices=vplan.verify_prev_slot_indices,
                          verify_num_valid=vplan.verify_num_valid, enable=vplan.enable)

    def _check_padding_reads(self, rows: torch.Tensor, prefix: torch.Tensor) -> None:
        """Per group, the live rows' read positions whose slot resolves to the padding slot become
        ``verify_padding_slot_read`` rows of the group's HEAD ring, stamped with their batch row
        (`launch_padding_read_check_kernel`; the verify op skips slot 0, docs/design.md §3.12): a window from the
        row's own first query (``StaticBatch.shared``), a ring's from ``P - W + 1``. One launch per group, device
        only; it runs before the step's first plan, so before the rings are marked."""
        s = self.static
        for name, g in self.groups.items():
            tag = g.tag("head")
            ring, write_index = self.rings.ring_for(name, tag)
            inputs = s.inputs[name]
            launch_padding_read_check_kernel(
                req_pool_indices=rows, prefix_lens=prefix, req_to_token=inputs.req_to_token, swa_window_size=g.window,
                full_to_swa_index_mapping=inputs.lut, violation_ring=ring, violation_write_index=write_index,
                stamps=self.rings.stamps_for(name, tag), step=self.step, kernel_kind=tag,
                ring_window=bool(g.spec.ring_window), shared_lens=s.shared[: rows.shape[0]] if g.window else None,
            )

    def _context(self, g: CanaryGroup, phase: str, side: str, op: str, chain_assert: torch.Tensor):
        return g.context(phase, side, op, rings=self.rings, counters=self.counters, chain_assert=chain_assert)

    def _chain_from_context_anchors(self, g: CanaryGroup, vplan: VerifyPlan, wplan: WritePlan, bs: int) -> None:
        """Rows with a context key chain their first token from their anchor row (``num_slots + row``, holding
        the key) instead of the chain head: the write seeds them there, the verify expects them there."""
        s = self.static
        k = min(bs, g.anchor_rows)
        keys, prefix = s.context_keys[:k], s.prefix[:k]
        anchors = g.num_slots + self.static.row_arange[:k]
        g.set_anchor_keys(s.context_keys)
        keyed = (keys != 0) & (s.rows[:k] != 0)
        seeds = wplan.write_seed_slot_indices[:k]
        seeds.copy_(torch.where(keyed & (prefix <= 0), anchors, seeds))
        # verify: the entry of position 0 of a keyed row (its row from the plan's entry order, docs/design.md §3.5)
        lo = (prefix - g.window).clamp(min=0) if g.window else torch.zeros_like(prefix)
        counts = torch.where(s.rows[:k] != 0, (prefix - lo).clamp(min=0), 0)
        cap = vplan.capacity
        entry = self.static.entry_arange(cap)
        row = torch.searchsorted(counts.cumsum(0), entry, right=True).clamp_(max=max(k - 1, 0))
        first = (vplan.verify_expected_positions == 0) & keyed[row] & (entry < vplan.verify_num_valid)
        prev = vplan.verify_prev_slot_indices
        prev.copy_(torch.where(first, anchors[row], prev))

    def _token_rows(self, wplan: WritePlan, bs: int, n: int, prologue: kernels.StepPrologue,
                    oracle: Optional[kernels.TokenOracle]) -> kernels.TokenRows:
        """Batch row of each staged token, its offset within the row, valid (inside the write range), and with an
        ``oracle`` its position and expected token, after the ``prologue``'s bookkeeping; one kernel on CUDA
        (`kernels.token_rows`)."""
        return kernels.token_rows(wplan.write_offsets, bs, n, self.static.token_arange, prologue, oracle)

    def _oracle(self, bs: int, n: int) -> Optional[kernels.TokenOracle]:
        """What the write-input assert compares the staged tokens with (once per step), or None: off, or no oracle
        (counted in ``write_assert_skipped``). Without a table, the batch's own expected ids (positions only)."""
        if not self.config.write_input_assert:
            return None
        s = self.static
        table = None if s.has_oracle else s.token_table
        if table is None and not s.has_oracle:
            self.write_assert_skipped += 1
            self._warn_once(
                "oracle",
                "kv-canary: write_input_assert is on but the batch has neither expected_input_ids nor token_table; "
                "the write-input assert is skipped (counted in stats.write_assert_skipped)",
            )
            return None
        return kernels.TokenOracle(prefix=s.prefix, rows=s.rows, lens=s.token_lens, table=table, input_ids=s.input_ids)

    def _record_slots(self, g: CanaryGroup, wplan: WritePlan, tokens_row, out_loc: torch.Tensor, n: int) -> None:
        """Slot records of this write: position, predecessor (the seed for a row's first token), step, owner;
        two kernels on CUDA (`kernels.record_write`)."""
        row, local, valid = tokens_row.row, tokens_row.local, tokens_row.valid
        kernels.record_write(
            g.records, seeds=wplan.write_seed_slot_indices, row=row, local=local, valid=valid, out_loc=out_loc,
            positions=self.static.positions[:n], step=self.step, owner_span=self.owner_span,
        )

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
        total = sum(4 * p.capacity * 8 + 8 for p in self.verify_plans.values())
        total += sum((2 * p.capacity + 1) * 8 + 4 for p in self.write_plans.values())
        total += self.row_history.numel() * 8
        if self.jitter is not None:
            total += self.jitter.params.numel() * 8
        return total + sum(t.numel() * 8 for t in self._identity_luts.values())
