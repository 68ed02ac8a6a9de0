#!/usr/bin/env bash
# Thirteenth session, first call (~4 min, random weights, no uploads; carry .whl):
#   tests.txt: EAGLE engines prefilling in pieces (tests/gpu/test_async_engine.py: the 172-token prompt's pieces
#     replay graphs with the plain tokens; tests/gpu/test_warmup_gpu.py: an EAGLE-3 engine's first requests,
#     pieces and absorb forwards included, compile nothing after start-up), the graphed EAGLE paths;
#   spec_kernels.txt: where an EAGLE-3 k = 4 step's ~2.7 ms of GPU time goes (bench/spec_profile.py --kernels; its
#     random heads now have train-draft's 32,768-token draft vocabulary, then once the whole one as before), and
#     the draft model's at k = 12, with the skinny table (d8b80b5);
#   verify.txt: the verify graphs' kernels with the skinny table (bench/verify_cost.py);
#   split*/: batch-1 decode (1.5B, 128 + 256 tokens) with max_model_len 4096 and 32768, split-KV by each
#     sequence's length (SPECSERVE_ATTN_SPLIT_BY_LENGTH, on by default when this was written) against all of
#     the graph's splits (=0): a graph sized for 32k spread a 400-token context over up to 128 splits.
# Then, in one lease, the 29 uploads (bench/device/next12.sh's header; carry only the part) and:
#   bash bench/train_and_measure_gpu.sh --phase train --total-s 575 --num-prompts 8192 --gen-s 150 \
#     --eagle3-s 290 --peagle-s 105 --quiet                                    (carry .whl)
#   bash bench/train_and_measure_gpu.sh --phase measure --total-s 420 --quiet \
#     --runs eagle3:3,eagle3:4,eagle3:5,eagle3:4:skinny0,eagle3:4:pieces0,p-eagle:4,draft_model:10,draft_model:12,\
#       draft_model:14,draft_model:12:skinny0
#     (the skinny table and EAGLE's pieces A/B'd on the real pair in one process; transformers runs last,
#     at its default --hf-runs, for the >= 3x comparison)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_async_engine.py tests/gpu/test_warmup_gpu.py \
  tests/gpu/test_eagle_graph_gpu.py > "$OUT/tests.txt" 2>&1
tail -n 4 "$OUT/tests.txt"
timeout 120 python3 bench/spec_profile.py --k 4 --steps 60 --configs none,eagle3 --kernels 25 --out "$OUT" \
  > "$OUT/spec_kernels.txt" 2>&1
timeout 100 python3 bench/spec_profile.py --k 4 --steps 60 --configs eagle3 --draft-vocab 0 --out "$OUT" \
  >> "$OUT/spec_kernels.txt" 2>&1  # the twelfth session's random heads had the whole vocabulary
timeout 100 python3 bench/spec_profile.py --k 12 --steps 40 --configs draft_model --kernels 20 --out "$OUT" \
  >> "$OUT/spec_kernels.txt" 2>&1
grep -v -i warn "$OUT/spec_kernels.txt" | tail -n 60
OUT=$OUT timeout 100 python3 bench/verify_cost.py --k 12 --context 400 --batch-sizes 1 > "$OUT/verify.txt" 2>&1
grep -v -i warn "$OUT/verify.txt" | tail -n 40
for m in 32768 4096; do
  for s in 1 0; do
    mkdir -p "$OUT/split$s/m$m"
    SPECSERVE_ATTN_SPLIT_BY_LENGTH=$s OUT="$OUT/split$s/m$m" timeout 100 python3 bench/gpu_offline.py \
      --shapes qwen2.5-1.5b --parts decode --max-model-len $m > "$OUT/split$s/m$m/out.txt" 2>&1
    echo "split_by_length=$s max_model_len=$m: $(grep -o '"b1_ms_per_step": [0-9.]*' "$OUT/split$s/m$m"/*.json | head -1)"
  done
done
