#!/usr/bin/env bash
# Sixteenth session, issue 7, last device time: the 8B n-gram sweep again at its marginal levels (4, 8,
# 16: 0.97 / 0.952 / 0.97 in call 3), 3 rounds per point, with the code of ce2c1b7 (the catch-up fit does
# not touch n-gram drafting, which never catches up): is the calibrated controller's 9 of 9 repeatable?
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 240 python3 bench/controller_sweep.py --mode ngram8b --policies off,fixed,adaptive --concurrency 4,8,16 \
  --min-requests 8 --rounds 3 --interleave 3 --time-budget-s 210 --out-dir "$OUT" > "$OUT/out.txt" 2>&1
sed -n '/^Output tokens/,/^adaptive: target/p' "$OUT/out.txt"
tail -2 "$OUT/out.txt"
