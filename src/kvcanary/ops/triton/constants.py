"""The op contract's facts as ``tl.constexpr`` module values, for the kernels (docs/design.md §3.1, §3.2).

Every value comes from ``kvcanary.ops.constants`` or ``kvcanary.ops.hashing``; nothing is
spelled twice. Kernels read module globals only when they are ``tl.constexpr`` (the compiler
refuses other globals, the interpreter does not: docs/lab/NOTES.md, run 1).
"""
from __future__ import annotations

import triton.language as tl

from kvcanary.ops import constants as c
from kvcanary.ops.hashing import SPLITMIX64_GAMMA_1, SPLITMIX64_GAMMA_2, SPLITMIX64_SHIFTS

# splitmix64 finaliser
GAMMA_1 = tl.constexpr(SPLITMIX64_GAMMA_1)
GAMMA_2 = tl.constexpr(SPLITMIX64_GAMMA_2)
SHIFT_1 = tl.constexpr(SPLITMIX64_SHIFTS[0])
SHIFT_2 = tl.constexpr(SPLITMIX64_SHIFTS[1])
SHIFT_3 = tl.constexpr(SPLITMIX64_SHIFTS[2])
LANES_KEY = tl.constexpr(c.LANES_WORD_KEY)  # LANES mode: word i's key is (i + 1) * LANES_KEY

# padding
SLOT_PADDING = tl.constexpr(c.TOKEN_TO_KV_SLOT_PADDING)
REQ_PADDING = tl.constexpr(c.REQ_POOL_IDX_PADDING)

# canary record fields (int64 words of a canary row)
FIELDS_PER_SLOT = tl.constexpr(c.CANARY_FIELDS_PER_SLOT)
F_TOKEN = tl.constexpr(c.CANARY_FIELD_TOKEN)
F_POSITION = tl.constexpr(c.CANARY_FIELD_POSITION)
F_PREV_HASH = tl.constexpr(c.CANARY_FIELD_PREV_HASH)
F_REAL_KV = tl.constexpr(c.CANARY_FIELD_REAL_KV_HASH)

# violation ring rows
RING_FIELDS = tl.constexpr(c.VIOLATION_FIELDS)
R_KIND = tl.constexpr(c.VIOLATION_FIELD_KERNEL_KIND)
R_SLOT = tl.constexpr(c.VIOLATION_FIELD_SLOT_IDX)
R_POSITION = tl.constexpr(c.VIOLATION_FIELD_POSITION)
R_STORED_TOKEN = tl.constexpr(c.VIOLATION_FIELD_STORED_TOKEN)
R_EXPECTED_TOKEN = tl.constexpr(c.VIOLATION_FIELD_EXPECTED_TOKEN)
R_CHAIN = tl.constexpr(c.VIOLATION_FIELD_STORED_CHAIN_HASH)
R_AUX = tl.constexpr(c.VIOLATION_FIELD_EXPECTED_AUX)
R_BITS = tl.constexpr(c.VIOLATION_FIELD_FAIL_REASON_BITS)

# fail reasons
VERIFY_CHAIN = tl.constexpr(int(c.FailReason.VERIFY_CHAIN_HASH_MISMATCH))
VERIFY_POSITION = tl.constexpr(int(c.FailReason.VERIFY_POSITION_MISMATCH))
VERIFY_REAL_KV = tl.constexpr(int(c.FailReason.VERIFY_REAL_KV_HASH_MISMATCH))
VERIFY_TOKEN = tl.constexpr(int(c.FailReason.VERIFY_TOKEN_MISMATCH))
WRITE_TOKEN = tl.constexpr(int(c.FailReason.WRITE_TOKEN_MISMATCH))
WRITE_POSITION = tl.constexpr(int(c.FailReason.WRITE_POSITION_MISMATCH))
VERIFY_SLOT_OOR = tl.constexpr(int(c.FailReason.VERIFY_SLOT_OUT_OF_RANGE))
WRITE_SLOT_OOR = tl.constexpr(int(c.FailReason.WRITE_SLOT_OUT_OF_RANGE))
WRITE_REASONS = tl.constexpr(c.WRITE_FAIL_REASONS)

# stamps
STAMP_FIELDS = tl.constexpr(c.STAMP_FIELDS)
S_STEP = tl.constexpr(c.STAMP_FIELD_STEP)
S_BATCH_ROW = tl.constexpr(c.STAMP_FIELD_BATCH_ROW)
S_EXPECTED_POSITION = tl.constexpr(c.STAMP_FIELD_EXPECTED_POSITION)
UNKNOWN = tl.constexpr(c.STAMP_UNKNOWN)
