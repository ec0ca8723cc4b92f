#!/usr/bin/env bash
# The one script sent to the GPU machine: GPU parity tests, then the kernel benchmark.
# Usage (device): bash bench/run_gpu.sh   — logs go under $OUT (or ./gpu_out).
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, triton, numpy, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/machine.txt"
timeout 330 python3 -m pytest tests/gpu -q -x -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/gpu_tests.log"
echo "gpu tests rc=$?"
timeout 220 python3 bench/gpu_kernels.py 2>&1 | tee "$OUT/gpu_kernels.out.txt"
echo "bench rc=$?"
