#!/usr/bin/env bash
# One device call of diagnostics (random weights, no uploads), results under $OUT:
#   kernels_15b.txt / trace_15b.json: the 1.5B batch-1 decode step per kernel (issue 4);
#   train_*.txt: a train-draft step's wall time and profile (issue 5);
#   gpu_tests.txt: the RoPE / PDL GPU tests; quant_crash.txt: bench/device/quant_kv_crash.sh (issue 6).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 bench/profile_kernels.py qwen2.5-1.5b "$OUT/trace_15b.json" > "$OUT/kernels_15b.txt" 2>&1
tail -n 34 "$OUT/kernels_15b.txt" | cut -c1-200 | head -20
python3 bench/train_profile.py --shape qwen2.5-1.5b --method eagle3 --steps 10 > "$OUT/train_eagle3.txt" 2>&1
grep "per step" "$OUT/train_eagle3.txt"
python3 bench/train_profile.py --shape qwen2.5-1.5b --method p-eagle --steps 6 --profile-steps 2 > "$OUT/train_peagle.txt" 2>&1
grep "per step" "$OUT/train_peagle.txt"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu -k "rope or pdl" > "$OUT/gpu_tests.txt" 2>&1
tail -n 3 "$OUT/gpu_tests.txt"
timeout 220 bash bench/device/quant_kv_crash.sh > "$OUT/quant_crash.txt" 2>&1
tail -n 25 "$OUT/quant_crash.txt"
