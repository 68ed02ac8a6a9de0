#!/usr/bin/env bash
# Ninth session, first device call (~5 min, random weights, no uploads):
#   tests_q.txt: the quantized-KV GPU tests the eighth session's 100 s limit cut (the exhaustive nvfp4
#     decoder test for v2 / v3, the odd-head-count tests), then the
#     rest of test_triton_attention / test_triton_ops (bench/device/next8.sh's list: the warm-up test
#     passed on 11-30, the split counters' fixed assertion has not run on a GPU yet);
#   kv_quant.txt: the kernels again (fp8 v3 0.50x and nvfp4 v3 0.51x of bf16 at B=32 / 32k on 11-30).
# Then, in one lease (26 uploads with put_part.sh, carrying only the part: the tree plus .whl is at the
# 64 MiB limit with a part), the controller with the prompt-feed fix (688705e), first on the GPU:
#   python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --min-requests 8 --rounds 3 --interleave 3 \
#     --time-budget-s 300 --plots --out-dir "$OUT"
#   python3 bench/controller_sweep.py --mode ngram8b --policies off,fixed,adaptive --min-requests 8 --rounds 2 --interleave 2 \
#     --time-budget-s 330 --plots --out-dir "$OUT"
# and a head run with ~2.5x the self-distilled data (11-30: 818k answer tokens seen 18 times):
#   bash bench/train_and_measure_gpu.sh --total-s 560 --num-prompts 8192 --gen-s 130 --eagle3-s 230 \
#     --peagle-s 60 --measure-s 110 --runs eagle3:3,eagle3:4,p-eagle:4,draft_model:4 --hf-runs ""
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_quant_kv.py \
  -k "decoders or odd_kv_head" > "$OUT/tests_q.txt" 2>&1
tail -n 3 "$OUT/tests_q.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py tests/gpu/test_triton_ops.py \
  --deselect tests/gpu/test_triton_attention.py::test_mixed_batch >> "$OUT/tests_q.txt" 2>&1
tail -n 3 "$OUT/tests_q.txt"
OUT=$OUT timeout 120 python3 bench/kv_quant_gpu.py --budget 90 > "$OUT/kv_quant.txt" 2>&1
sed -n '/^Best launch/,/^Sweep/p' "$OUT/kv_quant.txt"
