#!/usr/bin/env bash
# Eighteenth session, issue 7: catch-up graphs for a draft model (runner/cuda_graph.py CATCH_UP_QUERY_LENS:
# catch-ups of up to 32 requests, each scoring its last row only). The seventeenth session's pair runs
# paid 12-26 ms per drafting start at 4 requests, eager forwards of the 0.5B draft.
#   bash bench/device/next29.sh catchup   # the GPU tests of graphs and drafts, then the catch-up forwards
#                                         # timed with and without the graphs (dummy weights, no upload)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
case "${1:-}" in
  catchup)
    timeout 220 python3 -m pytest -q --durations=5 tests/gpu/test_async_engine.py tests/gpu/test_warmup_gpu.py \
      tests/gpu/test_draft_chain_gpu.py > "$OUT/gpu_tests.txt" 2>&1
    tail -12 "$OUT/gpu_tests.txt"
    for on in 1 0; do
      mkdir -p "$OUT/graphs$on"
      SPECSERVE_CATCH_UP_GRAPHS=$on timeout 120 python3 bench/catch_up_probe.py --model qwen2.5-1.5b \
        --draft qwen2.5-0.5b --load-format dummy --batches 1,4,16,32 --contexts 300 --sizes 3,8,16,33,64 \
        --max-model-len 2048 --no-engine-runs --out "$OUT/graphs$on" > "$OUT/graphs$on/probe.txt" 2>&1
      echo "== SPECSERVE_CATCH_UP_GRAPHS=$on"; grep -E "^draft|engine built|Error|error" "$OUT/graphs$on/probe.txt"
    done ;;
  *)
    echo "usage: $0 catchup" >&2; exit 2 ;;
esac
