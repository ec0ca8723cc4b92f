"""`ColumnUpload`: int64 host columns -> device tensors with one copy per call (for an adapter's per-forward path).

On CUDA the columns are packed into the next pinned buffer of a small ring and copied with one non-blocking
copy; a buffer is reused once the event recorded after its copy has completed (a wait only when the device is a
whole ring behind, counted in ``waits``). On the CPU the columns are packed into one fresh tensor.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvcanary.runtime.cuda_host import current_stream

RING = 4


class ColumnUpload:
    """``upload(*columns) -> tuple of int64 [len(column)] tensors on ``device`` (views of one buffer)."""

    def __init__(self, device: torch.device, ring: int = RING) -> None:
        self.device = torch.device(device)
        self.waits = 0
        self._pinned = self.device.type == "cuda"
        self._ring: list[list] = [[None, None] for _ in range(ring if self._pinned else 0)]  # [buffer, event]
        self._next = 0

    def __call__(self, *columns: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Each column: a host sequence of ints or a numpy integer array."""
        cols = [np.asarray(c, dtype=np.int64) for c in columns]
        sizes = [int(c.shape[0]) for c in cols]
        total = sum(sizes)
        flat = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
        if not self._pinned:
            return torch.from_numpy(flat).to(self.device).split(sizes)
        slot = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        host, event = slot
        if host is None or host.shape[0] < total:
            host = slot[0] = torch.empty(max(total, 1024, 2 * (0 if host is None else host.shape[0])),
                                         dtype=torch.int64, pin_memory=True)
            event = slot[1] = None
        elif event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        host.numpy()[:total] = flat
        dev = torch.empty(total, dtype=torch.int64, device=self.device)
        dev.copy_(host[:total], non_blocking=True)
        if event is None:
            event = slot[1] = torch.cuda.Event()
        event.record(current_stream())
        return dev.split(sizes)
