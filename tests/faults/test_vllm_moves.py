"""The vLLM workload and experiments moved from ``kvcanary.engines.vllm`` to ``kvcanary.faults``: the old module paths
still import (and run with ``python -m``), warn `DeprecationWarning` naming the new path, and hand out the very same
objects. Neither module imports vLLM, so this runs in the main venv too (the fault connector's old path, which needs
vLLM, is checked in tests/engines/vllm/test_unit.py)."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest

# old path -> (new path, names the old path must hand out beyond __all__)
MOVED = {
    "kvcanary.engines.vllm.workload": ("kvcanary.faults.vllm_workload", ("main",)),
    "kvcanary.engines.vllm.experiments": ("kvcanary.faults.vllm_experiments", ("main", "_canary_of")),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_imports_warns_and_exposes_the_new_objects(old, monkeypatch):
    new, extra = MOVED[old]
    new_module = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported earlier in this process: import it afresh
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        old_module = importlib.import_module(old)
    assert old_module.__all__ == new_module.__all__
    for name in (*new_module.__all__, *extra):
        assert getattr(old_module, name) is getattr(new_module, name), name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_still_runs_with_python_m(old):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-m", old, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: ")
    assert "DeprecationWarning" in proc.stderr and MOVED[old][0] in proc.stderr  # shown by default in __main__
