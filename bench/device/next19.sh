#!/usr/bin/env bash
# Fourteenth session, first call (~8 min, random weights, no uploads), for issues 6 and 7 (issue 5 was
# resolved in the thirteenth session; its figures are in docs/benchmarks.md):
#   kv_quant.txt: the fp8 / nvfp4 decode attention kernels against bf16 at 4k / 32k / 128k (nvfp4 0.50x
#     of bf16 at 32k in the ninth session, target <= 0.45x), with split-by-length off (af7c890);
#   sweep8b/: the 8B dummy shape with n-gram, every concurrency level 1-256, off / fixed / adaptive
#     (not re-run since the ninth session: 8 of 9 levels within 5% then).
# Then, in one lease, the 29 uploads (bench/device/next12.sh's header; carry only the part) and the pair
# sweep (not run since the eleventh session; concurrency 1-2 now prefill in pieces, and the draft model
# pays most at k = 12 on the real pair, so the fixed ks reach that far):
#   python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 --min-requests 8 \
#     --rounds 3 --interleave 3 --time-budget-s 540 --plots --out-dir "$OUT"
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
OUT=$OUT timeout 120 python3 bench/kv_quant_gpu.py --budget 90 > "$OUT/kv_quant.txt" 2>&1
sed -n '/^Best launch/,/^Sweep/p' "$OUT/kv_quant.txt"
mkdir -p "$OUT/sweep8b"
timeout 400 python3 bench/controller_sweep.py --mode ngram8b --policies off,fixed,adaptive --min-requests 8 \
  --rounds 2 --interleave 2 --time-budget-s 380 --plots --out-dir "$OUT/sweep8b" > "$OUT/sweep8b/out.txt" 2>&1
tail -n 30 "$OUT/sweep8b/out.txt"
