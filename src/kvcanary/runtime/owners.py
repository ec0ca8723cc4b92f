"""Slot-record owner codes: which forward step and batch row last wrote a slot, in one int64."""
from __future__ import annotations

OWNER_SPAN = 1 << 20  # owner code = step * OWNER_SPAN + batch row (batch rows < OWNER_SPAN)


def owner_code(step: int, batch_row: int) -> int:
    """The owner code of ``batch_row`` of forward ``step``."""
    return step * OWNER_SPAN + batch_row


def split_owner(owner: int) -> tuple[int, int]:
    """``(step, batch row)`` of an owner code."""
    return divmod(int(owner), OWNER_SPAN)
