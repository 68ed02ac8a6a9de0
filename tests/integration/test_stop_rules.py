"""vLLM's stop rules for the output text: a stop token's (and EOS's) text is not in the output unless
include_stop_str_in_output; stop strings count only once more than min_tokens tokens exist."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

PROMPT = "numbers 0 1"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)


def _gen(llm: LLM, **kw):
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, ignore_eos=True, **kw))[0].outputs[0]


def test_stop_token_text_is_not_output(llm) -> None:
    ref = _gen(llm, max_tokens=24)
    stop_tok = ref.token_ids[5]
    first = ref.token_ids.index(stop_tok)
    before = _gen(llm, max_tokens=first)  # the text of the tokens before the stop token
    with_tok = _gen(llm, max_tokens=first + 1)
    assert with_tok.text != before.text  # the stop token has text of its own
    out = _gen(llm, max_tokens=24, stop_token_ids=[stop_tok])
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.text == before.text
    kept = _gen(llm, max_tokens=24, stop_token_ids=[stop_tok], include_stop_str_in_output=True)
    assert kept.token_ids == out.token_ids and kept.text == with_tok.text


def test_stop_strings_wait_for_min_tokens(llm) -> None:
    ref = _gen(llm, max_tokens=24)
    stop = ref.text.strip()[:2]
    assert stop
    plain = _gen(llm, max_tokens=24, stop=[stop])
    n = len(plain.token_ids)
    assert plain.finish_reason == "stop" and n < 16
    held = _gen(llm, max_tokens=24, stop=[stop], min_tokens=n + 4)
    assert len(held.token_ids) >= n + 4 and held.token_ids == ref.token_ids[: len(held.token_ids)]
