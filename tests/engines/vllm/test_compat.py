"""The accepted vLLM version range, checked against a stand-in ``vllm`` module (no engine needed)."""
from __future__ import annotations

import sys
import types

import pytest

from kvcanary.engines.vllm.compat import MAX_VLLM, MIN_VLLM, check_vllm_version, is_supported_version, release_tuple


@pytest.mark.parametrize("version", ["0.26.0", "0.26.0+cpu", "0.29.3", "0.32.0", "0.32.0+cpu", "0.26.0.post1"])
def test_versions_in_the_range_are_accepted(version):
    assert is_supported_version(version)


@pytest.mark.parametrize("version", ["0.25.9", "0.32.1", "0.33.0", "1.0.0", "0.26.0rc1", "0.32.0.dev3+gabc",
                                     "0.27", "unknown", ""])
def test_versions_outside_the_range_or_not_final_are_refused(version):
    assert not is_supported_version(version)


def test_release_tuple_ignores_post_and_local_parts():
    assert release_tuple("0.32.0.post2+cpu") == (0, 32, 0)
    assert release_tuple("0.32.0rc1") is None


def _fake_vllm(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))


@pytest.mark.parametrize("version", [MIN_VLLM, MAX_VLLM, "0.26.0+cpu"])
def test_check_accepts_both_ends_of_the_range(monkeypatch, version):
    _fake_vllm(monkeypatch, version)
    assert check_vllm_version() == version


@pytest.mark.parametrize("version", ["0.25.0", "0.33.0"])
def test_check_refuses_with_a_message_naming_the_range(monkeypatch, version):
    _fake_vllm(monkeypatch, version)
    with pytest.raises(RuntimeError, match=rf"^kv-canary: vLLM {version} is not supported; .*0\.26\.0 through 0\.32\.0"):
        check_vllm_version()


def test_model_runner_classes_cover_the_v2_runner_which_is_not_a_v1_subclass():
    pytest.importorskip("vllm")
    from kvcanary.engines.vllm.compat import model_runner_classes

    classes = model_runner_classes()
    modules = [c.__module__ for c in classes]
    assert modules[0] == "vllm.v1.worker.gpu_model_runner"
    if "vllm.v1.worker.gpu.model_runner" in modules:
        v2 = classes[modules.index("vllm.v1.worker.gpu.model_runner")]
        assert classes[0] not in v2.__mro__
