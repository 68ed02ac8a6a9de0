"""Greedy SmolLM2 on the GPU (float32) must equal the CPU torch reference token for token.

  python bench/smollm2_gpu_check.py ref   --model PATH --out ref.json   # on the CPU
  python bench/smollm2_gpu_check.py check --model PATH --ref ref.json   # on the GPU
"""
from __future__ import annotations

import argparse
import json

from specserve import LLM, SamplingParams

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Explain what a hash table is in one paragraph.", "List three prime numbers."]


def run(model: str, device: str, dtype: str) -> list[list[int]]:
    llm = LLM(model=model, device=device, dtype=dtype, progress=False, max_model_len=1024,
              kv_cache_memory_bytes=256 << 20, enforce_eager=False)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["ref", "check"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="smollm2_ref.json")
    ap.add_argument("--ref", default="smollm2_ref.json")
    args = ap.parse_args()
    if args.mode == "ref":
        json.dump({"prompts": PROMPTS, "tokens": run(args.model, "cpu", "float32")}, open(args.out, "w"))
        return
    ref = json.load(open(args.ref))["tokens"]
    gpu32 = run(args.model, "cuda", "float32")
    gpu16 = run(args.model, "cuda", "bfloat16")
    for i, p in enumerate(PROMPTS):
        print(f"{p[:40]:40} fp32 equal={gpu32[i] == ref[i]} (agree {agreement(gpu32[i], ref[i])}/{len(ref[i])}) "
              f"bf16 agree {agreement(gpu16[i], ref[i])}/{len(ref[i])}")
    print("ALL_FP32_EQUAL", all(a == b for a, b in zip(gpu32, ref)))


if __name__ == "__main__":
    main()
