"""Greedy tokens equal transformers' on the same weights, for batches of mixed-length prompts."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from tests.helpers.tiny_models import hf_greedy


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("arch_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_batch_greedy_matches_transformers(arch_fixture, request):
    path = request.getfixturevalue(arch_fixture)
    llm = LLM(model=str(path), progress=False, kv_cache_memory_bytes=4 << 20)
    prompts = _prompts(llm.engine.vocab_size, 6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, p, 12)
        assert out.outputs[0].finish_reason == "length"


def test_text_prompt_and_chat_match_transformers(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = llm.generate("Paris is the capital of", params)[0]
    assert out.prompt_token_ids == tok.encode("Paris is the capital of")
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, out.prompt_token_ids, 10)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = llm.chat(messages, params)[0]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ref_prompt = tok.encode(ids, add_special_tokens=False)
    assert chat.prompt_token_ids == ref_prompt
    assert chat.outputs[0].token_ids == hf_greedy(tiny_llama_dir, ref_prompt, 10)
