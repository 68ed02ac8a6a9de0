#!/usr/bin/env bash
# Twelfth session, call 3 (~5 min, random weights): the skinny tensor-core GEMM for the verify forward.
# verify_cost (call 2) showed a q = 13 verify at 1.53x a decode step with its linears in cuBLAS (no PDL, norms
# and silu unfused, a split-K reduce launch); this tunes skinny entries for the 1.5B / 0.5B shapes at
# M = 2..16 (--write), then times the verify graphs and the speculative step with and without them.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 170 python3 bench/skinny_bench.py --shapes qwen1.5b-qkv,qwen1.5b-o,qwen1.5b-gate_up,qwen1.5b-down,qwen1.5b-lm_head \
  --ms 2,4,8,16 --budget-s 110 --write > "$OUT/skinny.txt" 2>&1
grep -v -i warn "$OUT/skinny.txt" | tail -n 30
cp specserve/model/layers/gemv_configs/NVIDIA_H200.json "$OUT/"
for s in 1 0; do
  mkdir -p "$OUT/skinny$s"
  SPECSERVE_SKINNY=$s OUT="$OUT/skinny$s" timeout 90 python3 bench/verify_cost.py --k 12 --context 400 --batch-sizes 1 \
    > "$OUT/skinny$s/verify.txt" 2>&1
  echo "skinny=$s"; grep -E "^target|^draft" "$OUT/skinny$s/verify.txt" | tr -s ' ' | tr '\n' ';'; echo
done
for s in 1 0; do
  SPECSERVE_SKINNY=$s timeout 80 python3 bench/spec_profile.py --k 12 --steps 60 --configs none,draft_model \
    --out "$OUT/skinny$s" > "$OUT/skinny$s/dm.txt" 2>&1
  SPECSERVE_SKINNY=$s timeout 80 python3 bench/spec_profile.py --k 4 --steps 60 --configs eagle3 \
    --out "$OUT/skinny$s" > "$OUT/skinny$s/e3.txt" 2>&1
  echo "skinny=$s"; grep -E "^(none|draft_model|eagle3) " "$OUT/skinny$s/dm.txt" "$OUT/skinny$s/e3.txt"
done
