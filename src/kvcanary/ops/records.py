"""The op contract's data structures (docs/design.md §3.3): frozen, keyword-only, checked once."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.constants import CanaryLaunchTag, RealKvHashMode


@dataclass(frozen=True, kw_only=True)
class RealKvSource:
    """One K or V storage whose bytes feed a slot's real-KV fingerprint.

    ``tensor`` is any tensor of >= 2 dims whose last dim is contiguous; it is read as a 2-D byte
    matrix (row = dim 0, columns = the row's bytes in logical order). Slot ``s`` lives in row
    ``s // page_size`` at byte column ``(s % page_size) * num_bytes_per_token``. ``read_bytes`` is the
    strip length hashed in ALL and LANES mode (PARTIAL always hashes 16 bytes).
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    def __post_init__(self) -> None:
        p, n, rb, t = self.page_size, self.num_bytes_per_token, self.read_bytes, self.tensor
        if not isinstance(p, int) or p < 1:
            raise KvCanaryValueError(f"kv-canary: RealKvSource.page_size must be >= 1, got {p}")
        if not isinstance(n, int) or n <= 0 or n % 16:
            raise KvCanaryValueError(
                f"kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got {n}"
            )
        if not isinstance(rb, int) or rb <= 0 or rb % 16 or rb > n:
            raise KvCanaryValueError(
                "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in "
                f"(0, num_bytes_per_token={n}], got {rb}"
            )
        if not isinstance(t, torch.Tensor):
            raise KvCanaryTypeError(f"kv-canary: RealKvSource.tensor must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise KvCanaryValueError(f"kv-canary: RealKvSource.tensor must be at least 2-D, got shape {tuple(t.shape)}")
        row_stride_bytes = t.stride(0) * t.element_size()
        if row_stride_bytes % 16:
            raise KvCanaryValueError(
                "kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, got "
                f"{row_stride_bytes} bytes (shape={tuple(t.shape)}, strides={tuple(t.stride())}, dtype={t.dtype})"
            )
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise KvCanaryValueError(
                "kv-canary: RealKvSource.tensor last dimension must be contiguous, got "
                f"shape={tuple(t.shape)}, strides={tuple(t.stride())}"
            )

    @property
    def row_bytes(self) -> int:
        """Logical width of one row in bytes (columns x element size, not the stride)."""
        return math.prod(self.tensor.shape[1:]) * self.tensor.element_size()

    @property
    def slot_layout_bytes(self) -> int:
        """Bytes of a row the slots' strips cover: ``page_size * num_bytes_per_token``."""
        return self.page_size * self.num_bytes_per_token


@dataclass(frozen=True, kw_only=True)
class VerifyOrWriteContext:
    """Where a verify or write launch reads and records.

    canary_buf: uint8 [num_slots, stride_bytes] (first 32 bytes of a row = 4 int64 fields).
    violation_ring: int64 [cap, 8]; violation_write_index: int32 [1] (counts every violation);
    slot_run_counter / kernel_run_counter: int64 [1] (often views of per-tag arrays);
    enable_chain_position_assert: int32 [1]. Mutated by the ops: ring, index, counters, buffer.
    """

    canary_buf: torch.Tensor
    kernel_kind: Union[CanaryLaunchTag, int]
    violation_ring: torch.Tensor
    violation_write_index: torch.Tensor
    slot_run_counter: torch.Tensor
    kernel_run_counter: torch.Tensor
    real_kv_sources: tuple
    real_kv_hash_mode: Union[RealKvHashMode, int]
    enable_chain_position_assert: torch.Tensor

    def __post_init__(self) -> None:
        if isinstance(self.real_kv_sources, list):
            object.__setattr__(self, "real_kv_sources", tuple(self.real_kv_sources))
        if not isinstance(self.real_kv_sources, tuple) or not all(
            isinstance(s, RealKvSource) for s in self.real_kv_sources
        ):
            raise KvCanaryTypeError("kv-canary: VerifyOrWriteContext.real_kv_sources must be a tuple of RealKvSource")
        try:
            RealKvHashMode(int(self.real_kv_hash_mode))
        except (TypeError, ValueError):
            raise KvCanaryValueError(
                f"kv-canary: VerifyOrWriteContext.real_kv_hash_mode must be 0, 1, 2 or 3 (a RealKvHashMode), got {self.real_kv_hash_mode!r}"
            ) from None

    @property
    def hashing_on(self) -> bool:
        """True when real-KV fingerprints are computed (mode not NONE and >= 1 source)."""
        return int(self.real_kv_hash_mode) != RealKvHashMode.NONE and len(self.real_kv_sources) > 0


@dataclass(frozen=True, kw_only=True)
class VerifyPlan:
    """Verify entries: int64 [cap] slot, expected token, expected position, predecessor slot;
    int32 [1] number of valid entries and enable flag."""

    verify_slot_indices: torch.Tensor
    verify_expected_tokens: torch.Tensor
    verify_expected_positions: torch.Tensor
    verify_prev_slot_indices: torch.Tensor
    verify_num_valid: torch.Tensor
    enable: torch.Tensor

    @classmethod
    def allocate(cls, verify_capacity: int, device: Union[str, torch.device, None] = None) -> "VerifyPlan":
        """Uninitialised arrays of ``verify_capacity`` entries, ``verify_num_valid = 0``, ``enable = 1``."""
        if verify_capacity <= 0:
            raise KvCanaryValueError(f"kv-canary: VerifyPlan verify_capacity must be positive, got {verify_capacity}")

        def arr() -> torch.Tensor:
            return torch.empty(verify_capacity, dtype=torch.int64, device=device)

        return cls(
            verify_slot_indices=arr(),
            verify_expected_tokens=arr(),
            verify_expected_positions=arr(),
            verify_prev_slot_indices=arr(),
            verify_num_valid=torch.zeros(1, dtype=torch.int32, device=device),
            enable=torch.ones(1, dtype=torch.int32, device=device),
        )

    @property
    def capacity(self) -> int:
        return int(self.verify_slot_indices.shape[0])


@dataclass(frozen=True, kw_only=True)
class WritePlan:
    """Write metadata: int64 [cap+1] offsets into the flattened entries, int64 [cap] seed slot
    per request (-1 = chain head), int32 [1] number of requests."""

    write_offsets: torch.Tensor
    write_seed_slot_indices: torch.Tensor
    write_num_valid_reqs: torch.Tensor

    @classmethod
    def allocate(cls, write_req_capacity: int, device: Union[str, torch.device, None] = None) -> "WritePlan":
        """Zeroed offsets, seeds of -1, ``write_num_valid_reqs = 0``."""
        if write_req_capacity <= 0:
            raise KvCanaryValueError(f"kv-canary: WritePlan write_req_capacity must be positive, got {write_req_capacity}")
        return cls(
            write_offsets=torch.zeros(write_req_capacity + 1, dtype=torch.int64, device=device),
            write_seed_slot_indices=torch.full((write_req_capacity,), -1, dtype=torch.int64, device=device),
            write_num_valid_reqs=torch.zeros(1, dtype=torch.int32, device=device),
        )

    @property
    def capacity(self) -> int:
        return int(self.write_seed_slot_indices.shape[0])
