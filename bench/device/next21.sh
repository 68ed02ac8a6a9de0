#!/usr/bin/env bash
# Fifteenth session, issue 6 (second call; the first ran every quantized-KV test and timed out at half): nvfp4 v4 (v3 with 16-bit dot operand layouts through
# attention/triton_dot_layout.py's stage hook, and one byte permute per 8 codes in the decoder) on the H200:
#   gpu_quant_tests.txt: the quantized-KV kernel tests of v4 and the default launch (v4 against the torch reference, the PTX decoders
#     exhaustively) and the hook's compile test;
#   kv_quant.txt: bf16 / fp8 / nvfp4 decode attention at 4k / 32k / 128k, every variant checked then timed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
python3 - <<'PY'
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from specserve.attention import triton_dot_layout as d
print("triton", triton.__version__, "pass list copied:", d._pass_list_matches(make_backend(GPUTarget("cuda", 90, 32))))
PY
timeout 240 python3 -m pytest -q -x tests/gpu/test_triton_quant_kv.py tests/gpu/test_quant_kv_bounds.py \
  tests/unit/test_triton_dot_layout.py -p no:cacheprovider -k "v4 or decoders or backend or dot_layout or nvfp4 and not v1 and not v2 and not v3" > "$OUT/gpu_quant_tests.txt" 2>&1
tail -n 4 "$OUT/gpu_quant_tests.txt"
OUT=$OUT timeout 200 python3 bench/kv_quant_gpu.py --budget 140 > "$OUT/kv_quant.txt" 2>&1
sed -n '/^Decode, default/,$p' "$OUT/kv_quant.txt" | head -80
