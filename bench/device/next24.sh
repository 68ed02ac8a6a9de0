#!/usr/bin/env bash
# Sixteenth session, issue 6: nvfp4 variants v5 (v4 with the score scale in exp2's fma and int32 cache
# offsets: 917 against 961 sm_90 instructions per 128-key tile) and v6 (v5 with the row sums from a dot
# with ones: 900 instructions, 6 barriers against 9). v6's GPU tests (v5's passed: 31 tests), then the
# kernel timings at 32k and 128k (every variant, bf16 in the same process), then 4k and 32k (bf16 at 32k took 1,167 us after 4k, 1,270-1,279 without).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 170 python3 -m pytest -q -x tests/gpu/test_triton_quant_kv.py tests/gpu/test_quant_kv_bounds.py -k "v6" \
  > "$OUT/tests_v6.txt" 2>&1
tail -3 "$OUT/tests_v6.txt"
timeout 170 python3 bench/kv_quant_gpu.py --contexts 32768,131072 --budget 140 > "$OUT/kvq1.txt" 2>&1
sed -n '/^Decode, default/,/^elapsed/p' "$OUT/kvq1.txt" | grep -v "^| fp8"
grep -E "FAIL|failed" "$OUT/kvq1.txt" | head -5
timeout 100 python3 bench/kv_quant_gpu.py --contexts 4096,32768 --budget 70 > "$OUT/kvq2.txt" 2>&1
grep -E "^\| 32 \| 32k|nvfp4 \| v[456] \|" "$OUT/kvq2.txt"
