"""Who made this KV: a request's producer identity, folded into its context key (docs/design.md §5.6).

Everything besides token ids and positions that determines a slot's KV is part of its identity:

* `ProducerIdentity` (adapter / LoRA id, cache salt, weights version, any other context key) — one per request,
  folded by `identity_key` into the int64 context key of `BatchDescription.context_keys`. A keyed row's position 0
  chains from ``mix3(H0, key, -1)`` (`anchor_hash`), so KV produced under another identity fails its first read.
* multimodal content is per position, not per request (`kvcanary.runtime.multimodal`): the text before an image
  stays shareable.

Naming what differed is host work at drain time (`name_identities`): a ``verify_chain_hash`` row at position 0
carries the stored and the expected anchor hashes; the `IdentityRegistry` (every identity this canary issued)
inverts both to identities and the row gains one host-side reason bit per field that differs. A
``verify_token`` row whose tokens are content tokens (`kvcanary.runtime.multimodal`) gains
``identity_multimodal``. These bits are runtime classifications beside ``read_table_mismatch``; no kernel sets them.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, fields, replace
from typing import Hashable, Optional, Sequence

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops import FailReason
from kvcanary.ops.constants import CANARY_CHAIN_ANCHOR, MASK64
from kvcanary.ops.hashing import splitmix64, splitmix64_mix3

# host-side reason bits (runtime classifications, above the op bits and `read_table_mismatch` = 1 << 16)
IDENTITY_ADAPTER = 1 << 17
IDENTITY_SALT = 1 << 18
IDENTITY_WEIGHTS_VERSION = 1 << 19
IDENTITY_CONTEXT = 1 << 20
IDENTITY_MULTIMODAL = 1 << 21
IDENTITY_MISMATCH = 1 << 22
IDENTITY_REASONS = {
    IDENTITY_ADAPTER: "identity_adapter", IDENTITY_SALT: "identity_salt",
    IDENTITY_WEIGHTS_VERSION: "identity_weights_version", IDENTITY_CONTEXT: "identity_context",
    IDENTITY_MULTIMODAL: "identity_multimodal", IDENTITY_MISMATCH: "identity_mismatch",
}
_FIELD_BIT = {"adapter": IDENTITY_ADAPTER, "salt": IDENTITY_SALT, "weights_version": IDENTITY_WEIGHTS_VERSION,
              "context": IDENTITY_CONTEXT}
_FIELD_TAG = {"adapter": 1, "salt": 2, "weights_version": 3, "context": 4}
IDENTITY_DOMAIN = 0x1DE7_7177_C0DE_0001  # seeds the fold, so a key never equals a field hash
KEY_MASK = (1 << 63) - 1
CHAIN_HEAD = splitmix64(CANARY_CHAIN_ANCHOR)
DEFAULT_REGISTRY_CAPACITY = 65536


@dataclass(frozen=True, kw_only=True)
class ProducerIdentity:
    """What, besides tokens and positions, produced a request's KV. adapter: the LoRA / adapter id; salt: the
    cache salt (tenant isolation); weights_version: the model weights' version (bumped on every in-place update);
    context: any other producer key (a ``context_of`` hook's value). Values: None, bool, int, str, bytes or tuples
    of those (hashed deterministically, so two processes agree); anything else hashable is hashed by its type and
    ``repr``. The default identity (all None, version 0) is the null identity: key 0, "no context"."""

    adapter: Optional[Hashable] = None
    salt: Optional[Hashable] = None
    weights_version: int = 0
    context: Optional[Hashable] = None

    def __post_init__(self) -> None:
        v = self.weights_version
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise KvCanaryValueError(f"kv-canary: ProducerIdentity.weights_version must be an int >= 0, got {v!r}")
        for name in ("adapter", "salt", "context"):
            try:
                hash(getattr(self, name))
            except TypeError:
                raise KvCanaryTypeError(f"kv-canary: ProducerIdentity.{name} must be hashable, got "
                                        f"{type(getattr(self, name)).__name__}") from None

    @property
    def is_null(self) -> bool:
        return self.adapter is None and self.salt is None and self.weights_version == 0 and self.context is None

    def differs(self, other: "ProducerIdentity") -> tuple[str, ...]:
        """Names of the fields whose values differ from ``other``'s, in field order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))


def as_identity(value: object) -> ProducerIdentity:
    """``value`` as an identity: a `ProducerIdentity` as is; None is the null identity; anything else hashable is
    an opaque ``context`` key (what a ``context_of`` hook returns)."""
    if isinstance(value, ProducerIdentity):
        return value
    return ProducerIdentity() if value is None else ProducerIdentity(context=value)


def _value_hash(value: object) -> int:
    """A deterministic 64-bit hash of a field value (not Python's salted ``hash``)."""
    if isinstance(value, bool):
        data = b"b" + bytes([value])
    elif isinstance(value, int):
        data = b"i" + str(value).encode()
    elif isinstance(value, str):
        data = b"s" + value.encode("utf-8", "surrogatepass")
    elif isinstance(value, bytes):
        data = b"y" + value
    elif isinstance(value, tuple):
        data = b"t" + b"".join(_value_hash(x).to_bytes(8, "little") for x in value)
    else:
        data = b"r" + type(value).__qualname__.encode() + b"\0" + repr(value).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def identity_key(identity: ProducerIdentity) -> int:
    """The context key of ``identity``: 0 for the null identity, else a non-zero 63-bit int. Deterministic: it
    depends only on the field values (``h = mix3(h, field tag, value hash)`` over the set fields, in field order,
    from `IDENTITY_DOMAIN`; None fields and version 0 are skipped), so equal identities give equal keys in every
    process."""
    if not isinstance(identity, ProducerIdentity):
        raise KvCanaryTypeError(f"kv-canary: identity_key needs a ProducerIdentity, got {type(identity).__name__}")
    if identity.is_null:
        return 0
    h = IDENTITY_DOMAIN
    for f in fields(identity):
        value = getattr(identity, f.name)
        if value is None or (f.name == "weights_version" and value == 0):
            continue
        h = splitmix64_mix3(h, _FIELD_TAG[f.name], _value_hash(value))
    return (h & KEY_MASK) or 1


def anchor_hash(key: int) -> int:
    """The chain value (unsigned 64-bit) a row keyed ``key`` carries at position 0: H0 for key 0, else
    ``mix3(H0, key, -1)`` (its anchor record: token = key, position = -1, prev_hash = H0)."""
    return CHAIN_HEAD if key == 0 else splitmix64_mix3(CHAIN_HEAD, key, -1)


class IdentityRegistry:
    """Every identity this canary issued (key -> identity, anchor hash -> key), bounded to the ``capacity`` most
    recently issued; the null identity is always known. Host only, O(1) per `issue`."""

    def __init__(self, capacity: int = DEFAULT_REGISTRY_CAPACITY) -> None:
        if capacity < 1:
            raise KvCanaryValueError(f"kv-canary: IdentityRegistry capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._by_key: OrderedDict[int, ProducerIdentity] = OrderedDict()
        self._by_anchor: dict[int, int] = {}

    def issue(self, identity: ProducerIdentity) -> int:
        """The context key of ``identity`` (`identity_key`), remembered for naming violations later."""
        key = identity_key(identity)
        if key == 0:
            return 0
        known = self._by_key.get(key)
        if known is not None:
            self._by_key.move_to_end(key)
            return key
        self._by_key[key] = identity
        self._by_anchor[anchor_hash(key)] = key
        if len(self._by_key) > self.capacity:
            old, _ = self._by_key.popitem(last=False)
            self._by_anchor.pop(anchor_hash(old), None)
        return key

    def identity_of(self, key: int) -> Optional[ProducerIdentity]:
        return ProducerIdentity() if key == 0 else self._by_key.get(key)

    def key_of_anchor(self, chain_hash: int) -> Optional[int]:
        """The key whose anchor hash is ``chain_hash`` (any sign; H0 -> 0), or None when none was issued."""
        h = chain_hash & MASK64
        return 0 if h == CHAIN_HEAD else self._by_anchor.get(h)

    def __len__(self) -> int:
        return len(self._by_key)


def _anchor_row(v) -> bool:
    """A verify row that judged a position-0 link against a context anchor (HEAD, TAIL or a move; the sweep never
    judges that link)."""
    return (v.op == "verify" and v.phase != "sweep" and bool(int(v.reasons) & FailReason.VERIFY_CHAIN_HASH_MISMATCH)
            and v.stored_position == 0 and v.expected_position == 0 and v.expected_hash is not None)


def classify(v, registry: IdentityRegistry) -> tuple[int, Optional[str]]:
    """The identity bits of violation ``v`` and a detail line (``(0, None)``: nothing to name)."""
    from kvcanary.runtime.multimodal import is_content_token

    if int(v.reasons) & FailReason.VERIFY_TOKEN_MISMATCH and v.expected_token is not None and (
            is_content_token(v.stored_token) or is_content_token(v.expected_token)):
        return IDENTITY_MULTIMODAL, (f"placeholder content differs: stored token {v.stored_token}, the request's "
                                     f"{v.expected_token} (another image / audio item's KV)")
    if not _anchor_row(v):
        return 0, None
    stored_key, expected_key = registry.key_of_anchor(v.stored_hash), registry.key_of_anchor(v.expected_hash)
    if expected_key is None or stored_key == expected_key:
        return 0, None
    stored = registry.identity_of(stored_key) if stored_key is not None else None
    expected = registry.identity_of(expected_key)
    if stored is None or expected is None:
        return IDENTITY_MISMATCH, f"stored record produced under an identity this canary never issued; expected {expected}"
    diff = stored.differs(expected)
    bits = 0
    for name in diff:
        bits |= _FIELD_BIT[name]
    detail = ", ".join(f"{n} {getattr(stored, n)!r} -> {getattr(expected, n)!r}" for n in diff)
    return bits or IDENTITY_MISMATCH, f"stored -> expected: {detail}"


def name_identities(violations: Sequence, registry: Optional[IdentityRegistry]) -> list:
    """``violations`` with identity bits added to ``reasons`` (and ``identity_detail`` set) where `classify`
    names a cause; others unchanged."""
    if registry is None:
        return list(violations)
    out = []
    for v in violations:
        bits, detail = classify(v, registry)
        out.append(replace(v, reasons=FailReason(int(v.reasons) | bits), identity_detail=detail) if bits else v)
    return out


__all__ = [
    "IDENTITY_ADAPTER", "IDENTITY_SALT", "IDENTITY_WEIGHTS_VERSION", "IDENTITY_CONTEXT", "IDENTITY_MULTIMODAL",
    "IDENTITY_MISMATCH", "IDENTITY_REASONS", "ProducerIdentity", "as_identity", "identity_key", "anchor_hash",
    "IdentityRegistry", "classify", "name_identities",
]
