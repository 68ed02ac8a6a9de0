#!/usr/bin/env bash
# Twenty-third session, issue 7. The twenty-second session's second sweep lost at 64 and 256 (0.89 and 0.81 of
# no speculation) while the adaptive policy drafted in 4-5 of ~1,300 steps; its plain steps were slower than
# no speculation's. "k=0" (bench/sweep_policy.py) is the speculative engine that never drafts and runs no
# controller: against "off" it prices carrying the proposer, against "adaptive" the controller's own work
# (host time per step, explorations and their catch-ups).
#   (the 36 uploads first, as in next35.sh; every upload and the calls in ONE batch)
#   bash bench/device/next38.sh diag    # mixed_graph_check.py (on, off, on), then off / k=0 / k=12 / adaptive at 64 and 256 (~330 s)
#   bash bench/device/next38.sh sweep   # the whole pair sweep, 1-256, in one call (~540 s)
#   bash bench/device/next38.sh hostcost [LIMIT_S]  # bench/spec_host_cost.py on the dummy 1.5B / 0.5B shapes (no upload)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  diag)
    timeout 260 python3 bench/mixed_graph_check.py --out "$OUT" > "$OUT/mixed_check.txt" 2>&1
    echo "== mixed_graph_check: rc $?"; tail -14 "$OUT/mixed_check.txt"
    mkdir -p "$OUT/diag"
    timeout 330 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 0,12 \
      --concurrency 64,256 --min-requests 8 --rounds 5 --interleave 5 --waves 2 \
      --point-warmup-tokens 64 --time-budget-s 300 --out-dir "$OUT/diag" > "$OUT/diag.txt" 2>&1
    echo "== diag sweep: rc $?"
    sed -n '/^Output tokens/,/^TPOT/p' "$OUT/diag.txt"
    grep -E "compile during|slow run|setup|skipping" "$OUT/diag.txt" | head -12
    tail -2 "$OUT/diag.txt" ;;
  sweep)
    mkdir -p "$OUT/all"
    timeout 570 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 \
      --concurrency 1,2,4,8,16,32,64,128,256 --min-requests 8 --rounds 5 --interleave 5 --waves 2 \
      --point-warmup-tokens 64 --time-budget-s 540 --plots --out-dir "$OUT/all" > "$OUT/all.txt" 2>&1
    echo "== sweep: rc $?"
    sed -n '/^Output tokens/,/^TPOT/p' "$OUT/all.txt"
    grep -E "compile during|slow run|setup|skipping" "$OUT/all.txt" | head -12
    tail -2 "$OUT/all.txt" ;;
  hostcost)
    timeout "${2:-170}" python3 bench/spec_host_cost.py --levels 64,256 --rounds 3 --out "$OUT" > "$OUT/hostcost.txt" 2>&1
    echo "== spec_host_cost: rc $?"; grep -vE "Warning|warn" "$OUT/hostcost.txt" | tail -22 ;;
  *) echo "usage: $0 diag|sweep|hostcost" >&2; exit 2 ;;
esac
