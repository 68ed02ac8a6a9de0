#!/usr/bin/env bash
# Seventeenth session, issue 7: the pair with more rounds per point, and the catch-up fit that keeps
# its range and prices unpaired cold proposals (386c3ac). The sixteenth session's pair (3 rounds) missed
# at 2, 4, 16, 128 and 256; at 128 / 256 no speculation's own runs spread by 15-40%, and one catch-up
# took 374 ms at 256. Its points took 164 s of the 530 s budget: 5 rounds fit. A slow proposal in the
# JSON ("slow_proposals") now has its batch size, the tokens the draft model had not seen and the
# catch-up the controller predicted for them.
# First the 29 uploads (bench/device/put_part.sh, carry only the part), then, in the same lease, one call
#   bash bench/device/next26.sh a   # 5 rounds, the usual 64-token point warm-up (comparable with before)
# and, if the budget allows, another
#   bash bench/device/next26.sh b   # the same with a 256-token warm-up per point
# At 2 and 4 the sixteenth session's trace showed the controller still learning the new load inside the
# measured part (20 steps at k = 12 then 6 at k = 0 at 2; ~20 steps of k = 11 per run at 4): (b) says
# how much of the gap a longer warm-up (every policy alike) removes, i.e. what steady state looks like.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
WARM=64
[ "${1:-a}" = b ] && WARM=256
timeout 580 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 \
  --min-requests 8 --rounds 5 --interleave 5 --point-warmup-tokens $WARM --time-budget-s 540 --plots \
  --out-dir "$OUT" > "$OUT/pair.txt" 2>&1
sed -n '/^Output tokens/,/^adaptive: target/p' "$OUT/pair.txt"
tail -2 "$OUT/pair.txt"
