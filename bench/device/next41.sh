#!/usr/bin/env bash
# Twenty-seventh session, issue 7. The pair sweep with spread output lengths (controller_sweep
# --output-len-spread 0.5: each request's length uniform in [L/2, 3L/2], the same for every policy). With one
# length for all, parts of identical work without speculation ran at 17-31k tokens/s at 256 requests and
# 23-28k at 128. With the spread (this script's run, 4 rounds) they ran at 26-38k and 27-34k: no steadier.
#   (the 36 uploads, as in next35.sh; every upload and both calls in ONE batch)
#   bash bench/device/next41.sh sweep 1,2,4,8,16 330 4       # ~270 s
#   bash bench/device/next41.sh sweep 32,64,128,256 540 4    # ~320 s
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  sweep)
    mkdir -p "$OUT/all"
    budget=${3:-300} rounds=${4:-4}
    timeout $((budget + 30)) python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 \
      --concurrency "$2" --min-requests 8 --rounds "$rounds" --interleave "$rounds" --waves 2 \
      --output-len-spread 0.5 --point-warmup-tokens 64 --time-budget-s "$budget" --plots --out-dir "$OUT/all" \
      > "$OUT/all.txt" 2>&1
    echo "== sweep: rc $?"
    sed -n '/^Output tokens/,/^TPOT/p' "$OUT/all.txt"
    grep -E "compile during|slow run|setup|skipping" "$OUT/all.txt" | head -12
    tail -2 "$OUT/all.txt" ;;
  *) echo "usage: $0 sweep LEVELS BUDGET_S [ROUNDS]" >&2; exit 2 ;;
esac
