#!/usr/bin/env bash
# Twentieth session, issue 7: the pair sweep again, with the nineteenth session's records and its one
# controller change (95b64b9: a plain step right after one with prompt chunks is no decode measurement),
# not yet run on the device. The nineteenth session found, with two waves per part (closed loop, replacement):
# 5 of 9 by Little's law; at 32 k = 0 priced at 4.76 ms by the controller's own decode fit (a decode step
# took 1.92); at 4 and 8 switches between k = 0 and k = 5-12, each paying a catch-up. The JSON now keeps
# each adaptive point's warm-up traces (where the controller met the load first), every step's prompt
# tokens, and where the decode price came from (`controller.decode_price`).
#   (the 29 uploads: bench/device/put_part.sh, carry only the part)
#   bash bench/device/next33.sh pair        # ~520 s
#   bash bench/device/next33.sh ngram8b     # the levels the nineteenth session left out: 2 and 256 (~250 s)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  pair)
    timeout 590 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 \
      --min-requests 8 --rounds 5 --interleave 5 --waves 2 --point-warmup-tokens 64 \
      --time-budget-s 560 --plots --out-dir "$OUT" > "$OUT/pair.txt" 2>&1
    sed -n '/^Output tokens/,/^TPOT/p' "$OUT/pair.txt"
    grep -E "compile during|slow run" "$OUT/pair.txt" | head -20
    tail -2 "$OUT/pair.txt" ;;
  ngram8b)
    timeout 330 python3 bench/controller_sweep.py --mode ngram8b --policies off,fixed,adaptive --concurrency 2,256 \
      --min-requests 8 --rounds 2 --interleave 2 --waves 2 --point-warmup-tokens 256 --time-budget-s 300 \
      --out-dir "$OUT" > "$OUT/ngram8b.txt" 2>&1
    sed -n '/^Output tokens/,/^TPOT/p' "$OUT/ngram8b.txt"
    tail -2 "$OUT/ngram8b.txt" ;;
  *)
    echo "usage: $0 pair|ngram8b" >&2; exit 2 ;;
esac
