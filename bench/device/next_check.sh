#!/usr/bin/env bash
# Device call for what the sixth session built without the H200 (random weights, no uploads), ~8 min:
#   tests_next.txt: the GPU tests of the new code (qkv GEMV + RoPE + KV write epilogue, metadata read
#     before the PDL wait, reduced-vocabulary EAGLE heads in CUDA graphs, PDL bitwise check);
#   offline_qkvrope{0,1}.txt: gpu_offline decode, SPECSERVE_QKV_ROPE_FUSED off / on (flip the
#     default in envs.qkv_rope_fused if "on" is faster and the tests passed);
#   train_v{32768,0}.txt: a train-draft step with the 32k draft vocabulary (default) and the full one.
# Then, in a second call: bench/gemv_tune.py --ms 1,2,4,8 --write --merge --nk 32768x1536: cold tiles
# for decode and verify k <= 7 (the M=2 / M=4 entries are still the warm-L2 ones; M=8 has none, so 5-8
# rows run cuBLAS until it has), per shape whether the early weight loads pay (the table's `prefetch`
# entries), and the reduced draft LM head; then bench/gpu_offline.py and bench/spec_profile.py again.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_qkv_rope.py tests/gpu/test_pdl_gpu.py \
  tests/gpu/test_eagle_graph_gpu.py tests/gpu/test_triton_attention.py > "$OUT/tests_next.txt" 2>&1
tail -n 5 "$OUT/tests_next.txt"
SPECSERVE_QKV_ROPE_FUSED=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/integration/test_equivalence.py \
  -k "qkv_rope or same_greedy" 2>&1 | tail -n 2
for f in 0 1; do
  SPECSERVE_QKV_ROPE_FUSED=$f timeout 100 python3 bench/gpu_offline.py --shapes qwen2.5-1.5b llama-3.1-8b \
    --parts floor decode --out "$OUT" > "$OUT/offline_qkvrope$f.txt" 2>&1
  echo "qkv rope fused $f:"; grep -o '"shape": "[^"]*"\|"floor_ms": [0-9.]*\|"b1_ms_per_step": [0-9.]*' "$OUT/offline_qkvrope$f.txt"
done
for v in 32768 0; do
  timeout 100 python3 bench/train_profile.py --shape qwen2.5-1.5b --method eagle3 --steps 10 --profile-steps 2 \
    -- --draft-vocab-size $v > "$OUT/train_v$v.txt" 2>&1
  grep -E "per step|busy" "$OUT/train_v$v.txt"
done
