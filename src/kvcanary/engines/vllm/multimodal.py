"""Multimodal content of a vLLM request, as the canary sees it (docs/design.md §5.6, `kvcanary.runtime.multimodal`).

Scheduler side, once per request (when it is first scheduled): every item of ``Request.mm_features`` (one image,
audio clip, video) is one placeholder run — ``mm_position.offset`` / ``.length`` (vLLM's `PlaceholderRange`, the
whole range, including positions its ``is_embed`` mask leaves to text embeddings) — whose ``item_hash`` the adapter
computes itself from the item's processed data (``feature.data``, the `MultiModalKwargsItem` the encoder runs on:
``pixel_values`` and the like), field by field: name, dtype, shape and bytes of every tensor. It never reads
``feature.identifier`` or ``feature.mm_hash``: those are vLLM's own cache keys (prefix-cache block hashes, encoder
cache, processor cache), and a canary keyed by them would inherit any bug in them.

The prompt's token ids at those positions become content tokens (`canary_token_ids`) in the token history the
scheduler ships; the worker learns each request's run ranges (`MultimodalSpans`) and feeds the canary the same
content tokens in place of the placeholder ids the model runner holds. Requests without items add nothing: no run,
no per-step work.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryValueError
from kvcanary.runtime.multimodal import PlaceholderRun, canary_token_ids, item_hash, tensor_bytes


def _feed(h, value: Any) -> None:
    """Fold one nested field value (tensors, sequences, numbers, strings) into blake2b ``h``."""
    if isinstance(value, torch.Tensor):
        h.update(b"T" + tensor_bytes(value) + b";")  # the header's shape fixes the length that follows
    elif isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        h.update(f"N{a.dtype}{a.shape};".encode())
        h.update(a.tobytes())
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)};".encode())
        for x in value:
            _feed(h, x)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        h.update(f"V{type(value).__name__}:{value!r};".encode())
    else:
        raise KvCanaryValueError(f"kv-canary: cannot hash a multimodal field value of type {type(value).__name__}")


def feature_hash(feature: Any) -> int:
    """The 64-bit content hash of one ``MultiModalFeatureSpec``: its modality and, for every field of its processed
    data (sorted by name), the field's name and value (`_feed`). Deterministic across processes. Raises a
    ``kv-canary:`` `RuntimeError` when the scheduler holds no data for the item (vLLM's ``shm`` processor cache
    keeps it out of the engine core; the connector refuses that configuration)."""
    data = getattr(feature, "data", None)
    if data is None:
        raise KvCanaryRuntimeError(
            "kv-canary: a multimodal item reached the scheduler without its data (mm_processor_cache_type='shm'?); "
            "the canary hashes the item's own data and cannot key it otherwise")
    h = hashlib.blake2b(digest_size=32)
    h.update(f"M{getattr(feature, 'modality', '')};".encode())
    for key in sorted(data.keys()):
        elem = data[key]
        h.update(f"K{key};".encode())
        _feed(h, getattr(elem, "data", elem))
    return item_hash(h.digest())


def request_runs(request: Any) -> tuple[PlaceholderRun, ...]:
    """The placeholder runs of a scheduler-side vLLM ``Request`` (empty without multimodal items), sorted by start."""
    feats = getattr(request, "mm_features", None) or ()
    runs = [PlaceholderRun(start=int(f.mm_position.offset), length=int(f.mm_position.length), item_hash=feature_hash(f))
            for f in feats]
    return tuple(sorted(runs, key=lambda r: r.start))


@dataclass(frozen=True)
class RequestContent:
    """Scheduler side: a request's runs and its prompt's canary token ids up to the last run's end."""

    runs: tuple[PlaceholderRun, ...]
    ids: tuple[int, ...]  # canary_token_ids of prompt[:end]

    @property
    def end(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, request: Any) -> Optional["RequestContent"]:
        """None for a request without multimodal items."""
        runs = request_runs(request)
        if not runs:
            return None
        end = max(r.start + r.length for r in runs)
        prompt = request.prompt_token_ids
        if prompt is None or len(prompt) < end:
            raise KvCanaryRuntimeError(f"kv-canary: request {request.request_id}'s placeholder runs end at {end}, past "
                                       "its prompt token ids")
        return cls(runs=runs, ids=tuple(canary_token_ids(list(prompt[:end]), runs).tolist()))

    def spans(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of every run (what the worker needs)."""
        return tuple((r.start, r.start + r.length) for r in self.runs)

    def substitute(self, tokens: list, start: int) -> list:
        """``tokens`` (the history from position ``start``) with the content tokens in place of placeholder ids."""
        stop = min(self.end, start + len(tokens))
        if start >= stop:
            return tokens
        out = list(tokens)
        out[: stop - start] = self.ids[start:stop]
        return out


class MultimodalSpans:
    """Worker side: the placeholder spans of the live requests that have any (request id -> ``(start, end)`` pairs),
    and the rewrite of a forward's input ids at those positions into the content tokens of the token history."""

    def __init__(self) -> None:
        self.spans: dict[str, tuple[tuple[int, int], ...]] = {}
        self.end: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.spans)

    def add(self, request_id: str, spans: Sequence[Sequence[int]]) -> None:
        pairs = tuple((int(s), int(e)) for s, e in spans)
        if pairs:
            self.spans[request_id] = pairs
            self.end[request_id] = max(e for _, e in pairs)

    def drop(self, request_id: str) -> None:
        self.spans.pop(request_id, None)
        self.end.pop(request_id, None)

    def cells(self, req_ids: Sequence[str], rows: np.ndarray, prefix: np.ndarray,
              query: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(flat token index, request row, position)`` of every placeholder position this forward feeds, or None
        when it feeds none. Host only; a loop over the batch rows, only while a multimodal request is live."""
        idx, at_rows, at_pos = [], [], []
        off = 0
        for i, rid in enumerate(req_ids):
            q = int(query[i])
            end = self.end.get(rid)
            lo = int(prefix[i])
            if end is not None and lo < end:
                hi = lo + q
                for s, e in self.spans[rid]:
                    a, b = max(s, lo), min(e, hi)
                    if a < b:
                        pos = np.arange(a, b, dtype=np.int64)
                        at_pos.append(pos)
                        idx.append(pos - lo + off)
                        at_rows.append(np.full(b - a, int(rows[i]), dtype=np.int64))
            off += q
        if not idx:
            return None
        return np.concatenate(idx), np.concatenate(at_rows), np.concatenate(at_pos)


__all__ = ["feature_hash", "request_runs", "RequestContent", "MultimodalSpans"]
