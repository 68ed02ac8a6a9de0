#!/usr/bin/env bash
# Sixteenth session, first call (~7 min, no uploads), issue 7: the per-bucket calibration of predicted
# drafts (estimators.TokenCalibration, ae57cd1) on the 8B n-gram sweep at every level, A/B against the
# same controller without it in the same process (policy adaptive-uncalibrated). The fifteenth session
# measured 16 at 0.93 of no drafts, its k = 4 steps getting 0.17-0.25 accepted drafts per request where
# 0.44-0.49 were predicted.
# Then, in one lease, the 29 uploads (bench/device/put_part.sh; carry only the part) and the pair:
#   python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive,adaptive-uncalibrated \
#     --ks 4,8,12 --min-requests 8 --rounds 3 --interleave 3 --time-budget-s 540 --plots --out-dir "$OUT"
# (the pair missed at 2, 0.948, and 8, 0.87: catch-ups after steps without drafts in a near tie; the JSON
# now keeps every choice and step of the adaptive policies up to concurrency 32, "trace", to see why).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/sweep8b"
timeout 480 python3 bench/controller_sweep.py --mode ngram8b --policies off,fixed,adaptive,adaptive-uncalibrated \
  --min-requests 8 --rounds 2 --interleave 2 --time-budget-s 450 --plots --out-dir "$OUT/sweep8b" \
  > "$OUT/sweep8b/out.txt" 2>&1
sed -n '/^Output tokens/,/^adaptive-uncalibrated: target/p' "$OUT/sweep8b/out.txt"
