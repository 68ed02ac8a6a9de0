#!/usr/bin/env bash
# One device call (< 10 minutes): train EAGLE-3 and P-EAGLE heads for Qwen2.5-Coder-1.5B on
# self-distilled stdlib data, then measure acceptance length and tokens/s at batch 1 and 4 against
# no speculation (and the 0.5B draft model, n-gram). Models: /tmp/models/*1.5B*.gguf and
# /tmp/models/*0.5B*.gguf (override with --target/--draft). Heads go to /tmp/spec_gpu; the table is
# printed and results.json + the log land in $OUT when the device runner provides one.
# Usage: bash bench/train_and_measure_gpu.sh [extra args for bench/train_and_measure_gpu.py]
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python bench/train_and_measure_gpu.py --out /tmp/spec_gpu "$@" 2>&1 | tee /tmp/spec_gpu.log
if [ -n "${OUT:-}" ]; then
  cp /tmp/spec_gpu/results.json /tmp/spec_gpu.log "$OUT"/ 2>/dev/null || true
  cp /tmp/spec_gpu/eagle3/config.json "$OUT"/eagle3_config.json 2>/dev/null || true
fi
