#!/usr/bin/env bash
# Twelfth session, call 4 (~3 min, random weights): skinny entries for the 0.5B draft's shapes (its q = 2
# catch-up and q = 16 prefill pieces), the GPU tests with the new table, the draft model's step with / without.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 60 python3 bench/skinny_bench.py --shapes qwen0.5b-qkv,qwen0.5b-o,qwen0.5b-gate_up,qwen0.5b-down,qwen0.5b-lm_head \
  --ms 2,16 --budget-s 40 --write > "$OUT/skinny05.txt" 2>&1
grep -v -i warn "$OUT/skinny05.txt" | tail -n 9
cp specserve/model/layers/gemv_configs/NVIDIA_H200.json "$OUT/"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_skinny.py tests/gpu/test_async_engine.py \
  > "$OUT/tests.txt" 2>&1
tail -n 3 "$OUT/tests.txt"
for s in 1 0; do
  mkdir -p "$OUT/s$s"
  SPECSERVE_SKINNY=$s timeout 60 python3 bench/spec_profile.py --k 12 --steps 60 --configs draft_model \
    --out "$OUT/s$s" > "$OUT/s$s/dm.txt" 2>&1
  echo "skinny=$s"; grep -E "^draft_model " "$OUT/s$s/dm.txt" | tail -n 1
done
