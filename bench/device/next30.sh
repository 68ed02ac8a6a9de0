#!/usr/bin/env bash
# Nineteenth session, issue 7: the pair with the draft's catch-up graphs (659cf07), the whole sweep. The
# eighteenth session ran one point with them (concurrency 4, 64-token warm-up: 0.972 of fixed k = 4,
# against 0.90-0.94 before) and timed catch-up forwards of 4-32 requests at 1.2-4.3 ms against 9-12 eager.
# Its engine builds took 26-33 s with the graphs and 4-5 s without, but the graphs' process always ran
# first on a fresh machine (cold caches): `buildtime` runs the other order, twice. The sweep now prints a
# line for each run 1.15x its point's median or slower, with its slowest steps (4a9e207): the eighteenth
# session's slow runs (256: 0.90 and 1.16 s against ~0.75, the controller at k = 0 throughout; TTFT and TPOT
# both ~50% up) were not explained. The policies' order now changes every round (5289b0f, a Williams design).
#   bash bench/device/next30.sh buildtime   # no model needed (~90 s)
#   (the 29 uploads: bench/device/put_part.sh, carry only the part)
#   bash bench/device/next30.sh pair        # the pair, 5 rounds, 64-token warm-up (~450 s)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  buildtime)
    for on in 0 1 0 1; do
      echo "== SPECSERVE_CATCH_UP_GRAPHS=$on"
      SPECSERVE_CATCH_UP_GRAPHS=$on timeout 100 python3 bench/catch_up_probe.py --model qwen2.5-1.5b \
        --draft qwen2.5-0.5b --load-format dummy --batches 4,16 --contexts 300 --sizes 3,16 \
        --max-model-len 2048 --no-engine-runs --out /tmp | grep -E "built|^draft"
    done ;;
  pair)
    timeout 580 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 \
      --min-requests 8 --rounds 5 --interleave 5 --point-warmup-tokens 64 --time-budget-s 540 --plots \
      --out-dir "$OUT" > "$OUT/pair.txt" 2>&1
    sed -n '/^Output tokens/,/^adaptive: target/p' "$OUT/pair.txt"
    tail -2 "$OUT/pair.txt" ;;
  *)
    echo "usage: $0 buildtime|pair" >&2; exit 2 ;;
esac
