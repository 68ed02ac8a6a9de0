#!/usr/bin/env bash
# First device call of the eighth session (~6 min, random weights, no uploads):
#   tests8.txt: the GPU kernel tests this session's calls cut short (test_triton_attention after
#     test_split_counters, fixed in c323423; test_triton_ops with the re-tuned M = 2/4/8 table) and the
#     start-up warm-up's check (test_warmup_gpu: no GEMV compile while serving small forwards);
#   train_v*.txt: the reduced-vocabulary training step in both orders. On 11-30 the 32k vocabulary ran
#     first and measured 1,035 ms per step against 563 ms for the full one, with less GPU time (218 vs 261
#     ms) and no host sync in its code (a CPU check found none): if the gap follows whichever runs first,
#     it was the fresh machine's first-use costs, not the reduced vocabulary.
# Then: the 26 uploads (put_part.sh) and, in the same lease,
#   python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --min-requests 8 --rounds 3 \
#     --time-budget-s 300 --plots --out-dir "$OUT"
# (the JSON's "controller" rows say why the adaptive controller chose its k; "steps_by_k" what the
# engine measured), and a head run that gives EAGLE-3 most of a call (the last one had 130 s of a
# 500 s call): bench/train_and_measure_gpu.sh with --gen-s 150 --eagle3-s 300 and a shorter --runs
# list (none, eagle3:2, eagle3:3, eagle3:4, draft_model:4), P-EAGLE in its own call.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_warmup_gpu.py tests/gpu/test_triton_attention.py \
  tests/gpu/test_triton_ops.py \
  > "$OUT/tests8.txt" 2>&1
tail -n 3 "$OUT/tests8.txt"
i=0
for v in 0 32768 0 32768; do
  i=$((i + 1))
  timeout 80 python3 bench/train_profile.py --shape qwen2.5-1.5b --method eagle3 --steps 16 --profile-steps 2 \
    -- --draft-vocab-size $v > "$OUT/train_v${v}_$i.txt" 2>&1
  echo "run $i, draft vocab $v:"; grep -E "per step|busy|host ms|allocator" "$OUT/train_v${v}_$i.txt"
done
