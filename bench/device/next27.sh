#!/usr/bin/env bash
# Seventeenth session, issue 6: nvfp4 v6 against bf16 with the bench's new protocol (afe77a2: bf16 timed
# first and again last at every shape, each on a cache of its own; ratios to the faster). The sixteenth
# session saw bf16 at B = 32 / 32k take 1,276-1,281 us in processes whose correctness check ran at 32k
# and 1,164-1,169 in the others. Two processes: one whose check runs at 4k, one whose check runs at 32k.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
# Arguments: the processes' --contexts (default both orders).
for ctx in ${@:-4096,32768,131072 32768,131072}; do
  dir="$OUT/p${ctx%%,*}"
  mkdir -p "$dir"
  OUT="$dir" timeout 175 python3 bench/kv_quant_gpu.py --contexts $ctx --budget 145 > "$dir/kvq.txt" 2>&1
  grep -E "ratios are to|(bf16  -|nvfp4 v[46]|fp8   v3) +default" "$dir/kvq.txt" | head -40
  sed -n '/^| B | ctx | bf16 | fp8 v1/,/^$/p' "$dir/kvq.txt"
  grep -E "FAIL|failed|MISS|PASS|skipped" "$dir/kvq.txt" | head -8
done
