#!/usr/bin/env bash
# Sixteenth session, issue 6: v4 / v5 / v6 again, to choose the default. Call 2 (next24.sh) had v6 1%
# faster than v4 at B = 32 / 32k in two processes, but 3% slower at 128k and 7-11% slower at B = 1 in one.
# Two processes: 4k, 32k and 128k (bf16 is faster at 32k after the 4k shapes), then 128k and 32k.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
for ctx in 4096,32768,131072 131072,32768; do
  timeout 170 python3 bench/kv_quant_gpu.py --contexts $ctx --budget 140 > "$OUT/kvq_$ctx.txt" 2>&1
  sed -n '/^| B | ctx | bf16 | fp8 v1/,/^$/p' "$OUT/kvq_$ctx.txt"
  grep -E "FAIL|failed|MISS|PASS" "$OUT/kvq_$ctx.txt" | head -5
done
