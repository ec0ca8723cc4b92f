"""Slot allocator (slot 0 = padding, never handed out) and request table (row 0 = padding)."""
from __future__ import annotations

from typing import Optional

import torch

PADDING_SLOT = 0
PADDING_ROW = 0


class SlotAllocator:
    """A LIFO free list over slots ``1 .. num_slots - 1`` (freed slots are reused first, which
    makes use-after-free bugs bite early)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, PADDING_SLOT, -1))
        self.in_use = torch.zeros(num_slots, dtype=torch.bool)
        self.double_frees = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> Optional[list[int]]:
        """``n`` slots, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(n)]
        if slots:
            self.in_use[slots] = True
        return slots

    def free(self, slots: list[int]) -> None:
        """Return slots; freeing a free slot is counted (a bookkeeping bug) and ignored."""
        for s in slots:
            if s == PADDING_SLOT:
                continue
            if not self.in_use[s]:
                self.double_frees += 1
                continue
            self.in_use[s] = False
            self._free.append(s)

    def force_free(self, slot: int) -> None:
        """Fault hook: put ``slot`` on top of the free list even if something still uses it."""
        self.in_use[slot] = False
        if slot in self._free:
            self._free.remove(slot)
        self._free.append(slot)

    def take(self, slot: int) -> None:
        """Fault hook: take ``slot`` back off the free list (an engine that keeps using a slot it freed)."""
        if slot in self._free:
            self._free.remove(slot)
        self.in_use[slot] = True

    def live(self) -> torch.Tensor:
        """int64 indices of the slots in use."""
        return self.in_use.nonzero().flatten()


class RequestTable:
    """``req_to_token`` (int32 [max_requests, max_context], full slots) and the token history
    (int32 [max_requests, max_context]) per request row."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device = torch.device("cpu")) -> None:
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(max_requests, max_context, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_requests - 1, PADDING_ROW, -1))

    def alloc_row(self) -> Optional[int]:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        self.req_to_token[row].zero_()
        self.tokens[row].zero_()
        self._free_rows.append(row)

    @property
    def num_free(self) -> int:
        return len(self._free_rows)
