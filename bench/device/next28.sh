#!/usr/bin/env bash
# Eighteenth session: the current controller (c55b8f2: proposals priced at their depth, catch-ups per
# batch-size bucket) on both sweeps, and nvfp4 v6 with every default launch timed twice.
#   bash bench/device/next28.sh kernels   # 2 processes of kv_quant_gpu.py (~100 s; no model needed)
#   bash bench/device/next28.sh ngram8b   # the 8B n-gram sweep, every level, 256-token warm-up (~450 s)
#   (the 29 uploads: bench/device/put_part.sh, carry only the part)
#   bash bench/device/next28.sh pair      # the pair, 5 rounds, 256-token warm-up (~390 s)
# The seventeenth session ran the pair three times (5 rounds per point): 9 of 9 within 5% with a 256-token
# warm-up per point and the sixteenth session's controller; 8 of 9 and 7 of 9 with the 64-token one (the
# sixteenth's and the current controller). The misses at 4 came from drafting starts (catch-ups of 12-26
# ms) while the controller learned the load; the 8B n-gram sweep has not run with c55b8f2 yet.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  kernels)
    bash bench/device/next27.sh ;;
  ngram8b)
    timeout 560 python3 bench/controller_sweep.py --mode ngram8b --policies off,fixed,adaptive \
      --min-requests 8 --rounds 2 --interleave 2 --point-warmup-tokens 256 --time-budget-s 520 --plots \
      --out-dir "$OUT" > "$OUT/ngram8b.txt" 2>&1
    sed -n '/^Output tokens/,/^adaptive: target/p' "$OUT/ngram8b.txt"
    tail -2 "$OUT/ngram8b.txt" ;;
  pair)
    bash bench/device/next26.sh b ;;
  *)
    echo "usage: $0 kernels|ngram8b|pair" >&2; exit 2 ;;
esac
