"""LLM.chat takes vLLM's continue_final_message and chat_template_kwargs and reports the rendered
prompt; SamplingParams refuses non-finite numbers, booleans as counts, seeds past 64 bits and a
non-list stop with a ValueError naming the field (found by an independent check)."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

MESSAGES = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "numbers 0 1"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)


def test_chat_continue_final_message_and_prompt(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.chat(MESSAGES, params, add_generation_prompt=False, continue_final_message=True)[0]
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == text and text.rstrip().endswith("numbers 0 1")
    ids = tok.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(MESSAGES, params, continue_final_message=True)  # add_generation_prompt is still on
    plain = llm.chat(MESSAGES[:1], params)[0]
    assert plain.prompt == tok.apply_chat_template(MESSAGES[:1], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": True}, "n"),
        ({"seed": 2**70}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
    ],
)
def test_sampling_params_name_the_field(kw, field) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw)


def test_seeds_at_the_64_bit_edges_sample(llm) -> None:
    for seed in (-(1 << 63), (1 << 64) - 1):
        out = llm.generate(
            {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=1.0, seed=seed, max_tokens=3, ignore_eos=True)
        )
        assert len(out[0].outputs[0].token_ids) == 3
