#!/usr/bin/env bash
# One short device call (H200), issue 37: chaos beside the failed-capture tests and the graph-mode transformers tests.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
python3 -m pip install -q --no-deps .whl/transformers-5.24.0-py3-none-any.whl 2>&1 | tail -1
timeout "${CHAOS_S:-250}" python3 bench/chaos_gpu.py --cases "${CHAOS_CASES:-5}" --budget-s "${CHAOS_BUDGET:-190}" > "$OUT/chaos.log" 2>&1 &
timeout "${TESTS_S:-240}" python3 -m pytest tests/gpu/test_failed_capture_gpu.py tests/gpu/test_device_probe_gpu.py \
  tests/gpu/test_transformers_graphs.py tests/gpu/test_fuzz_clean_gpu.py tests/gpu/test_transformers_reads_gpu.py \
  -n 6 -q -p no:cacheprovider -rf --tb=short > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
wait
grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8; tail -40 "$OUT/chaos.log"
