"""Greedy output of the real SmolLM2-135M-Instruct with each KV cache dtype, against float32 KV.

Quantized KV changes the numbers attention sees, so greedy text may part from the float32-KV text
at a near-tie; what is checked is how long it stays the same (the agreement length, printed per
prompt). bfloat16 and fp8 KV must agree for at least 16 of 24 tokens on every prompt; nvfp4
(4-bit) must not produce garbage from the first token on, and its total over the prompts must show the
gain of the Hadamard rotation and per-channel key smoothing (58 of 96 with both, 52 with the
rotation alone, 35 with neither).

Needs the model in the cache: `specserve models install smollm2-135m-instruct` (CI runs it first).
A missing model is a failure, not a skip.
"""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.model.catalog import install_command, model_path

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 24
MIN_AGREEMENT = {"bfloat16": 16, "fp8": 16, "nvfp4": 1}
MIN_TOTAL = {"bfloat16": 64, "fp8": 64, "nvfp4": 55}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": "Give me three tips for staying focused while studying."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
]


def agreement(a: list[int], b: list[int]) -> int:
    """Number of leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def greedy_ids() -> dict[str, list[list[int]]]:
    if model_path(MODEL) is None:
        pytest.fail(f"{MODEL} is not installed; run: {install_command(MODEL)}")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for kv_dtype in ("float32", "bfloat16", "fp8", "nvfp4"):
        # Short context: a small pool (the default CPU pool is 1 GiB of float32 KV).
        llm = LLM(model=MODEL, kv_cache_dtype=kv_dtype, device="cpu", max_model_len=256, progress=False)
        out[kv_dtype] = [o.outputs[0].token_ids for o in llm.chat(CHATS, params)]
        del llm
    return out


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8", "nvfp4"])
def test_greedy_agreement_with_float32_kv(kv_dtype: str, greedy_ids: dict[str, list[list[int]]]) -> None:
    ref = greedy_ids["float32"]
    got = greedy_ids[kv_dtype]
    assert all(len(ids) == MAX_TOKENS for ids in ref + got)
    lengths = [agreement(a, b) for a, b in zip(ref, got)]
    print(f"\n{kv_dtype} KV vs float32 KV, greedy agreement per prompt (of {MAX_TOKENS}): {lengths}")
    assert min(lengths) >= MIN_AGREEMENT[kv_dtype], f"{kv_dtype}: agreement {lengths}"
    assert sum(lengths) >= MIN_TOTAL[kv_dtype], f"{kv_dtype}: agreement {lengths}"
