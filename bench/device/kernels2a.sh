#!/usr/bin/env bash
# Device call 2a (random weights, no uploads), results under $OUT:
#   tests.txt: the GPU kernel tests (GEMV single tile + fused norm, skinny GEMM, attention with the
#     fused split-KV reduce, PDL);
#   offline_before.json: gpu_offline decode with the committed GEMV table (fused reduce on / off);
#   train_eagle3.txt: a train-draft step's wall time, tokens/s and GPU-busy share;
#   gemv_tune_m1.txt + NVIDIA_H200.json: the GEMV re-tuned at M=1 with cold weights (written).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_ops.py tests/gpu/test_triton_skinny.py \
  tests/gpu/test_triton_attention.py tests/gpu/test_pdl_gpu.py > "$OUT/tests.txt" 2>&1
tail -n 4 "$OUT/tests.txt"
for reduce in 1 0; do
  SPECSERVE_ATTN_FUSED_REDUCE=$reduce timeout 100 python3 bench/gpu_offline.py --shapes qwen2.5-1.5b llama-3.1-8b \
    --parts floor decode --out "$OUT/before_r$reduce" > "$OUT/offline_before_r$reduce.txt" 2>&1
  echo "fused reduce $reduce:"; grep -E "^(qwen2.5-1.5b|llama-3.1-8b)" "$OUT/offline_before_r$reduce.txt" | head -4
done
timeout 100 python3 bench/train_profile.py --shape qwen2.5-1.5b --method eagle3 --steps 8 --profile-steps 2 \
  > "$OUT/train_eagle3.txt" 2>&1
grep -E "per step|tokens|busy" "$OUT/train_eagle3.txt" | head -5
timeout 230 python3 bench/gemv_tune.py --shapes qwen2.5-1.5b,llama-3.1-8b,qwen2.5-0.5b --ms 1 --write --merge \
  > "$OUT/gemv_tune_m1.txt" 2>&1
grep -E "candidates|tuned in|norm\+|wrote" "$OUT/gemv_tune_m1.txt" | head -20
cp specserve/model/layers/gemv_configs/NVIDIA_H200.json "$OUT/"
