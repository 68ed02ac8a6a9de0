#!/usr/bin/env bash
# Nineteenth session, last call: the start-up warm-up's GPU tests (prompt-sized eager forwards, so a draft
# model's first long catch-up compiles nothing mid-serving: the pair sweeps compiled the draft's prefill
# attention during adaptive runs, at c = 32 and at c = 4), then the 8B n-gram sweep with two waves per
# part (its first run in a closed loop with replacement; both throughput measures: the steady window and
# Little's law), at concurrency 1, 4, 16 and 64 (the device time left).
#   bash bench/device/next32.sh          # no model upload needed (~400 s)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_warmup_gpu.py > "$OUT/warmup_gpu.txt" 2>&1
tail -n 15 "$OUT/warmup_gpu.txt"
timeout 330 python3 bench/controller_sweep.py --mode ngram8b --policies off,fixed,adaptive --concurrency 1,4,16,64 \
  --min-requests 8 --rounds 2 --interleave 2 --waves 2 --point-warmup-tokens 256 --time-budget-s 300 --plots \
  --out-dir "$OUT" > "$OUT/ngram8b.txt" 2>&1
sed -n '/^Output tokens/,/^TPOT/p' "$OUT/ngram8b.txt"
grep -E "compile during|slow run" "$OUT/ngram8b.txt" | head -10
tail -2 "$OUT/ngram8b.txt"
