"""`SlotMoves`: canary records that travel with KV the engine moves — device copies, export, import.

Engines move KV outside the forward: copy-on-write and forking (parallel sampling), offload to host
memory and restore, prefill -> decode transfer between processes, prefix-cache tiers. Each move must
carry the canary state of the moved slots, or the next verify reports the copy as corruption. Three
calls, all between forwards (never inside an open one), all through ``Canary``:

* ``copy_slots(group, src, dst)`` — the engine copied the KV of ``src[i]`` to ``dst[i]`` on the device:
  the HEAD and TAIL records of every side (``ops.launch_canary_copy_slots_kernel``, gather-then-scatter,
  last duplicate destination wins, slot 0 / negative entries skipped) and the runtime's `SlotRecords`
  (position, predecessor, step, owner) move with it. A predecessor that is itself copied in the same call
  is remapped to its copy; one that is not (a shared prefix block) stays as it was.
* ``export_records(group, slots)`` -> int64 ``[1 + n, 4 * B]`` (``ops/copy_format.py``; ``B`` = HEAD +
  one TAIL table per hashed side): bytes that ride next to the KV blocks (host memory, a file, a socket).
* ``import_records(group, slots, records, verify=True)`` — install an export into ``slots`` (the
  receiver's slot space) *after* the KV landed there, then verify at once: a TAIL verify per hashed side
  under the group's ``MOVE_{K,V}`` launch tag, re-hashing the destination's real KV against the carried
  fingerprints (``verify_real_kv_hash``), the carried positions against the expected ones (``positions``,
  default: the carried ones), the tokens against ``tokens`` (optional) and each chain link against the
  imported predecessor. The violations are drained at once (a host wait; moves are off the hot path).

A move takes the next canary step number (so ``Canary.step`` and ``stats.forwards`` count moves too);
its step-log entry names the receiving requests (``request_ids``, one per ``request_lens`` run of
entries) and the move as the forward kind (``"import:<label>"``, ``"copy:<label>"``), so a violation
found on receipt names the transfer and the request it was meant for, and later sweep rows on a moved
slot blame that request (the slot records' owner is the move's step and request).

Every error on bad input is a ``kv-canary:`` ValueError / TypeError raised before anything changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops import CanaryLaunchTag, TOKEN_TO_KV_SLOT_PADDING, VerifyPlan, launch_canary_verify_kernel, launch_stamp_violation_rows
from kvcanary.ops.copy import export_canary_records, import_canary_records, launch_canary_copy_slots_kernel
from kvcanary.ops.copy_format import CANARY_RECORDS_HEADER_ROWS, check_canary_records
from kvcanary.ops.constants import CANARY_FIELD_POSITION
from kvcanary.ops.reference.common import last_occurrence_mask
from kvcanary.runtime.attribution import Violation
from kvcanary.runtime.groups import NEVER_WRITTEN, CanaryGroup
from kvcanary.runtime.owners import OWNER_SPAN

if TYPE_CHECKING:
    from kvcanary.runtime.canary import Canary

Slots = Union[torch.Tensor, Sequence[int]]
UNKNOWN_PREDECESSOR = 0  # slot-record prev_slot for a link nobody can check (slot 0 is never written)


@dataclass(frozen=True, kw_only=True)
class MoveReport:
    """One move. step: the canary step number it took; kind: ``copy`` or ``import``; label: the caller's
    name for it (e.g. a transfer id); moved: live entries (slot > 0 on both ends); verified: slots verified
    on receipt per hashed side (0 without verify); violations: what that verify found, attributed."""

    step: int
    kind: str
    label: str
    moved: int
    verified: int
    violations: tuple[Violation, ...]

    @property
    def clean(self) -> bool:
        return not self.violations


def move_tags(groups: Sequence[CanaryGroup]) -> list[CanaryLaunchTag]:
    """The MOVE ring keys (group name, MOVE tag of its kind) the rings need for ``groups`` (one per group and hashed
    side)."""
    return [(g.name, CanaryLaunchTag.of(phase="move", side=s, group=g.kind)) for g in groups for s in g.tail_sides]


def record_tables(g: CanaryGroup) -> tuple[torch.Tensor, ...]:
    """The group's record tables in export order: HEAD, then TAIL per hashed side (k, v), then the deep
    fingerprint buffers (every layer's bytes; sorted by (chunk, side)) when the group has them — the sweep
    verifies those too, so they must move with the KV like the rest."""
    deep = getattr(g, "deep_bufs", {})
    return (g.head_buf,) + tuple(g.tail_bufs[s] for s in g.tail_sides) + tuple(deep[k] for k in sorted(deep))


class SlotMoves:
    """The runtime side of KV moves for one `Canary` (see the module docstring)."""

    def __init__(self, canary: "Canary") -> None:
        self.canary = canary
        self.copies = 0
        self.imports = 0
        self.slots_copied = 0
        self.slots_imported = 0
        self._found: dict[int, list[Violation]] = {}
        self._no_assert = torch.zeros(1, dtype=torch.int32, device=canary.device)
        canary.ledger.add_sink(self._collect)

    # ---- the three moves -----------------------------------------------------------------------------
    def copy_slots(self, group: str, src: Slots, dst: Slots, *, request_ids: Optional[Sequence[Optional[str]]] = None,
                   request_lens: Optional[Sequence[int]] = None, verify: bool = False, label: str = "",
                   context_keys: Optional[Sequence[int]] = None) -> MoveReport:
        """Copy the canary state of ``src[i]`` to ``dst[i]`` (call when the engine copies that KV).

        src, dst: int [N] slot lists (tensor or sequence), same length. request_ids / request_lens: who
        owns the destinations (``request_lens`` splits the N entries into runs, one per id; default one
        run). verify=True also verifies the destinations against their real KV now (the KV copy must have
        happened already). context_keys: one int per run, the receiving request's context key as given in
        ``BatchDescription.context_keys`` (0 = none; default: none) — position 0 is verified against it.
        """
        c = self._open("copy_slots")
        g = c._group(group)
        src_t = self._slots("copy_slots", "src", src, g)
        dst_t = self._slots("copy_slots", "dst", dst, g)
        if src_t.numel() != dst_t.numel():
            raise KvCanaryValueError(f"kv-canary: copy_slots src has {src_t.numel()} entries, dst has {dst_t.numel()}")
        ids, lens = self._requests("copy_slots", request_ids, request_lens, int(dst_t.numel()))
        step = c.begin_step(request_ids=ids, forward_kind=f"copy:{label}" if label else "copy")
        launch_canary_copy_slots_kernel(canary_bufs=record_tables(g), src_slots=src_t, dst_slots=dst_t)
        live = (src_t > TOKEN_TO_KV_SLOT_PADDING) & (dst_t > TOKEN_TO_KV_SLOT_PADDING)
        self._copy_slot_records(g, src_t, dst_t, live, lens if request_ids is not None else None)
        moved = int(live.sum())
        self.copies += 1
        self.slots_copied += moved
        verified = 0
        if verify:
            positions = g.records.position[dst_t.clamp(0, g.num_slots)]
            links = self._links(dst_t, positions, lens, anchors=self._anchors(g, context_keys, lens))
            verified = self._verify(g, dst_t, positions, None, links, lens)
        return self._finish(step, "copy", label, moved, verified)

    def export_records(self, group: str, slots: Slots) -> torch.Tensor:
        """The records of ``slots`` (every table of the group) as int64 ``[1 + n, 4 * B]`` on the canary's
        device (``ops/copy_format.py``); ``canary_records_to_bytes`` makes bytes of it. Reads only."""
        c = self._open("export_records")
        g = c._group(group)
        return export_canary_records(canary_bufs=record_tables(g), slots=self._slots("export_records", "slots", slots, g))

    def import_records(
        self, group: str, slots: Slots, records: torch.Tensor, verify: bool = True, *,
        positions: Optional[Slots] = None, tokens: Optional[Slots] = None,
        request_ids: Optional[Sequence[Optional[str]]] = None, request_lens: Optional[Sequence[int]] = None,
        prev_slots: Optional[Slots] = None, label: str = "", context_keys: Optional[Sequence[int]] = None,
    ) -> MoveReport:
        """Install ``records`` into ``slots`` and (``verify``) check them against the KV now in those slots.

        slots: int [N] receiver slots, in the order the export listed them (slot 0 = skip that row).
        records: an export of N slots with this group's tables (CPU or the canary's device).
        positions: int [N] positions the receiver expects (default: the carried ones). tokens: int [N]
        expected tokens (default: not checked). request_ids / request_lens: the receiving requests, each a
        run of entries in position order (default: one run). prev_slots: int [len(runs)] the slot holding
        the position before each run's first entry, when the receiver has it (default: checked only for
        position 0, against the chain anchor). context_keys: one int per run, the receiving request's context
        key as given in ``BatchDescription.context_keys`` (0 = none; default: none): position 0 is verified
        against that context's anchor. Returns the `MoveReport`; in ``raise`` mode a violation raises
        `CanaryViolationError` after the records are installed.
        """
        c = self._open("import_records")
        g = c._group(group)
        op = "import_records"
        s = self._slots(op, "slots", slots, g)
        n = int(s.numel())
        tables = record_tables(g)
        check_canary_records(op, records, num_records=n, num_buffers=len(tables))
        ids, lens = self._requests(op, request_ids, request_lens, n)
        expected = self._values(op, "positions", positions, n, g.device)
        want_tokens = self._values(op, "tokens", tokens, n, g.device)
        seeds = self._values(op, "prev_slots", prev_slots, len(lens), g.device)
        step = c.begin_step(request_ids=ids, forward_kind=f"import:{label}" if label else "import")
        import_canary_records(canary_bufs=tables, slots=s, records=records)
        carried = records[CANARY_RECORDS_HEADER_ROWS:, CANARY_FIELD_POSITION].to(g.device)
        if expected is None:
            expected = carried
        links = self._links(s, expected, lens, seeds, anchors=self._anchors(g, context_keys, lens))
        live = s > TOKEN_TO_KV_SLOT_PADDING
        owners = self._owner_codes(step, lens, g.device)
        prev = torch.where(links >= g.num_slots, g.num_slots, links.clamp(min=-1))  # a context anchor: the trash row
        self._store_slot_records(g, s, live, position=carried, prev_slot=prev, owner=owners, step=step)
        moved = int(live.sum())
        self.imports += 1
        self.slots_imported += moved
        verified = self._verify(g, s, expected, want_tokens, links, lens) if verify else 0
        return self._finish(step, "import", label, moved, verified)

    # ---- helpers ---------------------------------------------------------------------------------------
    def _open(self, op: str) -> "Canary":
        c = self.canary
        c._check_open()
        if c._depth:
            raise KvCanaryRuntimeError(f"kv-canary: {op}() inside an open forward; KV moves are recorded between forwards")
        return c

    @staticmethod
    def _slots(op: str, name: str, slots: Slots, g: CanaryGroup) -> torch.Tensor:
        t = slots if isinstance(slots, torch.Tensor) else torch.tensor(list(slots), dtype=torch.int64)
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise KvCanaryTypeError(f"kv-canary: {op} {name} must be a 1-D int32/int64 slot list, got {t.dtype} {tuple(t.shape)}")
        return t.to(device=g.device, dtype=torch.int64).contiguous()

    @staticmethod
    def _values(op: str, name: str, values: Optional[Slots], n: int, device: torch.device) -> Optional[torch.Tensor]:
        if values is None:
            return None
        t = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.int64)
        if t.dim() != 1 or t.numel() != n:
            raise KvCanaryValueError(f"kv-canary: {op} {name} must have {n} entries, got shape {tuple(t.shape)}")
        return t.to(device=device, dtype=torch.int64)

    @staticmethod
    def _requests(op: str, ids: Optional[Sequence[Optional[str]]], lens: Optional[Sequence[int]], n: int):
        lens = [n] if lens is None else [int(x) for x in lens]
        if any(x < 0 for x in lens) or sum(lens) != n:
            raise KvCanaryValueError(f"kv-canary: {op} request_lens {lens} must be non-negative and sum to {n} entries")
        ids = tuple(ids) if ids is not None else (None,) * len(lens)
        if len(ids) != len(lens):
            raise KvCanaryValueError(f"kv-canary: {op} has {len(ids)} request_ids for {len(lens)} request_lens runs")
        return ids, lens

    @staticmethod
    def _anchors(g: CanaryGroup, keys: Optional[Sequence[int]], lens: list[int]) -> Optional[torch.Tensor]:
        """Per run, the canary row its position 0 chains from: -1 (the chain head) without a key, else the
        group's context anchor row ``num_slots + run`` holding the key (written here; the next forward's HEAD
        rewrites the anchors), UNKNOWN_PREDECESSOR past the anchor rows. None without keys."""
        if keys is None:
            return None
        keys = [int(k) for k in keys]
        if len(keys) != len(lens):
            raise KvCanaryValueError(f"kv-canary: context_keys has {len(keys)} keys for {len(lens)} request runs")
        if not any(keys):
            return None
        n = g.anchor_rows
        anchor_keys = torch.zeros(n, dtype=torch.int64)
        anchor_keys[: min(n, len(keys))] = torch.tensor(keys[:n], dtype=torch.int64)
        g.set_anchor_keys(anchor_keys.to(g.device))
        rows = [-1 if k == 0 else (g.num_slots + i if i < n else UNKNOWN_PREDECESSOR) for i, k in enumerate(keys)]
        return torch.tensor(rows, dtype=torch.int64, device=g.device)

    @staticmethod
    def _links(slots: torch.Tensor, positions: torch.Tensor, lens: list[int],
               seeds: Optional[torch.Tensor] = None, anchors: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Predecessor of each entry for the verify: the previous entry of its run when that holds the
        previous position, the run's seed (``prev_slots``) for its first entry, the run's anchor (-1, the chain
        head, without ``anchors``) at position 0, else UNKNOWN_PREDECESSOR (link not checked)."""
        n = slots.numel()
        dev = slots.device
        run = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
        prev = torch.full((n,), UNKNOWN_PREDECESSOR, dtype=torch.int64, device=dev)
        if n > 1:
            chained = (run[1:] == run[:-1]) & (positions[1:] == positions[:-1] + 1)
            prev[1:] = torch.where(chained, slots[:-1], prev[1:])
        if seeds is not None and n:
            starts = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)[:-1].tolist()), device=dev)
            nonempty = torch.tensor(lens, device=dev) > 0
            prev[starts[nonempty]] = seeds[nonempty]
        head = torch.full_like(prev, -1) if anchors is None else anchors[run]
        return torch.where(positions == 0, head, prev)

    def _owner_codes(self, step: int, lens: list[int], device: torch.device) -> torch.Tensor:
        run = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
        return step * self.canary_owner_span + run

    @property
    def canary_owner_span(self) -> int:
        return OWNER_SPAN

    def _copy_slot_records(self, g: CanaryGroup, src: torch.Tensor, dst: torch.Tensor, live: torch.Tensor,
                           lens: Optional[list[int]]) -> None:
        """Slot records of the copies: the source's position; its predecessor, remapped when that was
        copied too (same call); owner = the receiving request, or the source's owner when none is named."""
        rec = g.records
        safe_src = torch.where(live, src, 0)
        prev = rec.prev_slot[safe_src]
        if live.any():
            ls, ld = src[live], dst[live]
            order = torch.argsort(ls, stable=True)
            sorted_src, sorted_dst = ls[order], ld[order]
            at = torch.searchsorted(sorted_src, prev).clamp(max=sorted_src.numel() - 1)
            hit = sorted_src[at] == prev
            prev = torch.where(hit, sorted_dst[at], prev)
        owner = rec.owner[safe_src] if lens is None else self._owner_codes(self.canary.step, lens, g.device)
        # A source never written (e.g. the unwritten tail of a forked request's last block) gives a destination
        # never written: its copied record is empty, and must not pass for one written at the move's step.
        unwritten = rec.step[safe_src] == NEVER_WRITTEN
        never = torch.full_like(prev, NEVER_WRITTEN)
        self._store_slot_records(g, dst, live, position=torch.where(unwritten, never, rec.position[safe_src]),
                                 prev_slot=torch.where(unwritten, never, prev),
                                 owner=torch.where(unwritten, never, owner),
                                 step=torch.where(unwritten, never, torch.full_like(prev, self.canary.step)))

    @staticmethod
    def _store_slot_records(g: CanaryGroup, slots: torch.Tensor, live: torch.Tensor, *, position: torch.Tensor,
                            prev_slot: torch.Tensor, owner: torch.Tensor, step: Union[int, torch.Tensor]) -> None:
        """Write the entries' slot records (live entries only; a slot named twice keeps its last entry); ``step``:
        one step for all, or int64 [n] per entry."""
        keep = live.clone()
        if keep.any():
            idx = keep.nonzero().squeeze(1)
            last = last_occurrence_mask(slots[idx])
            keep[idx[~last]] = False
        if not keep.any():
            return
        idx = slots[keep]
        rec = g.records
        rec.position[idx] = position[keep]
        rec.prev_slot[idx] = prev_slot[keep]
        rec.owner[idx] = owner[keep]
        rec.step[idx] = step[keep] if isinstance(step, torch.Tensor) else step

    def _verify(self, g: CanaryGroup, slots: torch.Tensor, positions: torch.Tensor, tokens: Optional[torch.Tensor],
                links: torch.Tensor, lens: list[int]) -> int:
        """TAIL verify of the moved slots under the MOVE tags, stamped with (move step, request run)."""
        c = self.canary
        n = int(slots.numel())
        if n == 0:
            return 0
        plan = VerifyPlan.allocate(n, g.device)
        plan.verify_slot_indices.copy_(slots)
        plan.verify_expected_positions.copy_(positions)
        plan.verify_expected_tokens.copy_(tokens if tokens is not None else torch.full_like(slots, -1))
        plan.verify_prev_slot_indices.copy_(links)
        plan.verify_num_valid.fill_(n)
        runs = torch.ones(len(lens), dtype=torch.int64, device=g.device)
        run_lens = torch.tensor(lens, dtype=torch.int64, device=g.device)
        c.rings.mark()
        for side in g.tail_sides:
            tag = CanaryLaunchTag.of(phase="move", side=side, group=g.kind)
            ring, write_index = c.rings.ring_for(g.name, tag)
            slot_counter, kernel_counter = c.launch_counters.views("verify", tag)
            ctx = g.context("tail", side, "verify", rings=c.rings, counters=c.launch_counters, chain_assert=self._no_assert)
            ctx = _retagged(ctx, tag, ring, write_index, slot_counter, kernel_counter)
            launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=tokens is not None)
            launch_stamp_violation_rows(**c.rings.stamp_args(g.name, tag), step=c.launches.step, verify_plan=plan,
                                        req_pool_indices=runs, prefix_lens=run_lens)
        return int((slots > TOKEN_TO_KV_SLOT_PADDING).sum())

    def _collect(self, v: Violation) -> None:
        if v.launch_tag.phase == "move":
            self._found.setdefault(v.step, []).append(v)

    def _finish(self, step: int, kind: str, label: str, moved: int, verified: int) -> MoveReport:
        c = self.canary
        if verified:
            c._flush()
        found = tuple(self._found.pop(step, ()))
        report = MoveReport(step=step, kind=kind, label=label, moved=moved, verified=verified, violations=found)
        c._raise_if_needed(step)
        return report


def _retagged(ctx, tag, ring, write_index, slot_counter, kernel_counter):
    """The TAIL verify context of a side, recording under the MOVE tag's ring and counters."""
    from dataclasses import replace

    return replace(ctx, kernel_kind=tag, violation_ring=ring, violation_write_index=write_index,
                   slot_run_counter=slot_counter, kernel_run_counter=kernel_counter)


__all__ = ["MoveReport", "SlotMoves", "move_tags", "record_tables"]
