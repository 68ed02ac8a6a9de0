#!/usr/bin/env bash
# Twelfth session, first call (~3 min, random weights, no uploads; carry .whl):
#   tests.txt: GPU tests of this session's unmeasured code: prefill-graph pieces for short prompts
#     (tests/gpu/test_async_engine.py test_short_prompts_prefill_in_graph_pieces), the EAGLE start-up
#     compile test, the graphed EAGLE paths, the draft chain graph (tests/gpu/test_draft_chain_gpu.py);
#   ttft.txt: bench/ttft_short.py, TTFT of one prompt of 32-400 tokens with pieces on / off (1.5B shape);
#   train_profile.txt: where a head-training step's ~0.31 s of GPU time goes (bench/train_profile.py);
#   chain*/: the draft model's chained steps as one CUDA graph (SPECSERVE_DRAFT_CHAIN_GRAPH, off by
#     default until this A/B) against per-step replays, k = 12 and 8, ms per step (random weights).
# Then, in one lease, the 29 uploads (bench/device/next12.sh's header; carry only the part) and:
#   bash bench/train_and_measure_gpu.sh --phase train --total-s 575 --num-prompts 8192 --gen-s 150 \
#     --eagle3-s 290 --peagle-s 105 --quiet                                    (carry .whl)
#   bash bench/train_and_measure_gpu.sh --phase measure --total-s 330 --hf-runs "" --quiet \
#     --runs eagle3:3,eagle3:4,eagle3:4:defer0,p-eagle:4,p-eagle:4:defer1,draft_model:8,draft_model:12,\
#       draft_model:12:defer0,draft_model:12:chain1,draft_model:8:chain1,draft_model:12:pieces0
#     (the deferral A/B on the real pair in one process; the TTFT and decode-rate columns place the
#     ~25 ms per-request fixed cost; pieces now cut the target's prefill of these ~172-token prompts)
#   python3 bench/controller_sweep.py --mode pair --concurrency 1,2,4,128 --policies off,fixed,adaptive --ks 4 \
#     --min-requests 8 --rounds 4 --interleave 3 --time-budget-s 240 --out-dir "$OUT"
#     (concurrency 1-2 now prefill in pieces; 128 with more parts per point)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_async_engine.py tests/gpu/test_warmup_gpu.py \
  tests/gpu/test_eagle_graph_gpu.py tests/gpu/test_draft_chain_gpu.py > "$OUT/tests.txt" 2>&1
tail -n 4 "$OUT/tests.txt"
timeout 120 python3 bench/ttft_short.py --out "$OUT/ttft.json" > "$OUT/ttft.txt" 2>&1
grep -v Warn "$OUT/ttft.txt" | tail -n 7
timeout 150 python3 bench/train_profile.py --shape qwen2.5-1.5b --method eagle3 --steps 12 --profile-steps 2 \
  > "$OUT/train_profile.txt" 2>&1
grep -E "per step|GPU time" "$OUT/train_profile.txt" | tail -n 4
for c in 1 0; do
  for k in 12 8; do
    mkdir -p "$OUT/chain$c/k$k"
    SPECSERVE_DRAFT_CHAIN_GRAPH=$c timeout 80 python3 bench/spec_profile.py --k $k --steps 60 --configs draft_model \
      --out "$OUT/chain$c/k$k" > "$OUT/chain$c/k$k/out.txt" 2>&1
    echo "chain=$c k=$k"; grep -E "^draft_model " "$OUT/chain$c/k$k/out.txt" | tail -n 1
  done
done
