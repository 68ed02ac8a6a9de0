#!/usr/bin/env bash
# Nineteenth session, issue 7: the pair sweep with the steady window. The session's first pair sweep
# (next30.sh, catch-up graphs, one wave of c requests per part) met the target at 4 of 9 levels: at
# concurrency 16 the adaptive policy's last requests ran nearly alone for ~25% of its time (the drain of
# a wave: under speculation requests advance at different paces), at 3 tok/ms against 9.8 while c ran.
# Now each part runs two waves in a closed loop and throughput counts its steady window (first to last
# submission, c in flight throughout): bench/sweep_point.steady_window.
#   (the 29 uploads: bench/device/put_part.sh, carry only the part)
#   bash bench/device/next31.sh pair        # ~480 s
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  pair)
    timeout 590 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 \
      --min-requests 8 --rounds 5 --interleave 5 --waves 2 --window steady --point-warmup-tokens 64 \
      --time-budget-s 560 --plots --out-dir "$OUT" > "$OUT/pair.txt" 2>&1
    sed -n '/^Output tokens/,/^adaptive: target/p' "$OUT/pair.txt"
    grep -E "compile during|slow run" "$OUT/pair.txt" | head -20
    tail -2 "$OUT/pair.txt" ;;
  *)
    echo "usage: $0 pair" >&2; exit 2 ;;
esac
