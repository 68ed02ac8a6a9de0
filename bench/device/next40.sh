#!/usr/bin/env bash
# Twenty-fifth session, issue 7. The controller's host time per step at k = 0 (a fit's add judges by the
# theta it has instead of re-solving; on this machine's CPU choose + observe went from ~40-65 to ~32 us
# a step at 128 requests), and the fill rule remembers growth (a batch that grew within 4 choices fills).
#   bash bench/device/next40.sh hostcost LEVELS ROUNDS     # spec_host_cost.py (no upload)
#   (the 36 uploads, as in next35.sh; every upload and the sweep in ONE batch)
#   bash bench/device/next40.sh sweep LEVELS BUDGET_S [ROUNDS]  # the pair sweep at LEVELS, next39.sh's settings
# Twenty-sixth session: the whole sweep in one call (next39.sh sweep) ran out of its 570 s at 256 (setup took
# 181 s, 142 s in the next machine; the points ~400 s). Split it over two calls, each with its own setup:
#   bash bench/device/next40.sh sweep 1,2,4,8,16 330 5      # ~310 s
#   bash bench/device/next40.sh sweep 32,64,128,256 540 5   # ~450 s
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  hostcost)
    timeout 300 python3 bench/spec_host_cost.py --levels "$2" --rounds "$3" --out "$OUT" > "$OUT/hostcost.txt" 2>&1
    echo "== spec_host_cost: rc $?"; grep -vE "Warning|warn" "$OUT/hostcost.txt" | tail -40 ;;
  sweep)
    mkdir -p "$OUT/all"
    budget=${3:-300} rounds=${4:-5}
    timeout $((budget + 30)) python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 \
      --concurrency "$2" --min-requests 8 --rounds "$rounds" --interleave "$rounds" --waves 2 \
      --point-warmup-tokens 64 --time-budget-s "$budget" --plots --out-dir "$OUT/all" > "$OUT/all.txt" 2>&1
    echo "== sweep: rc $?"
    sed -n '/^Output tokens/,/^TPOT/p' "$OUT/all.txt"
    grep -E "compile during|slow run|setup|skipping" "$OUT/all.txt" | head -12
    tail -2 "$OUT/all.txt" ;;
  *) echo "usage: $0 hostcost LEVELS ROUNDS | sweep LEVELS BUDGET_S [ROUNDS]" >&2; exit 2 ;;
esac
