#!/usr/bin/env bash
# How the shipped weights (model/assets/tiny.safetensors) were made: one run on one H200.
# Train (time-boxed), then held-out lip sync + a 10-minute drift session on the same GPU.
# Usage (repo root, espeakng-loader importable): OUT=/some/dir examples/train_tiny_gpu.sh [TRAIN_BUDGET_S]
# TRAIN_ARGS: extra `charstream train` options (e.g. "--dit-batch 64").
set -u
OUT=${OUT:-runs/gpu}
BUDGET=${1:-380}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
python3 -m charstream.pipeline.training.train --out /tmp/run --budget-s "$BUDGET" --seed 0 ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
echo "train exit $?" >> "$OUT/train.log"
cp /tmp/run/dit.safetensors /tmp/run/vae_audio.safetensors "$OUT/"
python3 -c "from pathlib import Path; from charstream.model.weights import merge; \
merge([Path('/tmp/run/dit.safetensors'), Path('/tmp/run/vae_audio.safetensors')], Path('/tmp/run/tiny.safetensors'))"
timeout "${EVAL_S:-120}" python3 -m charstream.pipeline.quality.heldout --weights /tmp/run/tiny.safetensors --device cuda \
  --clips 12 --reruns 2 --seconds 8 --session-minutes 10 --out /tmp/eval > "$OUT/eval.log" 2>&1
echo "eval exit $?" >> "$OUT/eval.log"
tar czf "$OUT/small.tgz" -C /tmp run/loss.json run/metrics.json run/loss_vae_recon.png run/loss_dit_loss.png eval
