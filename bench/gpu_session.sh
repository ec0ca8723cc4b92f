#!/usr/bin/env bash
# One device call of a session: the stages named as arguments, each under its own time limit, logs in $OUT.
#   bash bench/gpu_session.sh tests runtime soak_warm soak copy kernels e2e e2e_quick deep
# Runs from wherever it is started (a snapshot of a commit: see docs/lab/NOTES.md); prints a short summary last.
# The tests stage is verbose (-vv: pyproject's addopts has -q, so -v alone prints dots; under xdist each result is printed with its name as it lands), so a stage cut by
# its limit still says which tests failed (run 22 printed only `...F.F.`).
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Triton's compile cache travels between calls of a session (a fresh machine compiles for ~60 s): it goes back in
# $OUT as xz parts of <= 15 MiB (triton-cache.txz.*); copy them into .triton-cache/ here and carry that folder.
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if ls .triton-cache/triton-cache.txz.* >/dev/null 2>&1; then
  # A cache cut short (a call that ran out of time while packing it) still gives every entry before the cut; an
  # entry left without its cubin would make Triton fail ("Unknown key: 'cubin'", run 29), so such entries go.
  cat .triton-cache/triton-cache.txz.* | tar -xJ -C "$TRITON_CACHE_DIR" 2>/dev/null || echo "triton cache: archive cut short"
  for d in "$TRITON_CACHE_DIR"/*/; do
    if ls "$d"*.source >/dev/null 2>&1 && ! ls "$d"*.cubin >/dev/null 2>&1; then rm -rf "$d"; fi
  done
  echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries carried"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"
# BENCH_CPUS (e.g. "2-5"): run the bench stages under `taskset -c $BENCH_CPUS`, so the engine's threads stay on
# the same cores between rounds (run 40's decode rounds fell into two or three host speeds per configuration)
PIN=()
if [ -n "${BENCH_CPUS:-}" ]; then
  if command -v taskset >/dev/null 2>&1; then PIN=(taskset -c "$BENCH_CPUS"); else echo "taskset missing: BENCH_CPUS ignored"; fi
fi
summary=()
stage() {  # stage NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  # a stage cut by its limit may leave pytest-xdist workers running on the GPU: they would slow every later stage
  # (processes on one GPU time-slice it: runs 25-26, 29)
  pkill -f 'python3 -m pytest' 2>/dev/null && sleep 2
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(grep -E 'passed|failed|met|total|forwards in|error' "$OUT/$name.log" | tail -2 | tr '\n' ' ' | cut -c1-150)")")
}
for s in "$@"; do
  case $s in
    tests)   stage tests "${TESTS_LIMIT:-230}" python3 -m pytest ${TESTS_SELECT:-tests/gpu tests/ops/test_copy.py::test_gpu_triton_matches_twin \
               tests/ops/test_copy.py::test_gpu_copy_and_export_replay_in_a_cuda_graph} -vv -rf -n ${TESTS_WORKERS:-12} --junitxml "$OUT/tests.xml" -p no:cacheprovider --durations=10 -p no:benchmark ;;
    runtime) stage runtime "${RUNTIME_LIMIT:-150}" "${PIN[@]}" python3 bench/runtime_overhead.py ${RUNTIME_ARGS:---profile 14} --json "$OUT/runtime.json" ;;
    soak_warm) stage soak_warm "${SOAK_WARM_LIMIT:-150}" python3 bench/gpu_soak.py --seconds "${SOAK_WARM_SECONDS:-100}" ;;  # compiles the soak's variants into the packed cache (run 48: 87 s of compile)
    soak)    stage soak "${SOAK_LIMIT:-110}" "${PIN[@]}" python3 bench/gpu_soak.py --seconds "${SOAK_SECONDS:-90}" --workers "${SOAK_WORKERS:-0}" --json "$OUT/soak.json" ;;
    copy)    stage copy 60 python3 bench/copy_records.py --device cuda ;;
    kernels) stage kernels "${KERNELS_LIMIT:-110}" "${PIN[@]}" python3 bench/gpu_kernels.py --quick ${KERNELS_ARGS:-} ;;
    e2e)     stage e2e "${E2E_LIMIT:-420}" "${PIN[@]}" python3 bench/e2e_overhead.py --graphs on ${E2E_ARGS:-} --json "$OUT/e2e.json" ;;
    e2e_off) stage e2e_off "${E2E_OFF_LIMIT:-240}" "${PIN[@]}" python3 bench/e2e_overhead.py --graphs off ${E2E_OFF_ARGS:-} --json "$OUT/e2e_off.json" ;;
    e2e_quick) stage e2e_quick "${E2E_LIMIT:-300}" "${PIN[@]}" python3 bench/e2e_overhead.py --quick --json "$OUT/e2e.json" ;;
    deep)    stage deep "${DEEP_LIMIT:-90}" "${PIN[@]}" python3 bench/runtime_overhead.py --deep-fingerprints --grid 1x256,64x4096 ;;
    *) echo "unknown stage $s" ;;
  esac
done
# xz on all cores (one thread took ~150 s over ~650 entries, run 31); PACK_CACHE=0 skips it (a session's last call)
if [ "${PACK_CACHE:-1}" != 0 ]; then
  tar -cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -6 | split -b 15M - "$OUT/triton-cache.txz." && echo "triton cache back in \$OUT: $(du -ch "$OUT"/triton-cache.txz.* | tail -1 | cut -f1)"
fi
echo "==== summary ($OUT) ===="
printf '%s\n' "${summary[@]}"
