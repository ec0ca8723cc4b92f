"""The vLLM workload's tiny-model shape from its command line (no vLLM needed): layers, window and the sliding layers
of a hybrid land in the model's ``config.json``; a malformed layer list is a ``kv-canary:`` ValueError."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcanary.faults.vllm_workload import _shape, model_config


def _args(layers=None, window=None, sliding_layers=None):
    return SimpleNamespace(layers=layers, window=window, sliding_layers=sliding_layers)


def test_hybrid_shape_from_the_command_line():
    shape = _shape(_args(5, 40, "1,3"))
    assert shape == {"layers": 5, "sliding_window": 40, "sliding_layers": (1, 3)}
    cfg = model_config("llama", **shape)
    assert cfg["layer_types"] == ["full_attention", "sliding_attention", "full_attention", "sliding_attention",
                                  "full_attention"]
    assert _shape(_args()) == {} and "layer_types" not in model_config("llama", **_shape(_args(3)))


@pytest.mark.parametrize("bad", ["1;3", "a", "1,,3"])
def test_malformed_sliding_layers_refused(bad):
    with pytest.raises(ValueError, match=r"^kv-canary: --sliding-layers takes comma-separated layer numbers"):
        _shape(_args(5, 40, bad))
