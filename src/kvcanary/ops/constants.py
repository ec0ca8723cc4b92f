"""Op-contract constants and enums (docs/design.md §3.1).

The facts about a launch tag (which phase, which buffer side, which group) live on
`CanaryLaunchTag` itself so nobody parses member names.
"""
from __future__ import annotations

import enum
from kvcanary.errors import KvCanaryValueError

MASK64 = (1 << 64) - 1  # unsigned 64-bit values held in int64 tensors / Python ints

CANARY_CHAIN_ANCHOR = 0xC0FFEE1234567890
REQ_POOL_IDX_PADDING = 0
TOKEN_TO_KV_SLOT_PADDING = 0

CANARY_FIELDS_PER_SLOT = 4
CANARY_FIELD_TOKEN = 0
CANARY_FIELD_POSITION = 1
CANARY_FIELD_PREV_HASH = 2
CANARY_FIELD_REAL_KV_HASH = 3

VIOLATION_FIELDS = 8
VIOLATION_FIELD_KERNEL_KIND = 0
VIOLATION_FIELD_SLOT_IDX = 1
VIOLATION_FIELD_POSITION = 2
VIOLATION_FIELD_STORED_TOKEN = 3
VIOLATION_FIELD_EXPECTED_TOKEN = 4
VIOLATION_FIELD_STORED_CHAIN_HASH = 5
VIOLATION_FIELD_EXPECTED_AUX = 6
VIOLATION_FIELD_FAIL_REASON_BITS = 7

MAX_REAL_KV_SOURCES = 4
PARTIAL_REAL_KV_READ_BYTES = 16

STAMP_FIELDS = 3
"""A violation row's stamp (``launch_stamp_violation_rows``): int64 [cap, 3] beside the ring."""
STAMP_FIELD_STEP = 0
STAMP_FIELD_BATCH_ROW = 1
STAMP_FIELD_EXPECTED_POSITION = 2
STAMP_UNKNOWN = -1
"""Batch row / expected position of a stamp that could not be attributed."""


class FailReason(enum.IntFlag):
    """Bits of a violation row's FAIL_REASON_BITS field.

    Bits 1..32 are the op contract's (docs/design.md §3.1). Extension (issue 10 item 5): a slot index outside
    ``[0, num_slots)`` of the canary buffer is reported, never dereferenced.

    * ``VERIFY_SLOT_OUT_OF_RANGE`` (64, label ``verify_slot_out_of_range``): a verify entry whose
      slot is not 0 (padding) and lies outside ``[0, num_slots)``, or whose predecessor is
      ``>= num_slots`` (a negative predecessor still means "chain head", 0 "unreachable"). Row:
      ``[kind, slot, stored_position, stored_token, expected_token, stored_prev_hash, prev_slot, bits]``
      where the three stored fields are read when the slot itself is in range and are 0 when it
      is not, and EXPECTED_AUX holds the entry's predecessor slot index (the expected chain cannot
      be computed). The bit is the row's only bit: no other check is made for that entry.
    * ``WRITE_SLOT_OUT_OF_RANGE`` (128, label ``write_slot_out_of_range``): a write entry whose
      slot is ``>= num_slots`` (negative slots still mean "not stored"). The entry is not stored,
      not counted, does not advance the chain and is not the chain-position assert's ``last_pos``
      (like a negative slot); it is not input-asserted. Row: ``[kind, slot, position, token, token,
      running, position, bits]`` (``running``: the prev_hash the next stored entry of the request
      gets). A write row (``WRITE_FAIL_REASONS``), so stamps attribute it to the writing batch row.
      A *seed* ``>= num_slots`` is read as an all-zero record (token 0, position 0, prev_hash 0);
      the HEAD verify of the same plan reports that slot with ``VERIFY_SLOT_OUT_OF_RANGE``.

    Extension (issue 36 item 4): the verify op skips every entry whose slot is the padding slot 0 (and the
    chain link of the next position with it), as SGLang's contract pins; a read through the padding slot is
    judged beside the ops, by the padding-read check (``kvcanary.ops.padding_reads``).

    * ``VERIFY_PADDING_SLOT_READ`` (256, label ``verify_padding_slot_read``): a position inside a live
      request's read range (full attention: its prefix ``[0, P)``; a sliding window: the positions of its
      window before the row's first query token) whose slot resolves to the padding slot 0. Set only by
      ``launch_padding_read_check_kernel``, never by verify or write. Row: ``[kind, 0, position, 0, -1, 0,
      raw_slot, bits]`` (``raw_slot``: the table's entry before the LUT); the check stamps it itself with
      ``(step, batch row, position)``. A verify row (not in ``WRITE_FAIL_REASONS``).
    """

    VERIFY_CHAIN_HASH_MISMATCH = 1
    VERIFY_POSITION_MISMATCH = 2
    VERIFY_REAL_KV_HASH_MISMATCH = 4
    WRITE_TOKEN_MISMATCH = 8
    WRITE_POSITION_MISMATCH = 16
    VERIFY_TOKEN_MISMATCH = 32
    VERIFY_SLOT_OUT_OF_RANGE = 64
    WRITE_SLOT_OUT_OF_RANGE = 128
    VERIFY_PADDING_SLOT_READ = 256  # appended (issue 36 item 4): set by the padding-read check only

    @property
    def label(self) -> str:
        """Report label: e.g. ``verify_real_kv_hash``; several bits join with ``+``."""
        return reason_label(int(self))


