"""Attribution: decoded ring rows become `Violation`s that name the request they hit.

* `StepLog` — a bounded host log of what each step ran (step -> request ids, request rows, forward kind),
  filled in O(1) per forward (it keeps references to what the adapter built anyway).
* `Attributor` — turns a drain's `Harvest` into `Attributed` violations. HEAD/TAIL rows carry their step and
  batch row in their stamp (the request that read or wrote the slot); SWEEP rows are charged to the slot's last
  writer, from the runtime's slot records (owner code ``step * owner_span + batch row``), and dropped as stale when
  their slot left the live set since the pass began. What it needs of the runtime it asks one `OwnerLookup`
  (`kvcanary.runtime.lookup.RecordLookup`). Attribution happens only when rows exist, so its host reads are off
  the per-forward path.

The violation path, in four files: born in a kernel's ring row (`kvcanary.runtime.drain`: `ViolationRings`),
drained into a `Harvest` (`drain.ViolationDrain`), attributed here, reported (`kvcanary.runtime.report`:
`ViolationLedger`, `CanaryViolationError`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Optional, Protocol, Sequence

from kvcanary.ops import CanaryLaunchTag, FailReason
from kvcanary.ops.constants import MASK64
from kvcanary.runtime.drain import Harvest, RingKey, RingRow
from kvcanary.runtime.identity import (IDENTITY_ADAPTER, IDENTITY_CONTEXT, IDENTITY_MISMATCH, IDENTITY_MULTIMODAL,
                                       IDENTITY_SALT, IDENTITY_WEIGHTS_VERSION, IdentityRegistry, name_identities)
from kvcanary.runtime.reads import READ_TABLE_MISMATCH, RUNTIME_REASONS, reason_label

DEFAULT_STEP_LOG = 65536


REASON_MEANING = {
    FailReason.VERIFY_CHAIN_HASH_MISMATCH: "the slot's chain link does not match its predecessor's record "
    "(the slot holds another sequence's KV, or its predecessor was overwritten)",
    FailReason.VERIFY_POSITION_MISMATCH: "the slot holds KV for another position than the one the table maps to it",
    FailReason.VERIFY_REAL_KV_HASH_MISMATCH: "the K/V bytes changed after they were written",
    FailReason.WRITE_TOKEN_MISMATCH: "the engine wrote a token other than the oracle's",
    FailReason.WRITE_POSITION_MISMATCH: "the engine wrote a position that does not continue its sequence",
    FailReason.VERIFY_TOKEN_MISMATCH: "the slot's token differs from the request's token history",
    FailReason.VERIFY_SLOT_OUT_OF_RANGE: "the plan names a slot outside the canary buffer (a garbage slot index)",
    FailReason.WRITE_SLOT_OUT_OF_RANGE: "the engine stored KV at a slot outside the canary buffer",
    FailReason.VERIFY_PADDING_SLOT_READ: "a position the request still reads (its prefix, or inside its sliding "
    "window) maps to the padding / null slot: attention reads KV nobody wrote for it, and the verify skips that slot",
    READ_TABLE_MISMATCH: "attention reads entries the request does not own there (a surplus or missing page, or a "
    "new token read from another slot than the one written), so the canary's table does not cover what is read",
    # host-side classifications of a position-0 chain row or a placeholder's token row (runtime/identity.py)
    IDENTITY_ADAPTER: "the cached KV was produced under another LoRA / adapter than the reading request's",
    IDENTITY_SALT: "the cached KV was produced under another cache salt than the reading request's",
    IDENTITY_WEIGHTS_VERSION: "the cached KV was produced by other model weights (a prefix cache that survived a "
    "weight update)",
    IDENTITY_CONTEXT: "the cached KV was produced under another context key than the reading request's",
    IDENTITY_MULTIMODAL: "the cached KV at a multimodal placeholder was computed from another image / item than the "
    "reading request's (a prefix-cache key that ignores the item's content)",
    IDENTITY_MISMATCH: "the cached KV was produced under another identity, one this canary cannot name (not issued "
    "by it, or forgotten)",
}


def _hex(x: Optional[int]) -> str:
    return "-" if x is None else f"0x{x & MASK64:016x}"


@dataclass(frozen=True, kw_only=True)
class Violation:
    """One canary mismatch, decoded and attributed.

    op: ``verify`` or ``write`` (which launch recorded it). stored_position: the slot's stored
    position (verify) or the position being written (write); expected_position: what the table /
    sequence called for (None when unknown). expected_token is None when no token was expected.
    stored_hash: the stored prev_hash (verify) or the chain value written (write); expected_hash:
    the predecessor's chain value (verify only). request_id / request_row: the request that read or
    wrote the slot (HEAD/TAIL), or the slot's last writer (SWEEP); None when unknown.
    stored_fingerprint / recomputed_fingerprint (``verify_real_kv_hash`` rows only): the real-KV fingerprint
    the slot's record holds and the one its K/V bytes give, both read when the row was drained (not when it was
    checked: a slot rewritten in between shows two equal values); fingerprint_scope: which bytes they cover (a
    sweep row: the first record that disagrees now — the TAIL one, or a deep one of every byte of a few layers).
    ``read_table_mismatch`` rows (`kvcanary.runtime.reads`): slot is the slot attention reads, stored_position /
    stored_token what that slot's HEAD record holds, expected_position the position the read stands for;
    reads / owned_reads the entries attention reads for the row and the entries the row owns; expected_slot the
    slot the row owns at that position (None: no such position); stored_hash is 0 and expected_hash None.
    ``verify_padding_slot_read`` rows (`kvcanary.ops.padding_reads`): slot is the padding slot 0, stored_position and
    expected_position the position read, expected_slot the table's raw entry there (a full-space slot before the
    group's LUT; 0 without one); stored_token and stored_hash are 0, expected_token and expected_hash None.
    identity_detail: with an ``identity_*`` reason (host-side, `kvcanary.runtime.identity`), what differed (stored ->
    expected); None otherwise.
    """

    launch_tag: CanaryLaunchTag
    group: str
    op: str
    slot: int
    stored_position: int
    expected_position: Optional[int]
    stored_token: int
    expected_token: Optional[int]
    stored_hash: int
    expected_hash: Optional[int]
    reasons: FailReason
    request_id: Optional[str]
    request_row: Optional[int]
    step: int
    forward_kind: str
    stored_fingerprint: Optional[int] = None
    recomputed_fingerprint: Optional[int] = None
    fingerprint_scope: Optional[str] = None
    reads: Optional[int] = None
    owned_reads: Optional[int] = None
    expected_slot: Optional[int] = None
    identity_detail: Optional[str] = None

    @property
    def position(self) -> int:
        return self.stored_position

    @property
    def reason_label(self) -> str:
        return reason_label(int(self.reasons))

    @property
    def phase(self) -> str:
        return self.launch_tag.phase

    def log_line(self) -> str:
        """The stable one-line form (``kv_canary violation: launch_tag=... fail_reason=...``); a row that carries
        real-KV fingerprints ends with ``stored_fingerprint=... recomputed_fingerprint=...`` (the chain hashes
        before them agree on such a row: the record is intact, the K/V bytes are not)."""
        exp_tok = "-" if self.expected_token is None else self.expected_token
        exp_pos = "-" if self.expected_position is None else self.expected_position
        return (
            f"kv_canary violation: launch_tag={self.launch_tag.name} fail_reason={self.reason_label} "
            f"slot_idx={self.slot} position={self.position} expected_position={exp_pos} "
            f"stored_token={self.stored_token} expected_token={exp_tok} "
            f"stored_hash={_hex(self.stored_hash)} expected_hash={_hex(self.expected_hash)} "
            f"group={self.group} op={self.op} request_id={self.request_id if self.request_id is not None else '-'} "
            f"request_row={self.request_row if self.request_row is not None else '-'} "
            f"step={self.step} forward_kind={self.forward_kind}"
            + ("" if self.stored_fingerprint is None else
               f" stored_fingerprint={_hex(self.stored_fingerprint)} recomputed_fingerprint={_hex(self.recomputed_fingerprint)}")
        )

    def readable(self) -> str:
        """A multi-line block for people."""
        who = "unknown request" if self.request_id is None else f"request {self.request_id!r}"
        if self.request_row is not None:
            who += f" (row {self.request_row})"
        lines = [
            f"kv-canary: {self.reason_label} at step {self.step} ({self.forward_kind}), {who}",
            f"  where:    group {self.group!r}, slot {self.slot}, {self.launch_tag.name} {self.op}",
            f"  position: {self.position}" + ("" if self.expected_position is None else f", expected {self.expected_position}"),
            f"  token:    {self.stored_token}" + ("" if self.expected_token is None else f", expected {self.expected_token}"),
            f"  chain:    {_hex(self.stored_hash)}" + ("" if self.expected_hash is None else f", expected {_hex(self.expected_hash)}"),
        ]
        if self.stored_fingerprint is not None:
            scope = f" ({self.fingerprint_scope})" if self.fingerprint_scope else ""
            lines.append(f"  real KV:  record {_hex(self.stored_fingerprint)}, bytes now {_hex(self.recomputed_fingerprint)}{scope}")
            if self.stored_fingerprint == self.recomputed_fingerprint:
                lines.append("            equal now (read after the check): the slot was rewritten, or its bytes restored, "
                             "between the check and this report")
        if self.reads is not None:
            owns = "no such position" if self.expected_slot is None else f"slot {self.expected_slot} there"
            lines.append(f"  reads:    {self.reads} entries for {self.owned_reads} owned; the read of position "
                         f"{self.expected_position} is slot {self.slot}, the request owns {owns}")
        if self.identity_detail is not None:
            lines.append(f"  identity: {self.identity_detail}")
        if self.reasons & FailReason.VERIFY_PADDING_SLOT_READ:
            lines.append(f"  read:     position {self.position} resolves to the padding slot (table entry "
                         f"{self.expected_slot})")
        lines += [f"  meaning:  {REASON_MEANING[bit]}" for bit in (*FailReason, *RUNTIME_REASONS) if int(self.reasons) & int(bit)]
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = asdict(self)
        d["launch_tag"] = self.launch_tag.name
        d["reasons"] = int(self.reasons)
        d["fail_reason"] = self.reason_label
        d["stored_hash"] = _hex(self.stored_hash)
        d["expected_hash"] = None if self.expected_hash is None else _hex(self.expected_hash)
        for key in ("stored_fingerprint", "recomputed_fingerprint"):
            d[key] = None if d[key] is None else _hex(d[key])
        return d


@dataclass(frozen=True, slots=True)
class StepEntry:
    request_ids: Optional[Sequence[Optional[str]]]
    request_rows: Optional[Sequence[int]]
    forward_kind: str


class StepLog:
    """step -> `StepEntry` for the last ``capacity`` steps (older steps are forgotten, counted)."""

    def __init__(self, capacity: int = DEFAULT_STEP_LOG) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, StepEntry] = OrderedDict()
        self.forgotten = 0

    def add(self, step: int, entry: StepEntry) -> None:
        self._entries[step] = entry
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.forgotten += 1

    def get(self, step: int) -> Optional[StepEntry]:
        return self._entries.get(step)


class OwnerLookup(Protocol):
    """What attribution asks of the runtime (implemented by `kvcanary.runtime.lookup.RecordLookup`)."""

    def rows_of_step(self, step: int) -> Optional[Sequence[int]]:
        """The request rows ``step`` ran (batch order), when the step log has none; None once forgotten."""

    def slot_owner(self, group: str, slots: list[int]) -> tuple[list[int], list[int]]:
        """(owner codes, positions) of the slot records now."""

    def sweep_owner(self, group: str, step: int, entry: int) -> Optional[int]:
        """Owner code of a rotating slice's ``entry`` when it was swept at ``step``; None once forgotten."""

    def live_slots(self) -> Optional[dict[str, set[int]]]:
        """Slots live now per group; None when unknown (no sweep row is then stale)."""

    def fingerprints(self, group: str, tag: CanaryLaunchTag, slots: list[int]) -> list[tuple]:
        """(stored, recomputed, scope) real-KV fingerprints of group ``group``'s ``slots`` on ``tag``'s side; [] when
        not hashed."""


