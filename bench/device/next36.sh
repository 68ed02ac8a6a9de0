#!/usr/bin/env bash
# Twenty-second session, issue 7: mixed CUDA graphs (runner/cuda_graph.py MIXED_TOKEN_LENS). This session's
# first sweep (code of 8347ffb, next35.sh) met the target at 5 of 9 levels by the window; at 32 the adaptive
# policy drafted at 0.17 tokens per step on average and still lost 11% to no speculation: its first part's
# early drafting left requests finishing at different steps, and each arrival then cost one eager step of
# the whole batch (~13 ms against ~1.7 ms for a decode step). Mixed graphs replay those steps instead.
#   (the 36 uploads first, as in next35.sh; every upload and both calls in ONE batch)
#   bash bench/device/next36.sh tests   # GPU tests of the graphs + bench/mixed_graph_check.py, on, off, on (~300 s)
#   bash bench/device/next36.sh sweep   # the whole pair sweep, 1-256, in one call (~500 s)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  tests)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mixed_graphs_gpu.py \
      tests/gpu/test_async_engine.py tests/gpu/test_prefill_apart_gpu.py > "$OUT/tests.txt" 2>&1
    echo "== GPU tests: rc $?"; tail -15 "$OUT/tests.txt"
    timeout 260 python3 bench/mixed_graph_check.py --out "$OUT" > "$OUT/mixed_check.txt" 2>&1
    echo "== mixed_graph_check: rc $?"; tail -12 "$OUT/mixed_check.txt" ;;
  sweep)
    mkdir -p "$OUT/all"
    timeout 570 python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --ks 4,8,12 \
      --concurrency 1,2,4,8,16,32,64,128,256 --min-requests 8 --rounds 5 --interleave 5 --waves 2 \
      --point-warmup-tokens 64 --time-budget-s 540 --plots --out-dir "$OUT/all" > "$OUT/all.txt" 2>&1
    echo "== sweep: rc $?"
    sed -n '/^Output tokens/,/^TPOT/p' "$OUT/all.txt"
    grep -E "compile during|slow run|setup|skipping" "$OUT/all.txt" | head -12
    tail -2 "$OUT/all.txt" ;;
  *) echo "usage: $0 tests|sweep" >&2; exit 2 ;;
esac
