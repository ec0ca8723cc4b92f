#!/usr/bin/env bash
# One device call (H200), issue 37: the failed-capture tests first (their own log), bench/chaos_gpu.py beside,
# then the rest of the GPU tests. Needs transformers 5.24.0's wheel in .whl/ (carried). Outputs in $OUT.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
python3 -m pip install -q --no-deps .whl/transformers-5.24.0-py3-none-any.whl 2>&1 | tail -1
python3 -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee "$OUT/machine.txt"
timeout "${CHAOS_S:-330}" python3 bench/chaos_gpu.py --cases "${CHAOS_CASES:-6}" --budget-s "${CHAOS_BUDGET:-260}" > "$OUT/chaos.log" 2>&1 &
FIRST="tests/gpu/test_failed_capture_gpu.py tests/gpu/test_device_probe_gpu.py"
timeout 200 python3 -m pytest $FIRST -n 3 -q -p no:cacheprovider -rf --tb=short > "$OUT/tests_failsafe.log" 2>&1
echo "failsafe tests rc=$?"
timeout "${TESTS_S:-300}" python3 -m pytest tests/gpu -n "${WORKERS:-8}" -q -p no:cacheprovider -rf --tb=line \
  --deselect tests/gpu/test_failed_capture_gpu.py --deselect tests/gpu/test_device_probe_gpu.py > "$OUT/tests.log" 2>&1
echo "gpu tests rc=$?"
wait
tail -6 "$OUT/tests_failsafe.log"; tail -8 "$OUT/tests.log"; tail -45 "$OUT/chaos.log"
