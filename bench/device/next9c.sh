#!/usr/bin/env bash
# Eighth session, device block 2, call C (after the 26 uploads; ~9.5 min):
#   the pair controller sweep with 3 rounds per point (the JSON's "controller" and "steps_by_k" rows),
#   then perplexity of the real Qwen2.5-Coder-1.5B with each KV dtype under the new kernel defaults
#   (fp8 v3, nvfp4 v3: the engine path on the model where v2 once faulted).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 390 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --min-requests 8 --rounds 3 \
  --time-budget-s 300 --plots --out-dir "$OUT" > "$OUT/sweep_pair.txt" 2>&1
tail -n 40 "$OUT/sweep_pair.txt"
OUT=$OUT timeout 190 python3 bench/kv_quality.py --tasks ppl --kv-dtypes bfloat16,fp8,nvfp4 --ppl-tokens 16384 \
  --time-budget-s 170 > "$OUT/kv_quality.txt" 2>&1
tail -n 12 "$OUT/kv_quality.txt"
