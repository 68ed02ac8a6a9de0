#!/usr/bin/env bash
# Eighth session, device block 2, call A (~4 min, random weights): the nvfp4 changes after next9a.sh.
#   tests_b.txt: the PTX decoders exhaustively (nvfp4 v3 / v4, fp8 v3) and every attention test of
#     fp8 v3 and nvfp4 v3 / v4 (v3 / v4 now take an unmasked loop over the tiles every row sees);
#   kv_quant_b.txt: bench/kv_quant_gpu.py (nvfp4 v3 default now 128-key tiles, 128 registers);
#   engine_*.txt: engines with the new defaults (fp8 v3, nvfp4 v3) on the Qwen2.5-1.5B shape, CUDA
#     graphs on, 12 prompts of 100-3,400 tokens, 256 new tokens each (where v2 once faulted).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
OUT=${OUT:-/tmp/out}
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_quant_kv.py \
  -k "decoders or unit_decode or fp8-v3 or nvfp4-v3 or nvfp4-v4" > "$OUT/tests_b.txt" 2>&1
tail -n 3 "$OUT/tests_b.txt"
OUT=$OUT timeout 170 python3 bench/kv_quant_gpu.py --budget 120 > "$OUT/kv_quant_b.txt" 2>&1
sed -n '/^Decode, default/,$p' "$OUT/kv_quant_b.txt" | grep -v "| fp8 | v[12] \|| nvfp4 | v[12] " | head -60
for dtype in fp8 nvfp4; do
  timeout 75 python3 - "$dtype" > "$OUT/engine_$dtype.txt" 2>&1 <<'PY'
import sys

from specserve import LLM, SamplingParams
from specserve.attention import triton_quant

dtype = sys.argv[1]
llm = LLM(model="qwen2.5-1.5b", load_format="dummy", kv_cache_dtype=dtype, max_model_len=4096, progress=False)
prompts = [{"prompt_token_ids": [(7 * i + j) % 50000 + 100 for j in range(100 + 300 * i)]} for i in range(12)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True))
print(dtype, triton_quant.DEFAULT_VARIANT[dtype], "ok:", sum(len(o.outputs[0].token_ids) for o in outs), "tokens")
PY
  tail -n 2 "$OUT/engine_$dtype.txt"
done
