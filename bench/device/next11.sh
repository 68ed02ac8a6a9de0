#!/usr/bin/env bash
# Ninth session, after the 28 uploads (put_part.sh, parts of 61,000,000 bytes: .models/q15b.partNN,
# q05b.partNN; the tree grew past what a 60 MiB part leaves room for):
#   tests: the start-up warm-up's GPU tests (the new one: chunks of 1..16 tokens after a 608-token
#     prefix compile nothing after start-up);
#   probe_old.txt / probe.txt: bench/catch_up_probe.py with the start-up forwards as before, then as now
#     (first against second run of each chunk size, draft model and target; the adaptive controller at
#     concurrency 1, twice);
#   sweep_c12.txt: the pair sweep at concurrency 1 and 2 (the first adaptive run at 1 measured 373 tok/s
#     against 802-855 later in the 11-30 run).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_warmup_gpu.py > "$OUT/tests.txt" 2>&1
tail -n 3 "$OUT/tests.txt"
OUT=$OUT timeout 120 python3 bench/catch_up_probe.py --old-warm-up > "$OUT/probe_old.txt" 2>&1
tail -n 30 "$OUT/probe_old.txt"
OUT=$OUT timeout 120 python3 bench/catch_up_probe.py > "$OUT/probe.txt" 2>&1
tail -n 30 "$OUT/probe.txt"
timeout 200 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --concurrency 1,2 \
  --min-requests 8 --rounds 3 --interleave 3 --time-budget-s 150 --out-dir "$OUT" > "$OUT/sweep_c12.txt" 2>&1
sed -n '/Output tokens/,/^adaptive:/p' "$OUT/sweep_c12.txt"
