"""Content tokens at placeholder positions: deterministic, in range, only where the runs are."""
import pytest
import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.runtime.multimodal import (MM_TOKEN_BASE, MM_TOKEN_LIMIT, PlaceholderRun, canary_token_ids,
                                         content_token, is_content_token, item_hash)


def test_placeholders_become_content_tokens_and_text_is_unchanged():
    ids = [11, 12, 99, 99, 99, 13, 99, 99]
    cat, dog = item_hash(b"cat"), item_hash(b"dog")
    out = canary_token_ids(ids, [PlaceholderRun(start=2, length=3, item_hash=cat),
                                 PlaceholderRun(start=6, length=2, item_hash=cat)])
    assert out.dtype == torch.int64 and out[[0, 1, 5]].tolist() == [11, 12, 13]
    assert out[2:5].tolist() == [content_token(99, cat, i) for i in range(3)]
    assert all(is_content_token(t) and MM_TOKEN_BASE <= t < MM_TOKEN_LIMIT for t in out[2:5].tolist() + out[6:].tolist())
    assert len(set(out[2:5].tolist())) == 3  # the offset is in the token
    other = canary_token_ids(ids, [PlaceholderRun(start=2, length=3, item_hash=dog)])
    assert other[:2].tolist() == out[:2].tolist() and all(x != y for x, y in zip(other[2:5], out[2:5]))
    assert canary_token_ids(torch.tensor(ids, dtype=torch.int32), []).tolist() == ids


def test_item_hash_is_deterministic_over_content_types():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert item_hash(t) == item_hash(t.clone()) != item_hash(t.reshape(4, 3))
    assert item_hash(t) != item_hash(t.to(torch.float64))
    assert item_hash(b"x") == item_hash(bytearray(b"x")) != item_hash("x") != item_hash(7)
    assert item_hash(b"x") == 0xFFFFFFFFFFFFFFFF & item_hash(b"x")
    with pytest.raises(KvCanaryTypeError, match="^kv-canary: item_hash"):
        item_hash(1.5)


def test_bad_runs_and_ids_are_refused():
    with pytest.raises(KvCanaryValueError, match="^kv-canary: placeholder run"):
        canary_token_ids([1, 2, 3], [PlaceholderRun(start=2, length=2, item_hash=1)])
    with pytest.raises(KvCanaryValueError, match="overlaps"):
        canary_token_ids([1] * 6, [PlaceholderRun(start=0, length=3, item_hash=1), PlaceholderRun(start=2, length=2, item_hash=2)])
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: token ids must lie in"):
        canary_token_ids([1, MM_TOKEN_BASE], [])
    with pytest.raises(KvCanaryValueError):
        PlaceholderRun(start=0, length=0, item_hash=1)
    with pytest.raises(KvCanaryTypeError):
        PlaceholderRun(start=0, length=1, item_hash="h")
