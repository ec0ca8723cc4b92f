"""Producer identity in the simulated engine: images in prompts, the engine's own prefix-cache key, weight versions.

* `SimImage` — one multimodal item of a prompt: ``length`` placeholder tokens (id ``token``) from ``start``, with its
  content (bytes, str or int: the "pixels"). The request's model tokens (what the "model" computes KV from, the batch
  hands the canary and the token table holds) are `kvcanary.runtime.multimodal.canary_token_ids` of the prompt, so
  an image's KV depends on its content.
* `cache_key` — the engine's own prefix-cache key of a request, one element per token: the token id, with the
  fields of ``SimEngine.key_fields`` mixed in — ``images``: a placeholder position keys on (placeholder id, the
  engine's own hash of the item, computed apart from the canary's); ``adapter`` / ``salt`` / ``context`` /
  ``weights_version``: the first element carries those fields of the request's identity. A field left out is the
  bug class it names: requests differing only in it share cached prefixes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Sequence, Union

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.runtime.identity import ProducerIdentity
from kvcanary.runtime.multimodal import PlaceholderRun, canary_token_ids, item_hash

IMAGE_TOKEN = 31999  # the placeholder id of the sim's images (a text id the seeded samplers may also emit)
KEY_FIELDS = ("adapter", "salt", "context", "weights_version", "images")


@dataclass(frozen=True, kw_only=True)
class SimImage:
    """An image in a prompt: positions ``[start, start + length)`` hold ``token``; ``content`` is its data."""

    start: int
    length: int
    content: Union[bytes, str, int]
    token: int = IMAGE_TOKEN

    def __post_init__(self) -> None:
        if not isinstance(self.content, (bytes, str, int)) or isinstance(self.content, bool):
            raise KvCanaryTypeError(f"kv-canary: SimImage.content must be bytes, str or int, got "
                                    f"{type(self.content).__name__}")
        if self.start < 0 or self.length < 1:
            raise KvCanaryValueError(f"kv-canary: SimImage needs start >= 0 and length >= 1, got {self.start}/{self.length}")


def check_key_fields(fields: Sequence[str]) -> tuple[str, ...]:
    bad = [f for f in fields if f not in KEY_FIELDS]
    if bad:
        raise KvCanaryValueError(f"kv-canary: unknown prefix-cache key field(s) {bad}; known: {', '.join(KEY_FIELDS)}")
    return tuple(fields)


def model_tokens(prompt: Sequence[int], images: Sequence[SimImage]) -> list[int]:
    """The request's model tokens: the prompt with each image's placeholders replaced by content tokens. Each
    image's positions must hold its placeholder id."""
    for img in images:
        span = list(prompt[img.start : img.start + img.length])
        if len(span) != img.length or any(t != img.token for t in span):
            raise KvCanaryValueError(f"kv-canary: prompt positions [{img.start}, {img.start + img.length}) must hold "
                                     f"the image placeholder {img.token}")
    if not images:
        return list(prompt)
    runs = [PlaceholderRun(start=i.start, length=i.length, item_hash=item_hash(i.content)) for i in images]
    return canary_token_ids(list(prompt), runs).tolist()


def engine_item_key(image: SimImage) -> int:
    """The engine's own hash of an image (its cache key's view; independent of the canary's `item_hash`)."""
    data = repr((type(image.content).__name__, image.content)).encode()
    return int.from_bytes(hashlib.sha256(b"sim-engine-mm\0" + data).digest()[:8], "little")


def cache_key(tokens: Sequence[int], images: Sequence[SimImage], identity: ProducerIdentity,
              fields: Sequence[str]) -> list:
    """The engine's prefix-cache key of a request's ``tokens`` (see the module docstring)."""
    key: list = list(tokens)
    for img in images:
        item = engine_item_key(img) if "images" in fields else None
        for p in range(img.start, min(img.start + img.length, len(key))):
            key[p] = (img.token, item) if item is not None else img.token
    namespace = tuple((f, getattr(identity, f)) for f in KEY_FIELDS[:4] if f in fields)
    if key and any(v not in (None, 0) for _, v in namespace):
        key[0] = (namespace, key[0])
    return key


def producer(identity: ProducerIdentity, weights_version: int) -> ProducerIdentity:
    """``identity`` as produced under ``weights_version``."""
    return replace(identity, weights_version=weights_version)


__all__ = ["IMAGE_TOKEN", "KEY_FIELDS", "SimImage", "check_key_fields", "model_tokens", "engine_item_key", "cache_key",
           "producer"]
