#!/usr/bin/env bash
# One device call: the GPU tests, then `bench gpu`, logs and JSON under $OUT (docs/gpu-notes.md).
# Run on the device machine from the repo root: its python3 has torch + Triton; nothing else needed.
# Usage: CHARSTREAM_COMMIT=<sha> scripts/gpu_check.sh [bench args...]
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# Multi-GPU hosts: NVLink multicast stays off (KINDS.md); harmless on one GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv \
  | tee "$OUT/nvidia-smi.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_graphed_gpu.py 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=$?
python3 -m pipeline.bench_gpu --json "$OUT/bench_gpu.json" "$@" 2>&1 | tee "$OUT/bench.log"
bench_rc=$?
echo "gpu tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
