#!/usr/bin/env bash
# Issue 6: nvfp4 v7 against v6 and bf16 at the target shape (B = 32, 32k, 32 / 8 heads, head_dim 128), and
# v7's GPU tests. v7 = v6 with the softmax of a decode tile's rows 8..15 (padding) left out and K decoded
# from 32-bit words without a byte permute; sm_90 SASS of the unmasked loop 796 against v6's 882
# instructions (bench/kernel_sass.py on the CPU, Triton 3.6). No model needed.
#   bash bench/device/next37.sh          # one timing process (its check at 4k), then the tests (~180 s)
#   bash bench/device/next37.sh time2    # two timing processes (checks at 4k and at 32k; ~190 s)
#   bash bench/device/next37.sh test     # the tests only (~70 s)
# The interpreter ran v7's tests on the CPU, the pool-tail address checks included (not repeated here:
# on the GPU they only compare outputs, as the tests below do).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timing() {  # $@: each process's --contexts, its first context the one its correctness check runs at
  # (the sixteenth-eighteenth sessions saw bf16's first pass slow after a check at 32k: every default
  # launch is timed twice, the faster counts).
  for ctx in "$@"; do
    dir="$OUT/p${ctx%%,*}"
    mkdir -p "$dir"
    OUT="$dir" timeout 90 python3 bench/kv_quant_gpu.py --contexts $ctx --batches 32 \
      --only nvfp4:v6,nvfp4:v7 --budget 60 > "$dir/kvq.txt" 2>&1
    echo "== process --contexts $ctx"
    grep -E "prewarm|nvfp4 v[67]:|ratios are to|(bf16  -|nvfp4 v[67]) +default" "$dir/kvq.txt" | head -24
    sed -n '/^Decode, default launch/,/^Best launch/p' "$dir/kvq.txt"
    grep -E "FAIL|failed|skipped|rror" "$dir/kvq.txt" | head -8
    python3 - "$dir/kv_quant_gpu.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["timings"] if (r["batch"], r["context"]) == (32, 32768)]
bf16 = min(r["us"] for r in rows if r["kv"] == "bf16")
for v in ("v6", "v7"):
    mine = [r for r in rows if r["kv"] == "nvfp4" and r["variant"] == v]
    d = [r["us"] for r in mine if r["config"] in ("default", "repeat (slower)")]
    best = min(mine, key=lambda r: r["us"]) if mine else None
    print(f"B=32 32k nvfp4 {v}: default {min(d):.1f} us = {min(d) / bf16:.4f}x bf16 {bf16:.1f} (passes {d});"
          f" best {best['us']:.1f} ({best['config']})" if d else f"{v}: no timing")
PY
  done
}
tests() {
  timeout 100 python3 -m pytest -q tests/gpu/test_triton_quant_kv.py \
    -k "nvfp4-v7 or pair_decoder or decoders_are_exact" -p no:cacheprovider > "$OUT/tests_v7.txt" 2>&1
  tail -15 "$OUT/tests_v7.txt"
}
case "${1:-all}" in
  all) timing 4096,32768; tests ;;
  time2) timing 4096,32768 32768 ;;
  test) tests ;;
  *) echo "usage: $0 [all|time2|test]" >&2; exit 2 ;;
esac
