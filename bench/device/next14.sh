#!/usr/bin/env bash
# Eleventh session, first call (~2 min, random weights, no uploads): the tenth session's unmeasured code.
#   tests.txt: GPU equivalence tests that draft through CUDA graphs, now with deferred drafts (draft model,
#     EAGLE-3, P-EAGLE's graphed greedy picks) and the EAGLE head's start-up forwards;
#   spec_profile_*: ms per step at batch 1, drafts deferred (default) vs read back (SPECSERVE_DEFER_DRAFTS=0),
#     P-EAGLE k = 4 (deferred since cf9bdb1) and the draft model at k = 12.
# Then, in one lease, the 29 uploads (bench/device/next12.sh's header) and:
#   bash bench/train_and_measure_gpu.sh --phase train --total-s 575 --num-prompts 8192 --gen-s 150 \
#     --eagle3-s 290 --peagle-s 105            (0.276 s per EAGLE-3 step on 11-30 against 0.156 on the
#     eighth session's smaller data: print per-step times, e.g. --batch-tokens unchanged, to find why)
#   bash bench/train_and_measure_gpu.sh --phase measure --total-s 330 --hf-runs "" \
#     --runs eagle3:3,eagle3:4,p-eagle:4,draft_model:8,draft_model:10,draft_model:12
#     (is the first EAGLE run's stall gone? the draft model end to end with deferred drafts: 1.4x?)
#   python3 bench/controller_sweep.py --mode pair --concurrency 64,128,256 --policies off,adaptive \
#     --min-requests 8 --rounds 3 --interleave 3 --time-budget-s 200 --out-dir "$OUT"
#     (the 0.88 at 128 / 256 with nothing drafted: each part's "gc" pauses are in the JSON now, and the
#     heap is frozen after setup; --no-gc-freeze for the old condition)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_async_engine.py tests/gpu/test_eagle_graph_gpu.py tests/gpu/test_warmup_gpu.py \
  > "$OUT/tests.txt" 2>&1
tail -n 4 "$OUT/tests.txt"
for d in 1 0; do
  mkdir -p "$OUT/d$d/pe" "$OUT/d$d/k12"
  SPECSERVE_DEFER_DRAFTS=$d timeout 60 python3 bench/spec_profile.py --k 4 --steps 80 --configs p-eagle \
    --out "$OUT/d$d/pe" > "$OUT/d$d/pe/k4.txt" 2>&1
  tail -n 2 "$OUT/d$d/pe/k4.txt"
  SPECSERVE_DEFER_DRAFTS=$d timeout 80 python3 bench/spec_profile.py --k 12 --steps 60 --configs none,draft_model \
    --out "$OUT/d$d/k12" > "$OUT/d$d/k12/k12.txt" 2>&1
  tail -n 3 "$OUT/d$d/k12/k12.txt"
done
