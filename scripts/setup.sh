#!/usr/bin/env bash
# Create .venv and install kvcanary with everything its tests and demo need (CPU machine).
# torch is installed first, pinned (the CPU build where there is no GPU), so pip never resolves a multi-GB CUDA
# build for a CPU machine; kvcanary's own requirement (torch>=2.4,<2.14) is then already met.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0"   # a GPU: the index's default (CUDA) build
else
  # No GPU: the CPU build only. A bare "torch==2.13.0" resolves on PyPI to the CUDA build, which pulls
  # several GB of nvidia-* wheels; the local-version pin "+cpu" never matches a CUDA wheel. It resolves
  # from a wheel directory or index that has the CPU build (pip's find-links / extra-index-url), else
  # from PyTorch's CPU-only index.
  .venv/bin/python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
    || .venv/bin/python -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
