#!/usr/bin/env bash
# One device call (issue 28, vLLM on the GPU; and issue 37's GPU tests beside it). Carry [".vl/vllm", ".whl"].
# STAGES (default "tests bench1b"): tests = tests/gpu/test_vllm_gpu.py (+ issue 37's tests in the background),
# parity = the kernel parity tests on the GPU; bench1b / bench8b = bench/vllm_gpu_overhead.py for one shape. Everything lands under $OUT.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
T0=$(date +%s); left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - T0) )); }
bash .vl/vllm/install.sh || exit 1
export PYTHONPATH=$PWD/src:/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_DIR=/tmp/triton-cache KVC_WORKLOAD_DUMP=${KVC_WORKLOAD_DUMP-$OUT/workloads}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, triton, vllm, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/machine.txt"
echo "src sha256 $(find src -name "*.py" | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12)" | tee -a "$OUT/machine.txt"
for stage in ${STAGES:-tests bench1b}; do
  case $stage in
    tests)
      if [ -n "${WITH_37-1}" ] && [ -f .whl/transformers-5.24.0-py3-none-any.whl ]; then
        python3 -m pip install -q --no-deps --target /tmp/tf524 .whl/transformers-5.24.0-py3-none-any.whl > /dev/null 2>&1
        ( PYTHONPATH=/tmp/tf524:$PWD/src timeout 330 python3 -m pytest tests/gpu/test_failed_capture_gpu.py \
            tests/gpu/test_device_probe_gpu.py tests/gpu/test_transformers_graphs.py tests/gpu/test_transformers_reads_gpu.py \
            -n 4 -q -p no:cacheprovider -rf --tb=short > "$OUT/tests37.log" 2>&1; echo "tests37 rc=$?" >> "$OUT/tests37.log" ) &
      fi
      timeout $(( $(left) - 20 )) python3 -m pytest tests/gpu/test_vllm_gpu.py -x -q -s -p no:cacheprovider -rf --tb=short \
        > "$OUT/vllm_tests.log" 2>&1
      echo "vllm tests rc=$?" | tee -a "$OUT/vllm_tests.log"
      wait
      tail -4 "$OUT/tests37.log" 2>/dev/null
      grep -E "passed|failed|FAILED|Error|^\{|\[\{" "$OUT/vllm_tests.log" | tail -12 ;;
    eagle)  # issue 34: vLLM EAGLE speculative decoding with the canary on the GPU (tests/gpu/test_vllm_gpu_eagle.py)
      timeout $(( ${EAGLE_S:-$(left)} - 10 )) python3 -m pytest tests/gpu/test_vllm_gpu_eagle.py -q -s -p no:cacheprovider -rf \
        --tb=short > "$OUT/eagle_tests.log" 2>&1
      echo "eagle tests rc=$?" | tee -a "$OUT/eagle_tests.log"
      grep -E "passed|failed|FAILED|Error|^\{|\[\{" "$OUT/eagle_tests.log" | tail -8 ;;
    gputests)  # any GPU test files: GPU_TESTS="tests/gpu/a.py tests/gpu/b.py::test_x" (log: gputests.log)
      # -x: the first failure prints its traceback at once (a call cut by its time limit still brings it back)
      timeout $(( ${GPUTESTS_S:-$(left)} - 10 )) python3 -m pytest ${GPU_TESTS} -q ${GPU_TESTS_X--x} -p no:cacheprovider -rf \
        --tb=short > "$OUT/gputests.log" 2>&1
      echo "gputests rc=$?" | tee -a "$OUT/gputests.log"
      grep -E "passed|failed|FAILED|Error" "$OUT/gputests.log" | tail -10
      grep -qE "^(E |FAILED)" "$OUT/gputests.log" && grep -E "^E |^FAILED|^tests/|Error" "$OUT/gputests.log" | cut -c1-300 | head -40 ;;
    t37bg)  # issue 37's failed-capture tests in the background, reported at the end
      python3 -m pip install -q --no-deps --target /tmp/tf524 .whl/transformers-5.24.0-py3-none-any.whl > /dev/null 2>&1
      ( PYTHONPATH=/tmp/tf524:$PWD/src timeout ${T37_S:-300} python3 -m pytest tests/gpu/test_failed_capture_gpu.py -n 4 -q \
          -p no:cacheprovider -rf --tb=short > "$OUT/tests37.log" 2>&1; echo "tests37 rc=$?" >> "$OUT/tests37.log" ) & ;;
    diag37|diag37bg)  # diag37bg: in the background (a tiny model beside the bench's engines), reported at the end
      python3 -m pip install -q --no-deps --target /tmp/tf524 .whl/transformers-5.24.0-py3-none-any.whl > /dev/null 2>&1
      ( PYTHONPATH=/tmp/tf524:$PWD/src timeout ${DIAG37_S:-240} python3 bench/diag/capture_recovery_gpu.py > "$OUT/diag37.log" 2>&1
        echo "diag37 rc=$? ended at $(( $(date +%s) - T0 )) s" >> "$OUT/diag37.log" ) &
      [ "$stage" = diag37 ] && wait ;;
    parity)  # the Triton kernels against their torch twins on this GPU (ops, deep store, many-context launches, runtime)
      timeout $(( ${PARITY_S:-$(left)} - 20 )) python3 -m pytest ${PARITY_FILES:-tests/gpu/test_gpu_parity.py tests/gpu/test_deep_store_gpu.py \
        tests/gpu/test_gpu_many.py tests/gpu/test_kernel_variants_gpu.py tests/gpu/test_runtime_kernels.py} -q -x \
        -p no:cacheprovider -rf --tb=short > "$OUT/parity.log" 2>&1
      echo "parity rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/parity.log" | tail -8 ;;
    deepcap)  # the deep store captured in a CUDA graph after prepare_deep_store (one test, few compiles)
      timeout 240 python3 -m pytest tests/gpu/test_deep_store_gpu.py -k captured -q -p no:cacheprovider -rf --tb=short \
        > "$OUT/deepcap.log" 2>&1; echo "deepcap rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/deepcap.log" | tail -4 ;;
    sections)  # the adapter's host time per decode forward by section, and each explicit sweep's parts
      for shape in ${SECTION_SHAPES:-${KVC_SHAPE:-1b}}; do  # SECTION_SHAPES="1b 8b": one engine per shape, in turn
        KVC_SHAPE=$shape timeout $(( $(left) - 10 )) python3 bench/diag/vllm_host_sections.py > "$OUT/sections_$shape.log" 2>&1
        echo "sections $shape rc=$?"; grep -E "^round|^section|^bind|^save|^sched|^stats|^sweep|^explicit|^device" "$OUT/sections_$shape.log" | head -60
        grep -E "^profile|^kernel" "$OUT/sections_$shape.log" | head -${PROFILE_LINES:-32}
      done ;;
    race)  # issue 32: does jitter surface an unordered side-stream write? (simulated engine; then the cost table)
      timeout $(( $(left) - 10 )) python3 bench/jitter_race.py --json "$OUT/jitter_race.json" > "$OUT/race.log" 2>&1
      echo "race rc=$?"; grep -vE "^\[|Warning|warn" "$OUT/race.log" | tail -16
      [ "$(left)" -gt 120 ] && { timeout $(( $(left) - 10 )) python3 bench/jitter_cost.py --quick --max-cycles 50000 \
        --json "$OUT/jitter_cost.json" > "$OUT/jitter_cost.log" 2>&1; echo "jitter_cost rc=$?"; tail -12 "$OUT/jitter_cost.log"; } ;;
    diag)
      timeout $(( $(left) - 10 )) python3 bench/diag/vllm_sync_profile.py > "$OUT/diag.log" 2>&1
      echo "diag rc=$?"; grep -vE "^\[|^INFO|^WARNING|^\(|Warning|warn" "$OUT/diag.log" | grep -A200 "^round" | head -90 ;;
    benchspec)  # issue 34: the canary's cost per decode step with n-gram speculative decoding (1B), against the same without it
      [ "$(left)" -lt "${MIN_BENCH_S:-200}" ] && { echo "skip $stage: $(left) s left"; continue; }
      timeout $(( $(left) - 10 )) python3 bench/vllm_gpu_overhead.py --shapes 1b --rounds "${ROUNDS:-2}" \
        --arms none_ngram canary_ngram --out "$OUT/vllm_gpu_overhead.1b_ngram.json" > "$OUT/bench_spec.log" 2>&1
      echo "$stage rc=$?"; grep -E "^\[|shape|^1b" "$OUT/bench_spec.log" | tail -16 ;;
    bench1b|bench8b)
      shape=${stage#bench}
      [ "$(left)" -lt "${MIN_BENCH_S:-200}" ] && { echo "skip $stage: $(left) s left"; continue; }
      arms_var="ARMS_${shape^^}"; arms=${!arms_var:-$ARMS}  # ARMS_1B / ARMS_8B: this shape's arms (default ARMS)
      timeout $(( $(left) - 10 )) python3 bench/vllm_gpu_overhead.py --shapes "$shape" --rounds "${ROUNDS:-3}" ${arms:+--arms $arms} \
        --out "$OUT/vllm_gpu_overhead.$shape.json" > "$OUT/bench_$shape.log" 2>&1
      echo "$stage rc=$?"; grep -E "^\[|shape|^1b|^8b" "$OUT/bench_$shape.log" | tail -24 ;;
  esac
done
wait
[ -f "$OUT/tests37.log" ] && grep -E "passed|failed|FAILED|Error|assert|rc=" "$OUT/tests37.log" | cut -c1-300 | tail -20
if [ -f "$OUT/diag37.log" ]; then
  grep -E "^=====|^\[(raw|engine|recover|reset[0-9]?|probe)\]|rc=" "$OUT/diag37.log" | cut -c1-200 | head -75
fi
