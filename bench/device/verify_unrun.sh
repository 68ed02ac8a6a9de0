#!/usr/bin/env bash
# One device call (at most ~10 minutes, random weights, no uploads): the checks the fourth session could not
# run on the H200 (its device time ran out), in the order that matters if the call is cut short.
#   1. tests/gpu in full: GEMV + fusions (test_triton_ops), RoPE + KV write (test_triton_attention),
#      prefill graphs (test_async_engine), offload CUDA paths, EAGLE graphs;
#   2. bench/gpu_offline.py decode, GEMV on and off (SPECSERVE_GEMV_MAX_M=0) in the same call;
#   3. bench/tier_ttft.py with CUDA-graph engines (prefill graphs for the question after a hit);
#   4. bench/spec_profile.py (propose and rejection-sampler host costs).
# Usage: bash bench/device/verify_unrun.sh   (writes under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT/gemv_on" "$OUT/gemv_off"
timeout 170 python3 -m pytest -q tests/gpu -p no:cacheprovider -x 2>&1 | tail -15 | tee "$OUT/tests_gpu.txt"
timeout 120 python3 bench/gpu_offline.py --shapes qwen2.5-1.5b llama-3.1-8b --parts floor decode \
  --out "$OUT/gemv_on" 2>&1 | grep -v Warn | tail -6
SPECSERVE_GEMV_MAX_M=0 timeout 120 python3 bench/gpu_offline.py --shapes qwen2.5-1.5b llama-3.1-8b \
  --parts floor decode --out "$OUT/gemv_off" 2>&1 | grep -v Warn | tail -6
timeout 90 python3 bench/tier_ttft.py --model qwen2.5-1.5b --load-format dummy --json "$OUT/tier_ttft.json" 2>&1 | tail -10
timeout 90 python3 bench/spec_profile.py --out "$OUT" 2>&1 | tail -6
