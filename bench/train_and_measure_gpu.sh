#!/usr/bin/env bash
# One device call (< 10 minutes): train EAGLE-3 and P-EAGLE heads for Qwen2.5-Coder-1.5B on
# self-distilled stdlib data, then measure acceptance length and tokens/s at batch 1 and 4 against
# no speculation, the 0.5B draft model, n-gram and transformers. Models: the catalog names
# (bench/device/env.sh points SPECSERVE_CACHE at the parts put_part.sh assembled), or
# /tmp/models/*1.5B*.gguf and *0.5B*.gguf, or --target/--draft. Heads go to /tmp/spec_gpu;
# results.json (rewritten as phases and measurement rounds finish) and the log are written straight
# into $OUT (or /tmp/spec_gpu_results), so a run stopped at the device's limit still returns them.
# Usage: bash bench/train_and_measure_gpu.sh [extra args for bench/train_and_measure_gpu.py]
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f bench/device/env.sh ]; then source bench/device/env.sh; fi
export PYTHONUNBUFFERED=1
RES="${OUT:-/tmp/spec_gpu_results}"
mkdir -p "$RES"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python bench/train_and_measure_gpu.py --out /tmp/spec_gpu --results-dir "$RES" "$@" 2>&1 | tee "$RES/train_and_measure.log"
status=${PIPESTATUS[0]}
for h in eagle3 p-eagle; do cp "/tmp/spec_gpu/$h/config.json" "$RES/${h}_config.json" 2>/dev/null || true; done
exit "$status"
