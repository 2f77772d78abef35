#!/usr/bin/env bash
# One device call (docs/gpu-notes.md): GPU tests, the trained tiny held out on the graphed path,
# then `bench gpu` for the TP=3 and TP=4 shards (step with the in-place Triton ring attention and
# with the gathered cuDNN attention, kernel breakdown), the full-size decoder and the pipelined period. Every section runs under `timeout` with a progress
# line each side, and the bench's own watchdog (--section-timeout) prints every Python stack if a
# part hangs, so one hang costs its section's limit, not the call. Worst case ~8.5 min in all.
# Logs and JSON (8 files) go to $OUT. Run from the repo root on the device machine (python3 with
# torch + Triton; structlog only for the stage test, from a wheel: see the usage in docs/gpu-notes.md).
# Usage: CHARSTREAM_COMMIT=<sha> scripts/gpu_check.sh  (wheels: pip install --no-deps .whl/*.whl first)
set -o pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Multi-GPU hosts: NVLink multicast stays off (KINDS.md); harmless on one GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CHARSTREAM_COMMIT=${CHARSTREAM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
START=$SECONDS
results=()

# section NAME LIMIT_S LOG COMMAND...: run COMMAND under a time limit, output to the console and LOG.
section() {
  local name=$1 limit=$2 log=$OUT/$3 rc
  shift 3
  echo "=== $name: start $(date -u +%T), limit ${limit}s, elapsed $((SECONDS - START))s" | tee -a "$log"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "=== $name: TIMED OUT after ${limit}s" | tee -a "$log"
  fi
  echo "=== $name: rc=$rc, elapsed $((SECONDS - START))s" | tee -a "$log"
  results+=("$name rc=$rc")
}

section "nvidia-smi" 15 nvidia-smi.txt nvidia-smi \
  --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=60)
section "gpu tests" 110 gpu-tests.log python3 -m pytest -q -m gpu -p no:cacheprovider "${per_test[@]}" \
  tests/test_kernels_gpu.py tests/test_graphed_gpu.py
# Separate: it needs structlog (a wheel on the device); a missing import must not hide the tests above.
section "gpu stage test" 40 gpu-tests.log python3 -m pytest -q -m gpu -p no:cacheprovider "${per_test[@]}" \
  tests/test_diffusion_stage.py
# The trained tiny on the GPU demo's path (bf16, FP8 GEMMs + ring, CUDA graph); needs espeakng-loader.
section "tiny held-out, graphed" 120 heldout-graphed.log python3 -m charstream.pipeline.quality.heldout \
  --config fp8-ring-graphed --device cuda --clips 4 --reruns 2 --seconds 8 --out /tmp/heldout-graphed
section "bench TP=3 shard" 100 bench-tp3.log python3 -m charstream.pipeline.bench_gpu --tp-shard 3 --skip sweep decoder pipeline \
  --section-timeout 80 --json "$OUT/bench_tp3.json"
section "bench TP=4 shard, decoder, pipeline" 140 bench-tp4.log python3 -m charstream.pipeline.bench_gpu --tp-shard 4 \
  --skip sweep ceilings --section-timeout 60 --json "$OUT/bench_tp4.json"

{
  echo "commit $CHARSTREAM_COMMIT, $(date -u +%FT%TZ), total $((SECONDS - START))s"
  printf '%s\n' "${results[@]}"
} | tee "$OUT/summary.txt"
! grep -q "rc=[1-9]" "$OUT/summary.txt"
