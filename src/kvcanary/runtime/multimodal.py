"""Multimodal content as part of a slot's identity: content tokens at placeholder positions (docs/design.md §5.6).

Every image (audio, video) placeholder of a prompt has the same token id, so "same text, another picture" has the
same token ids and, without more, the same chain. The canary therefore records, at each placeholder position, a
*content token* instead of the placeholder id:

    content_token(placeholder, item_hash, offset) = MM_TOKEN_BASE + (mix3(MM_DOMAIN ^ placeholder, item_hash, offset)
                                                                     & (MM_TOKEN_BASE - 1))

with ``item_hash`` the 64-bit hash of the source item's content (`item_hash`, computed by the adapter from the
request's own inputs — never the engine's cache key, so the canary does not inherit the engine's bug) and ``offset``
the position within the item's run. Content tokens lie in ``[2^30, 2^31)``: above every real vocabulary, inside the
int32 token table the plan reads (§3.5), never -1. The adapter hands the canary these ids as ``input_ids`` and in its
token history (`canary_token_ids`); text tokens are unchanged, so text before the first image stays shareable across
requests, while the chain carries the image into every later position. A cached placeholder slot read by a request
whose item differs fails ``verify_token`` there (it needs the token history, ``verify_token`` on), named
``identity_multimodal`` at drain time (`kvcanary.runtime.identity`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.hashing import splitmix64_mix3

MM_TOKEN_BASE = 1 << 30
MM_TOKEN_LIMIT = 1 << 31  # exclusive: content tokens fit the int32 token table
MM_DOMAIN = 0x4D4D_C0DE_1A6E_0001

ItemContent = Union[bytes, bytearray, memoryview, str, int, torch.Tensor]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's dtype and shape header (``"{dtype}{shape}"``) and its bytes in row-major order (moved to the host)."""
    t = t.detach().contiguous().cpu()
    head = f"{t.dtype}{tuple(t.shape)}".encode()
    return head + (t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def item_hash(content: ItemContent) -> int:
    """A 64-bit hash of one multimodal item's content: bytes as given, a str as UTF-8, an int as its decimal text,
    a tensor as its dtype, shape and bytes (moved to the host). Deterministic across processes."""
    if isinstance(content, torch.Tensor):
        data = b"t" + tensor_bytes(content)
    elif isinstance(content, (bytes, bytearray, memoryview)):
        data = b"y" + bytes(content)
    elif isinstance(content, str):
        data = b"s" + content.encode()
    elif isinstance(content, int) and not isinstance(content, bool):
        data = b"i" + str(content).encode()
    else:
        raise KvCanaryTypeError(f"kv-canary: item_hash takes bytes, str, int or a tensor, got {type(content).__name__}")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True, kw_only=True)
class PlaceholderRun:
    """One multimodal item in a prompt: ``length`` placeholder positions from ``start``; ``item_hash`` the item's
    content hash (`item_hash`)."""

    start: int
    length: int
    item_hash: int

    def __post_init__(self) -> None:
        for name in ("start", "length", "item_hash"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise KvCanaryTypeError(f"kv-canary: PlaceholderRun.{name} must be an int, got {type(v).__name__}")
        if self.start < 0 or self.length < 1:
            raise KvCanaryValueError(f"kv-canary: PlaceholderRun needs start >= 0 and length >= 1, got "
                                     f"start={self.start} length={self.length}")


def content_token(placeholder: int, item: int, offset: int) -> int:
    """The canary's token at ``offset`` of an item hashed ``item`` whose placeholder id is ``placeholder``."""
    return MM_TOKEN_BASE + (splitmix64_mix3(MM_DOMAIN ^ placeholder, item, offset) & (MM_TOKEN_BASE - 1))


def is_content_token(token: int) -> bool:
    return MM_TOKEN_BASE <= int(token) < MM_TOKEN_LIMIT


def canary_token_ids(token_ids: Union[Sequence[int], torch.Tensor], runs: Sequence[PlaceholderRun]) -> torch.Tensor:
    """int64 copy of ``token_ids`` (on their device) with every position of every run replaced by its
    `content_token`; positions outside the runs keep their ids. Runs must lie inside the ids and not overlap;
    text ids must be in ``[0, MM_TOKEN_BASE)``."""
    ids = torch.as_tensor(token_ids).to(torch.int64).clone()
    if ids.dim() != 1:
        raise KvCanaryValueError(f"kv-canary: canary_token_ids needs 1-D token ids, got shape {tuple(ids.shape)}")
    n = int(ids.shape[0])
    if n and (int(ids.min()) < 0 or int(ids.max()) >= MM_TOKEN_BASE):
        raise KvCanaryValueError(f"kv-canary: token ids must lie in [0, {MM_TOKEN_BASE}) (content tokens live above)")
    end = -1
    host = ids.tolist()
    for run in sorted(runs, key=lambda r: r.start):
        if run.start < end or run.start + run.length > n:
            raise KvCanaryValueError(f"kv-canary: placeholder run {run} overlaps another or ends past {n} tokens")
        end = run.start + run.length
        for i in range(run.length):
            p = run.start + i
            host[p] = content_token(host[p], run.item_hash, i)
    return torch.tensor(host, dtype=torch.int64, device=ids.device) if runs else ids


__all__ = ["MM_TOKEN_BASE", "MM_TOKEN_LIMIT", "ItemContent", "PlaceholderRun", "item_hash", "content_token",
           "is_content_token", "canary_token_ids"]