@dataclass(frozen=True, kw_only=True)
class Attributed:
    """One harvest attributed: ``violations`` (step order), ``counts`` per ring (group, tag) with stale rows taken
    out, and ``stale``: sweep rows dropped because their slot is no longer live (the engine may reuse free memory)."""

    violations: list[Violation]
    counts: dict[RingKey, int]
    stale: int


class Attributor:
    """`Harvest` -> `Attributed` (see the module docstring); ``owners`` answers for the runtime."""

    def __init__(self, *, log: StepLog, owner_span: int, owners: OwnerLookup,
                 identities: Optional[IdentityRegistry] = None) -> None:
        self.log = log
        self.owner_span = owner_span
        self.owners = owners
        # identities the adapter issued (`Canary.identities`): names what differed on identity rows
        self.identities = identities if identities is not None else IdentityRegistry()

    def attribute_harvest(self, harvest: Harvest) -> Attributed:
        """Drop stale sweep rows, then attribute the rest."""
        rows, counts, stale = self._without_stale_sweep_rows(harvest)
        return Attributed(violations=self.attribute(rows), counts=counts, stale=stale)

    def _without_stale_sweep_rows(self, harvest: Harvest):
        """A rotating pass sweeps the slots live at its start; a slot freed since may have been scribbled on by the
        engine (free memory is the engine's to use). Rows of slots no longer live are dropped (and taken out of
        the counts); rows of live slots stand."""
        sweep_rows = [r for r in harvest.rows if r.tag.phase == "sweep"]
        live = self.owners.live_slots() if sweep_rows else None
        if live is None:
            return harvest.rows, harvest.counts, 0
        stale = [r for r in sweep_rows if r.slot not in live.get(r.group, ())]
        if not stale:
            return harvest.rows, harvest.counts, 0
        counts = dict(harvest.counts)
        for r in stale:
            counts[(r.group, r.tag)] -= 1
        gone = {id(r) for r in stale}
        return [r for r in harvest.rows if id(r) not in gone], {t: n for t, n in counts.items() if n}, len(stale)

    def attribute(self, rows: list[RingRow]) -> list[Violation]:
        sweep_rows = [r for r in rows if r.tag.phase == "sweep"]
        owners: dict[tuple[str, int], tuple[int, int]] = {}
        for group in {r.group for r in sweep_rows}:
            slots = sorted({r.slot for r in sweep_rows if r.group == group})
            codes, positions = self.owners.slot_owner(group, slots)
            owners.update({(group, s): (c, p) for s, c, p in zip(slots, codes, positions)})
        out = []
        for r in rows:
            if r.tag.phase == "sweep":
                code, pos = owners.get((r.group, r.slot), (-1, -1))
                swept = self.owners.sweep_owner(r.group, r.step, r.sweep_entry)  # the owner when it was swept
                if swept is not None:
                    code, pos = swept, r.expected_position
                rid, rrow = self._request(*divmod(code, self.owner_span)) if code >= 0 else (None, None)
                out.append(self._violation(r, rid, rrow, None if pos < 0 else pos, "sweep"))
                continue
            entry = self.log.get(r.step)
            rid, rrow = self._request(r.step, r.batch_row) if r.batch_row >= 0 else (None, None)
            if r.is_write:
                expected_pos: Optional[int] = r.expected_aux
            else:
                expected_pos = r.expected_position if r.expected_position >= 0 else None
            out.append(self._violation(r, rid, rrow, expected_pos, entry.forward_kind if entry else "unknown"))
        out = name_identities(self._with_fingerprints(out), self.identities)
        out.sort(key=lambda v: (v.step, v.phase != "head", v.phase == "sweep"))
        return out

    def _with_fingerprints(self, violations: list[Violation]) -> list[Violation]:
        """Fill stored / recomputed fingerprints of ``verify_real_kv_hash`` rows (one read per group and tag)."""
        want: dict[tuple[str, CanaryLaunchTag], list[int]] = {}
        for v in violations:
            if v.reasons & FailReason.VERIFY_REAL_KV_HASH_MISMATCH and v.phase != "head":
                want.setdefault((v.group, v.launch_tag), []).append(v.slot)
        if not want:
            return violations
        found = {}
        for (group, tag), slots in want.items():
            slots = sorted(set(slots))
            found.update({(group, tag, s): fp for s, fp in zip(slots, self.owners.fingerprints(group, tag, slots))})
        out = []
        for v in violations:
            fp = found.get((v.group, v.launch_tag, v.slot))
            out.append(v if fp is None else replace(v, stored_fingerprint=fp[0], recomputed_fingerprint=fp[1],
                                                    fingerprint_scope=(fp[2:] or (None,))[0]))
        return out

    def _request(self, step: int, batch_row: int) -> tuple[Optional[str], Optional[int]]:
        entry = self.log.get(step)
        rid = None
        if entry is not None and entry.request_ids is not None and batch_row < len(entry.request_ids):
            rid = entry.request_ids[batch_row]
        rows = entry.request_rows if entry is not None and entry.request_rows is not None else self.owners.rows_of_step(step)
        rrow = int(rows[batch_row]) if rows is not None and batch_row < len(rows) else None
        return rid, rrow

    @staticmethod
    def _violation(r: RingRow, rid, rrow, expected_pos, kind: str) -> Violation:
        if int(r.reasons) & READ_TABLE_MISMATCH:  # field layout of `runtime.reads`
            return Violation(
                launch_tag=r.tag, group=r.group, op="verify", slot=r.slot, stored_position=r.position,
                expected_position=expected_pos, stored_token=r.stored_token, expected_token=None, stored_hash=0,
                expected_hash=None, reasons=r.reasons, request_id=rid, request_row=rrow, step=r.step,
                forward_kind=kind, reads=r.expected_token, owned_reads=r.stored_hash,
                expected_slot=None if r.expected_aux < 0 else r.expected_aux,
            )
        if int(r.reasons) & FailReason.VERIFY_PADDING_SLOT_READ:  # field layout of `ops.padding_reads`
            return Violation(
                launch_tag=r.tag, group=r.group, op="verify", slot=r.slot, stored_position=r.position,
                expected_position=expected_pos, stored_token=r.stored_token, expected_token=None,
                stored_hash=r.stored_hash, expected_hash=None, reasons=r.reasons, request_id=rid, request_row=rrow,
                step=r.step, forward_kind=kind, expected_slot=r.expected_aux,
            )
        return Violation(
            launch_tag=r.tag,
            group=r.group,
            op="write" if r.is_write else "verify",
            slot=r.slot,
            stored_position=r.position,
            expected_position=expected_pos,
            stored_token=r.stored_token,
            expected_token=None if r.expected_token == -1 else r.expected_token,
            stored_hash=r.stored_hash,
            expected_hash=None if r.is_write else r.expected_aux & MASK64,
            reasons=r.reasons,
            request_id=rid,
            request_row=rrow,
            step=r.step,
            forward_kind=kind,
        )
