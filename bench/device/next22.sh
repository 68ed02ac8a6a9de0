#!/usr/bin/env bash
# (The shadow drafts were reverted after this run, which measured no gain: docs/benchmarks.md, fifteenth session.)
# Fifteenth session, issue 7: shadow n-gram drafts (spec/shadow.py) on the 8B n-gram sweep, A/B in two
# processes (SPECSERVE_SHADOW_DRAFTS=1, then 0), concurrency 4-64 where drafting and no drafts are close
# (16 was 0.934 of no drafts in this session's first call, with stale acceptance behind its k = 4 steps).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
for SH in 1 0; do
  mkdir -p "$OUT/shadow$SH"
  SPECSERVE_SHADOW_DRAFTS=$SH timeout 150 python3 bench/controller_sweep.py --mode ngram8b --policies off,fixed,adaptive --ks 4 \
    --concurrency 4,8,16,32,64 --min-requests 16 --rounds 3 --interleave 3 --time-budget-s 125 \
    --out-dir "$OUT/shadow$SH" > "$OUT/shadow$SH/out.txt" 2>&1
  sed -n '/^Output tokens/,/^adaptive: target/p' "$OUT/shadow$SH/out.txt"
done
# issue 6: one more B = 32 / 32k timing of bf16 and nvfp4 v3 / v4 (call 3's bf16 figure was an outlier)
OUT=$OUT timeout 60 python3 bench/kv_quant_gpu.py --contexts 32768 --budget 40 > "$OUT/kv_quant3.txt" 2>&1
grep -E "^\| 32 \| 32k|nvfp4 \| v4 \| default|nvfp4 \| v3 \| default" "$OUT/kv_quant3.txt"