WRITE_FAIL_REASONS = int(
    FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH | FailReason.WRITE_SLOT_OUT_OF_RANGE
)
"""A ring row is a write row iff its FAIL_REASON_BITS field has one of these bits."""


def reason_label(bits: int) -> str:
    """Report label for a bit set, lowest bit first (``verify_chain_hash+verify_position``)."""
    names = [
        member.name.lower().removesuffix("_mismatch")
        for member in FailReason
        if int(bits) & int(member)
    ]
    unknown = int(bits) & ~sum(int(m) for m in FailReason)
    if unknown:
        names.append(f"unknown_0x{unknown:x}")
    return "+".join(names) if names else "none"


class RealKvHashMode(enum.IntEnum):
    """How a context fingerprints its real-KV strips (docs/design.md §3.2).

    NONE, PARTIAL and ALL are the op contract's. LANES (*extension*, kvcanary's deep buffers only; never a
    ``real_kv_hash`` option) reads the same bytes as ALL but folds a strip's words in parallel: a wrapping sum
    of ``splitmix64(w_i ^ LANES_WORD_KEY * (i + 1))``; the sources combine as in ALL.
    """

    NONE = 0
    PARTIAL = 1
    ALL = 2
    LANES = 3  # appended: the deep fingerprints' parallel fold (extension)


LANES_WORD_KEY = 0x9E3779B97F4A7C15
"""LANES mode keys word ``i`` (from 0) of a strip with ``(i + 1) * LANES_WORD_KEY mod 2^64`` before splitmix64, so the
words' order matters although their hashes are summed."""


class CanaryLaunchTag(enum.IntEnum):
    """Stamped into every violation row as KERNEL_KIND: phase x side (K/V) x group."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11
    # Appended (issue 9): the verify that checks KV moved into slots (copy, import) on receipt.
    MOVE_K_FULL = 12
    MOVE_V_FULL = 13
    MOVE_K_SWA = 14
    MOVE_V_SWA = 15

    @property
    def phase(self) -> str:
        """``head``, ``tail``, ``sweep`` or ``move``."""
        if self.value >= 12:
            return "move"
        return ("head", "tail", "sweep")[(self.value % 6) // 2]

    @property
    def side(self) -> str:
        """``k`` or ``v``."""
        return "kv"[self.value % 2]

    @property
    def group(self) -> str:
        """``full`` or ``swa``."""
        if self.value >= 12:
            return "full" if self.value < 14 else "swa"
        return "full" if self.value < 6 else "swa"

    @classmethod
    def of(cls, *, phase: str, side: str, group: str) -> "CanaryLaunchTag":
        """The tag for a phase (head/tail/sweep/move), side (k/v) and group (full/swa)."""
        phases = ("head", "tail", "sweep")
        if phase not in phases + ("move",) or side not in ("k", "v") or group not in ("full", "swa"):
            raise KvCanaryValueError(
                f"kv-canary: no launch tag for phase={phase!r} side={side!r} group={group!r}"
            )
        if phase == "move":
            return cls(12 + (0 if group == "full" else 2) + "kv".index(side))
        return cls((0 if group == "full" else 6) + 2 * phases.index(phase) + "kv".index(side))
