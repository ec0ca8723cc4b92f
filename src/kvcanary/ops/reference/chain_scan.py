"""The write chain's serial recurrence: running hash before each entry, request by request.

``running[i]`` for the k-th entry of request r is ``mix3`` folded over that request's earlier
entries, starting from ``start[r]``. Serial by nature (each step needs the previous hash);
numba compiles the loop when installed and asked for, otherwise a pure-Python loop gives the
same bits. `python_loop` forces the pure-Python loop inside a block (for every caller, the write twin's
included): how tests compare the two through the public ops.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import numpy as np
import torch

from kvcanary.ops.hashing import (
    MASK64,
    SPLITMIX64_GAMMA_1,
    SPLITMIX64_GAMMA_2,
    SPLITMIX64_SHIFTS,
    splitmix64_mix3,
    to_signed64,
)


_python_only = False  # `python_loop`'s switch


@contextlib.contextmanager
def python_loop() -> Iterator[None]:
    """Inside the block every `chain_scan` runs the pure-Python loop, numba installed or not (the same bits);
    restored on exit. Not thread-safe: for tests and benchmarks, not for a serving engine's threads."""
    global _python_only
    before, _python_only = _python_only, True
    try:
        yield
    finally:
        _python_only = before


@functools.lru_cache(maxsize=None)
def compiled_scan():
    """The numba-compiled scan, or None when numba is not installed (built once per process)."""
    try:
        import numba
    except ImportError:
        return None

    g1, g2 = np.uint64(SPLITMIX64_GAMMA_1), np.uint64(SPLITMIX64_GAMMA_2)
    s1, s2, s3 = (np.uint64(s) for s in SPLITMIX64_SHIFTS)

    @numba.njit(cache=True, nogil=True)
    def _mix(x):
        x = (x ^ (x >> s1)) * g1
        x = (x ^ (x >> s2)) * g2
        return x ^ (x >> s3)

    @numba.njit(cache=True, nogil=True)
    def _scan(start, lengths, tokens, positions, advance, out):
        i = 0
        for r in range(lengths.shape[0]):
            h = start[r]
            for _ in range(lengths[r]):
                out[i] = h
                if advance[i]:
                    h = _mix(_mix(_mix(h) ^ tokens[i]) ^ positions[i])
                i += 1

    return _scan


def _python_scan(start: list, lengths: list, tokens: list, positions: list, advance: list) -> list:
    out = []
    i = 0
    for h, n in zip(start, lengths):
        h &= MASK64
        for _ in range(n):
            out.append(to_signed64(h))
            if advance[i]:
                h = splitmix64_mix3(h, tokens[i], positions[i])
            i += 1
    return out


def chain_scan(
    start: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *, compiled: bool = True,
    advance: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Running hash before each entry: int64 [sum(lengths)] on ``tokens.device``.

    start: int64 [R] hash each request starts from; lengths: int64 [R] entries per request;
    tokens, positions: int64 [sum(lengths)], request by request. ``compiled=False`` forces the
    pure-Python loop (same bits; tests compare the two), as `python_loop` does. ``advance``: optional bool [sum(lengths)];
    an entry where it is False gets the running hash but does not advance it (default: all advance).
    """
    device = tokens.device
    n = int(tokens.shape[0])
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if advance is None:
        advance = torch.ones(n, dtype=torch.bool, device=device)
    scan = compiled_scan() if compiled and not _python_only else None
    if scan is not None:
        as_u64 = lambda t: t.detach().to("cpu", torch.int64).contiguous().numpy().view(np.uint64)  # noqa: E731
        out = np.empty(n, dtype=np.uint64)
        scan(as_u64(start), lengths.to("cpu", torch.int64).numpy(), as_u64(tokens), as_u64(positions),
             advance.to("cpu", torch.bool).contiguous().numpy(), out)
        return torch.from_numpy(out.view(np.int64)).to(device)
    values = _python_scan(start.tolist(), lengths.tolist(), tokens.tolist(), positions.tolist(), advance.tolist())
    return torch.tensor(values, dtype=torch.int64, device=device)
