#!/usr/bin/env bash
# Eighth session, first device call (~8 min, random weights, no uploads):
#   tests_quant.txt: fp8 v3 (V read as 16-bit units, written 11-30 without a GPU) against the torch
#     oracle, its PTX decoder exhaustively, and every launch option the benchmark sweeps;
#   kv_quant.txt: bench/kv_quant_gpu.py, all variants (fp8 v3 new; nvfp4 v3 with 128-key tiles under
#     a 128-register cap new in the sweep), target shape B=32 / 32k first;
#   tests8.txt: the GPU tests the seventh session's calls cut short (bench/device/next8.sh's list);
#   train_v*.txt: the reduced-vocabulary training step, both orders (next8.sh's question).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_quant_kv.py -k "fp8-v3 or unit_decode" \
  > "$OUT/tests_quant.txt" 2>&1
tail -n 3 "$OUT/tests_quant.txt"
OUT=$OUT timeout 200 python3 bench/kv_quant_gpu.py --budget 150 > "$OUT/kv_quant.txt" 2>&1
sed -n '/^Decode, default/,$p' "$OUT/kv_quant.txt" | head -70
timeout 100 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_warmup_gpu.py tests/gpu/test_triton_attention.py \
  tests/gpu/test_triton_ops.py > "$OUT/tests8.txt" 2>&1
tail -n 3 "$OUT/tests8.txt"
i=0
for v in 32768 0; do
  i=$((i + 1))
  timeout 55 python3 bench/train_profile.py --shape qwen2.5-1.5b --method eagle3 --steps 12 --profile-steps 2 \
    -- --draft-vocab-size $v > "$OUT/train_v${v}_$i.txt" 2>&1
  echo "run $i, draft vocab $v:"; grep -E "per step|busy|host ms|allocator" "$OUT/train_v${v}_$i.txt"
done
