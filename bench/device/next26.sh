#!/usr/bin/env bash
# Seventeenth session, issue 7: the pair with more rounds per point, and the catch-up fit that keeps
# its range and prices unpaired cold proposals (386c3ac). The sixteenth session's pair (3 rounds) missed
# at 2, 4, 16, 128 and 256; at 128 / 256 no speculation's own runs spread by 15-40%, and one catch-up
# took 374 ms at 256. Its points took 164 s of the 530 s budget: 5 rounds fit. A slow proposal in the
# JSON ("slow_proposals") now has its batch size, the tokens the draft model had not seen and the
# catch-up the controller predicted for them.
# First the 29 uploads (bench/device/put_part.sh, carry only the part), then, in the same lease:
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 580 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 \
  --min-requests 8 --rounds 5 --interleave 5 --time-budget-s 540 --plots --out-dir "$OUT" > "$OUT/pair.txt" 2>&1
sed -n '/^Output tokens/,/^adaptive: target/p' "$OUT/pair.txt"
tail -2 "$OUT/pair.txt"
