"""`classify_forward`: the one rule every adapter names its forwards by."""
from kvcanary.runtime import FORWARD_KINDS, classify_forward


def test_kinds():
    assert classify_forward([], []) == "idle"
    assert classify_forward([0, 0], [5, 3]) == "prefill"
    assert classify_forward([0, 16], [5, 8]) == "prefill"  # a chunked-prefill continuation is prefill everywhere
    assert classify_forward([4, 9], [1, 1]) == "decode"
    assert classify_forward([4, 0], [1, 7]) == "mixed"
    assert classify_forward([4, 9], [4, 1], [True, False]) == "verify"  # a verify beside a plain decode
    assert classify_forward([4, 0], [4, 6], [True, False]) == "mixed"
    assert classify_forward([4], [4]) == "prefill"  # without the flag, k + 1 tokens after a context look like a chunk
    assert set(FORWARD_KINDS) >= {"idle", "prefill", "decode", "verify", "mixed"}
