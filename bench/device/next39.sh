#!/usr/bin/env bash
# Twenty-fourth session, issue 7. The controller now takes the smallest k priced within 2% of the fastest
# (AdaptiveSettings.prefer_fewer: on the twenty-third session's sweep it drafted k = 9-10 at 1-2 requests
# where 8 was best), explores no drafts from k = 0 while the batch fills (the 256-request explorations of
# a part's first steps), and prices catch-ups beyond its fits' data per token of the large ones measured.
#   (the 36 uploads first, as in next35.sh; every upload and the calls in ONE batch)
#   bash bench/device/next39.sh sweep        # the whole pair sweep, 1-256, in one call (as next38.sh sweep, ~560 s)
#   bash bench/device/next39.sh ngram LEVELS [BUDGET_S]   # the 8B n-gram sweep at LEVELS (no upload)
#   bash bench/device/next39.sh hostcost LEVELS ROUNDS     # spec_host_cost.py with step medians and sections (no upload)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  sweep)  # (next40.sh runs the pair sweep at any levels: these are this script's)
    exec bash bench/device/next40.sh sweep 1,2,4,8,16,32,64,128,256 540 5 ;;
  ngram)
    mkdir -p "$OUT/ng"
    budget=${3:-520}
    timeout $((budget + 40)) python3 bench/controller_sweep.py --mode ngram8b --policies off,fixed,adaptive \
      --concurrency "$2" --min-requests 8 --rounds 2 --interleave 2 --waves 2 --point-warmup-tokens 64 \
      --time-budget-s "$budget" --plots --out-dir "$OUT/ng" > "$OUT/ng.txt" 2>&1
    echo "== ngram8b: rc $?"
    sed -n '/^Output tokens/,/^TPOT/p' "$OUT/ng.txt"
    grep -E "compile during|slow run|setup|skipping" "$OUT/ng.txt" | head -12
    tail -2 "$OUT/ng.txt" ;;
  hostcost) exec bash bench/device/next40.sh hostcost "$2" "$3" ;;
  *) echo "usage: $0 sweep|ngram LEVELS [BUDGET_S]|hostcost LEVELS ROUNDS" >&2; exit 2 ;;
esac
