"""`PolledWords`: the small device tensors the host reads back every step, packed in one int64 buffer.

The drain looks at the ring write indices (int32 [tags]), the launch counters (int64 [4, NUM_TAGS]) and the
disabled-plan counts (int64 [groups]) after every step. Allocated as views of one buffer, that look is a
single non-blocking copy and a single ``tolist`` instead of one of each per tensor.
"""
from __future__ import annotations

import torch

_LOW32 = (1 << 32) - 1


class PolledWords:
    """``buffer`` int64 [words]; ``write_index`` int32 [num_tags] (one per ring: group and tag), ``counters`` int64
    [rows, width] and ``plans_disabled`` int64 [num_groups] are views of it (in that order)."""

    def __init__(self, *, num_tags: int, counter_shape: tuple[int, int], num_groups: int, device: torch.device) -> None:
        self.num_tags = num_tags
        self._index_words = (num_tags + 1) // 2  # two int32 indices per word
        rows, width = counter_shape
        self._counter_end = self._index_words + rows * width
        self.buffer = torch.zeros(self._counter_end + num_groups, dtype=torch.int64, device=device)
        self.write_index = self.buffer[: self._index_words].view(torch.int32)[:num_tags]
        self.counters = self.buffer[self._index_words : self._counter_end].view(rows, width)
        self.plans_disabled = self.buffer[self._counter_end :]

    def decode(self, words: list[int]) -> tuple[list[int], list[int], list[int]]:
        """``(write indices, counters flattened, plans disabled)`` from ``buffer``'s words read on the host."""
        index = []
        for w in words[: self._index_words]:  # little-endian: the first int32 of a word is its low half
            index += (_signed32(w & _LOW32), _signed32((w >> 32) & _LOW32))
        return index[: self.num_tags], words[self._index_words : self._counter_end], words[self._counter_end :]


def _signed32(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x
