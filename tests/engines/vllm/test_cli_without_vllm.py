"""``kvcanary demo --engine vllm`` where vLLM is not installed (the main venv): one ``kv-canary:`` line."""
from __future__ import annotations

import importlib.util

import pytest


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_demo_engine_vllm_without_vllm_is_a_one_line_error(capsys):
    from kvcanary.cli.main import main

    assert main(["demo", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kv-canary: the vLLM adapter needs vLLM 0.26.0 through 0.32.0") and err.count("\n") == 1
