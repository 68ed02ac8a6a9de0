#!/usr/bin/env bash
# Tenth session, last call (~3.5 min, random weights, no uploads): drafts left on the device for the
# verify step (spec/draft_tokens.py DeferredDrafts) on the H200.
#   tests.txt: the GPU equivalence tests that draft through CUDA graphs (draft model, EAGLE heads);
#   spec_profile_d{1,0}*: ms per engine step at batch 1 with the drafts deferred (1, the default) and
#     read back in propose (0), back to back: the draft model at k = 8 and EAGLE-3 at k = 4.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_async_engine.py tests/gpu/test_eagle_graph_gpu.py \
  > "$OUT/tests.txt" 2>&1
tail -n 4 "$OUT/tests.txt"
for d in 1 0; do
  mkdir -p "$OUT/d$d"
  SPECSERVE_DEFER_DRAFTS=$d timeout 80 python3 bench/spec_profile.py --k 8 --steps 80 --configs none,draft_model \
    --out "$OUT/d$d" > "$OUT/d$d/k8.txt" 2>&1
  tail -n 3 "$OUT/d$d/k8.txt"
  mkdir -p "$OUT/d$d/e3"
  SPECSERVE_DEFER_DRAFTS=$d timeout 60 python3 bench/spec_profile.py --k 4 --steps 80 --configs eagle3 \
    --out "$OUT/d$d/e3" > "$OUT/d$d/e3/k4.txt" 2>&1
  tail -n 2 "$OUT/d$d/e3/k4.txt"
done
