#!/usr/bin/env bash
# One device call (~4 minutes, random weights, no uploads): chase the illegal memory access seen once
# with the faster quantized-KV attention kernels (v2 fp8 / v3 nvfp4, specserve/attention/triton_quant*.py)
# as the engine default on the Qwen2.5-1.5B shape (12 query / 2 KV heads). The CPU interpreter with an
# address checker found no over-read (tests/gpu/test_quant_kv_bounds.py::test_pool_tail_in_bounds), so:
#   1. compute-sanitizer memcheck over that test on the GPU, when the tool is on the machine;
#   2. an engine with v2 / v3 as the default on the Qwen2.5-1.5B shape, CUDA graphs on, prompts of
#      100 to 3,400 tokens, CUDA_LAUNCH_BLOCKING=1 so that a fault names the kernel that raised it.
# Usage: bash bench/device/quant_kv_crash.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/env.sh
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ]; then
  timeout 90 "$SAN" --tool memcheck --print-limit 20 python3 -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_quant_kv_bounds.py -k pool_tail 2>&1 | tail -30
else
  echo "no compute-sanitizer on this machine"
fi
for dtype in fp8 nvfp4; do
  CUDA_LAUNCH_BLOCKING=1 timeout 150 python3 - "$dtype" <<'PY' 2>&1 | grep -v -i warn | tail -15
import sys

from specserve import LLM, SamplingParams
from specserve.attention import triton_quant

dtype = sys.argv[1]
triton_quant.DEFAULT_VARIANT[dtype] = "v3"  # the defaults since 2026-11-30 (fp8 v2, which this chased, is gone)
llm = LLM(model="qwen2.5-1.5b", load_format="dummy", kv_cache_dtype=dtype, max_model_len=4096, progress=False)
prompts = [{"prompt_token_ids": [(7 * i + j) % 50000 + 100 for j in range(100 + 300 * i)]} for i in range(12)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True))
print(dtype, triton_quant.DEFAULT_VARIANT[dtype], "ok:", sum(len(o.outputs[0].token_ids) for o in outs), "tokens")
PY
done
