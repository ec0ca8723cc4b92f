"""The fault ledger: one `Injection` per injected fault, appended by the injector that fired it.

An entry names what was done (fault class), on which engine, at which canary step (the forward the
fault first affects), where (group, slot, position), to which request, which reasons the canary is
expected to report (any one of them counts) and whether the current configuration can see it at all
(``expected_detectable`` with ``why_not`` when False).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Iterator, Optional

from kvcanary.errors import KvCanaryValueError

FAULT_CLASSES = (
    "kv_flip_used", "kv_flip_cached", "kv_flip_deep_layer", "slot_redirect", "use_after_free", "position_shift",
    "token_swap", "prefix_collision", "cross_context_hit", "double_alloc", "copy_corruption", "swa_window_stale",
    # speculative decoding (engines that verify drafts)
    "verify_draft_kept", "verify_rollback_off_by_one", "verify_draft_misdirected", "verify_positions_shifted",
    # producer identity (a prefix-cache key that leaves out what produced the KV)
    "weights_update_stale_prefix", "salt_ignored_by_cache_key", "adapter_ignored_by_cache_key",
    "multimodal_key_ignores_image",
)

CHECK_OF_REASON = {  # which check produced a reason label
    "verify_chain_hash": "chain", "verify_position": "position", "verify_token": "token",
    "verify_real_kv_hash": "fingerprint", "write_token": "write_input", "write_position": "write_input",
    "verify_slot_out_of_range": "slot_range", "write_slot_out_of_range": "slot_range",
    "verify_padding_slot_read": "padding_read",
    # host-side names of what differed (runtime/identity.py), over a chain or token row
    "identity_adapter": "identity", "identity_salt": "identity", "identity_weights_version": "identity",
    "identity_context": "identity", "identity_multimodal": "identity", "identity_mismatch": "identity",
}


@dataclass(frozen=True, kw_only=True)
class Injection:
    """One injected fault. step: the canary step of the first forward that can see it. slot: in the
    group's own slot space. position: the sequence position it damages (-1 when not one position)."""

    fault: str
    engine: str
    step: int
    group: str
    slot: int
    position: int
    request_id: Optional[str]
    expected: tuple[str, ...]
    expected_detectable: bool = True
    why_not: str = ""
    detail: str = ""

    def to_json(self) -> dict:
        return asdict(self)


class FaultLedger:
    """Append-only list of `Injection`s (in firing order)."""

    def __init__(self) -> None:
        self._entries: list[Injection] = []

    def add(self, injection: Injection) -> Injection:
        if injection.fault not in FAULT_CLASSES:
            raise KvCanaryValueError(f"kv-canary: unknown fault class {injection.fault!r}")
        self._entries.append(injection)
        return injection

    def amend(self, injection: Injection, **changes: object) -> Injection:
        """Replace ``injection`` (an entry of this ledger) by a copy with ``changes`` — for what is only known
        after the fault was fired (e.g. the engine overwrote the damaged KV before anything read it)."""
        i = next((k for k, e in enumerate(self._entries) if e is injection), None)
        if i is None:
            raise KvCanaryValueError("kv-canary: amend() of an injection that is not in this ledger")
        self._entries[i] = replace(injection, **changes)
        return self._entries[i]

    def __iter__(self) -> Iterator[Injection]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i: int) -> Injection:
        return self._entries[i]

    def to_json(self) -> list[dict]:
        return [e.to_json() for e in self._entries]
