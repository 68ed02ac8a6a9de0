#!/usr/bin/env bash
# Device call 2b (random weights), after 2a wrote the cold-tuned GEMV table (committed), under $OUT:
#   tests_b.txt: the GPU tests 2a's time limit cut (attention fused-reduce / CUDA graph, PDL);
#   skinny_bench.txt + NVIDIA_H200.json: the skinny GEMM vs cuBLAS vs the GEMV, cold weights (written);
#   offline_*.txt: gpu_offline decode with the new table, skinny on / off (SPECSERVE_SKINNY=0);
#   spec_profile.txt: a speculative step's cost (verify now on the skinny GEMM where it won).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pdl_gpu.py \
  "tests/gpu/test_triton_attention.py" -k "fused or split_with or cuda_graph or pdl or Pdl" > "$OUT/tests_b.txt" 2>&1
tail -n 2 "$OUT/tests_b.txt"
timeout 130 python3 bench/skinny_bench.py --shapes qwen1.5b-qkv,qwen1.5b-o,qwen1.5b-gate_up,qwen1.5b-down,qwen1.5b-lm_head,llama8b-o,llama8b-down \
  --ms 1,2,4,5,8 --budget-s 70 --write > "$OUT/skinny_bench.txt" 2>&1
grep -A12 "skinny best us" "$OUT/skinny_bench.txt"; grep "wrote" "$OUT/skinny_bench.txt"
cp specserve/model/layers/gemv_configs/NVIDIA_H200.json "$OUT/"
for sk in 1 0; do
  SPECSERVE_SKINNY=$sk timeout 100 python3 bench/gpu_offline.py --shapes qwen2.5-1.5b llama-3.1-8b \
    --parts floor decode --out "$OUT" > "$OUT/offline_skinny$sk.txt" 2>&1
  echo "skinny $sk:"; grep -o '"shape": "[^"]*"\|"b1_ms_per_step": [0-9.]*\|"b32_ms_per_step": [0-9.]*' "$OUT/offline_skinny$sk.txt"
done
timeout 100 python3 bench/spec_profile.py --configs none,draft_model,eagle3 --k 4 --out "$OUT" > "$OUT/spec_profile.txt" 2>&1
tail -n 8 "$OUT/spec_profile.txt"
