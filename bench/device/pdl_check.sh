#!/usr/bin/env bash
# One device call (~4 minutes, random weights, no uploads): programmatic dependent launch
# (specserve/model/layers/pdl.py) and the GEMV's weight prefetch, checked and measured.
#   0. bench/gemv_tune.py for the LM heads (1.5B, 0.5B, 8B vocab x hidden), merged into this GPU's
#      table (--write --merge; $OUT gets the new table to commit), so the head's GEMV-or-cuBLAS
#      choice is measured before anything below runs;
#   1. the GPU tests of every kernel PDL touches (PDL on, the default) and the PDL-vs-plain
#      equality test (tests/gpu/test_pdl_gpu.py);
#   2. bench/gpu_offline.py decode with SPECSERVE_PDL=1, then 0, then 1 again (same call: the
#      repeat shows the run-to-run noise);
#   3. bench/spec_profile.py and bench/tier_ttft.py with the defaults; bench/disk_tier_io.py with
#      4 and 16 reader threads.
# Usage: bash bench/device/pdl_check.sh   (writes under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT="${OUT:-/tmp/out}"
timeout 150 python3 bench/gemv_tune.py --shapes '' --nk 151936x1536,151936x896,128256x4096 --ms 1,2,4 \
  --write --merge 2>&1 | grep -v Warn | tail -12
timeout 240 python3 -m pytest -q -p no:cacheprovider --durations=6 tests/gpu/test_pdl_gpu.py \
  tests/gpu/test_triton_ops.py tests/gpu/test_triton_attention.py tests/gpu/test_async_engine.py \
  tests/gpu/test_eagle_graph_gpu.py tests/gpu/test_offload_cuda.py 2>&1 | tail -16 | tee "$OUT/tests_gpu.txt"
for run in pdl1 nopdl pdl1b; do
  mkdir -p "$OUT/$run"
  flag=1; [ "$run" = nopdl ] && flag=0
  SPECSERVE_PDL=$flag timeout 120 python3 bench/gpu_offline.py --shapes qwen2.5-1.5b llama-3.1-8b \
    --parts floor decode --out "$OUT/$run" 2>&1 | grep -E "^(qwen|llama)" | sed "s/^/$run /"
done
timeout 90 python3 bench/spec_profile.py --out "$OUT" 2>&1 | tail -6
timeout 90 python3 bench/tier_ttft.py --model qwen2.5-1.5b --load-format dummy --json "$OUT/tier_ttft.json" 2>&1 | tail -9
for r in 4 16; do
  echo "disk_tier_io --readers $r"; timeout 45 python3 bench/disk_tier_io.py --readers "$r" --repeats 3 2>&1 | tail -4
done
