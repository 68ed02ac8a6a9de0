#!/usr/bin/env bash
# Tenth session, first call (~3 min, random weights, no uploads): what the ninth session built after its
# device time was spent.
#   tests.txt: the draft model's catch-ups through prefill graphs (tests/gpu/test_async_engine.py -k
#     draft: equivalence with plain decoding, a catch-up replays a q = 16 / 64 graph), the start-up
#     warm-up tests, and the split-counter test as fixed (it failed on 11-30 for the test's own reason).
# Then, in one lease, the uploads (parts of 56,000,000 bytes since 11-30: the tree is ~6 MB):
#   for i in 00 .. 19: bash bench/device/put_part.sh .models/q15c.part$i Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf 20 \
#     cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046      (carry only the part)
#   for i in 00 .. 08: bash bench/device/put_part.sh .models/q05c.part$i Qwen2.5-Coder-0.5B-Instruct.gguf 9 \
#     1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
# and the pair again with the catch-up graphs (707e9fa) and the untimed host work priced (de283bb):
#   OUT=$OUT python3 bench/catch_up_probe.py   (draft catch-ups now ~2 ms instead of ~10?)
#   python3 bench/controller_sweep.py --mode pair --policies off,fixed,adaptive --min-requests 8 --rounds 3 \
#     --interleave 3 --time-budget-s 320 --plots --out-dir "$OUT"
#   then the 8B n-gram sweep (--rounds 2 --interleave 2 --time-budget-s 470) and, with what is left, the
#   head run of bench/device/next10.sh's header.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_async_engine.py tests/gpu/test_warmup_gpu.py \
  "tests/gpu/test_triton_attention.py::test_split_counters_grow_outside_capture_only" > "$OUT/tests.txt" 2>&1
tail -n 5 "$OUT/tests.txt"
# Where a speculative step's time goes now (random weights): the target's graphs per query length
# (verify of k+1 rows against a 1-row decode) and the draft's, then the EAGLE-3 / P-EAGLE propose.
OUT=$OUT timeout 150 python3 bench/verify_cost.py --k 8 --context 400 > "$OUT/verify_cost.txt" 2>&1
cat "$OUT/verify_cost.txt" | tail -n 60
OUT=$OUT timeout 150 python3 bench/spec_profile.py --k 4 --steps 60 --configs none,eagle3,p-eagle \
  > "$OUT/spec_profile.txt" 2>&1
tail -n 6 "$OUT/spec_profile.txt"
