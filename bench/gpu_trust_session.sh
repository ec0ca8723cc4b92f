#!/usr/bin/env bash
# One device call (H200): the GPU tests, then the transformers clean-workload fuzzer with CUDA graphs
# (4 processes x 25 configurations, seed 0) in the background beside them. Needs transformers 5.24.0's wheel in
# .whl/ (carried). CHAOS=1 adds bench/chaos_gpu.py; FUZZ_FIRST / FUZZ_N / FUZZ_S pick the configurations. Outputs (<= 8 files) in $OUT; a short table last.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
python3 -m pip install -q --no-deps .whl/transformers-5.24.0-py3-none-any.whl 2>&1 | tail -1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$OUT/machine.txt"
cat "$OUT/machine.txt"
FUZZ_S=${FUZZ_S:-400}; FUZZ_FIRST=${FUZZ_FIRST:-0}; FUZZ_N=${FUZZ_N:-25}
if [ "${CHAOS:-0}" = 1 ]; then  # the fail-safe chaos cases (bench/chaos_gpu.py) beside the rest
  timeout "${CHAOS_S:-300}" python3 bench/chaos_gpu.py --cases "${CHAOS_CASES:-6}" --budget-s "${CHAOS_BUDGET:-240}" \
    > "$OUT/chaos.log" 2>&1 &
fi
for k in 0 1 2 3; do
  timeout $((FUZZ_S + 60)) python3 bench/fuzz_clean.py --engine transformers --device cuda --cuda-graphs --seed 0 \
    --first-seed $((FUZZ_FIRST + k * FUZZ_N)) --configs "$FUZZ_N" --max-seconds "$FUZZ_S" --no-progress --quiet --out "$OUT/fuzz_gpu_$k.json" \
    > /tmp/fuzz_$k.log 2>&1 &
done
timeout "${TESTS_S:-330}" python3 -m pytest ${TESTS_SELECT:-tests/gpu} -n "${WORKERS:-8}" -q -p no:cacheprovider -rf \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
wait
for k in 0 1 2 3; do echo "fuzz $k: $(tail -3 /tmp/fuzz_$k.log | tr '\n' ' ' | cut -c1-300)"; done
tail -15 "$OUT/tests.log"
[ -f "$OUT/chaos.log" ] && tail -30 "$OUT/chaos.log"
