"""prompt_logprobs=N (vLLM's shape) against transformers' float32 log_softmax over the same prompt.

Chunked prefill is on (chunks smaller than the prompts), so each prompt is scored over several
steps; prefix-cache reuse and preemption must not change the entries.
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from tests.helpers.tiny_models import _hf_model

ATOL = 1e-4


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(n)]


def _hf_logprobs(path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the distribution of the token after position p."""
    with torch.no_grad():
        logits = _hf_model(str(path))(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _llm(path, num_blocks: int | None = None, **kw) -> LLM:
    if num_blocks is not None:
        probe = LLM(model=str(path), progress=False, kv_cache_memory_bytes=1 << 20)
        kw["kv_cache_memory_bytes"] = num_blocks * probe.engine.runner.spec.bytes_per_block
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    kw.setdefault("max_num_batched_tokens", 16)  # chunked prefill: prompts span several steps
    return LLM(model=str(path), progress=False, **kw)


def _check(path, ids: list[int], got, num_top: int) -> None:
    ref = _hf_logprobs(path, ids)
    assert got is not None and len(got) == len(ids)
    assert got[0] is None
    for p in range(1, len(ids)):
        entry, row = got[p], ref[p - 1]
        tid = ids[p]
        assert tid in entry
        assert entry[tid].logprob == pytest.approx(row[tid].item(), abs=ATOL)
        # vLLM's rank (tokens at least as likely), up to float noise between the two implementations
        assert int((row > row[tid] + ATOL).sum()) + 1 <= entry[tid].rank <= int((row >= row[tid] - ATOL).sum())
        top_lp, top_ids = row.topk(num_top)
        assert len(entry) in (num_top, num_top + 1)
        for j, (t, v) in enumerate(zip(top_ids.tolist(), top_lp.tolist())):
            if t == tid:
                continue
            assert t in entry, f"position {p}: top-{j + 1} token {t} missing"
            assert entry[t].logprob == pytest.approx(v, abs=ATOL)
            assert entry[t].rank == j + 1


def test_prompt_logprobs_match_transformers_with_chunked_prefill(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    prompts = [_prompt(1, 53), _prompt(2, 7), [42]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=5),
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
    ]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": _prompt(3, 20)}],
        params + [SamplingParams(temperature=0.0, max_tokens=4)],
    )
    _check(tiny_llama_dir, prompts[0], outs[0].prompt_logprobs, 5)
    _check(tiny_llama_dir, prompts[1], outs[1].prompt_logprobs, 0)
    assert outs[2].prompt_logprobs == [None]  # a one-token prompt has nothing to score
    assert outs[3].prompt_logprobs is None  # not asked for
    # The entry carries the decoded token text, like the sampled-token logprobs do.
    tid = prompts[0][1]
    assert outs[0].prompt_logprobs[1][tid].decoded_token == llm.get_tokenizer().decode([tid])
    llm.engine.kv.check_integrity()
    assert llm.engine.num_blocks_in_use() == 0


def test_prompt_logprobs_do_not_change_generation(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    ids = _prompt(4, 40)
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    scored = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    )
    assert scored[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_prefix_cache_is_not_reused_for_scored_prompts(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, enable_prefix_caching=True)
    ids = _prompt(5, 70)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1))  # fills the cache
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert out.num_cached_tokens == 0
    _check(tiny_llama_dir, ids, out.prompt_logprobs, 3)
    # n > 1: the prompt is scored once; the other children may still share its blocks.
    outs = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(n=2, temperature=0.0, max_tokens=2, prompt_logprobs=1)
    )
    _check(tiny_llama_dir, ids, outs[0].prompt_logprobs, 1)


def test_prompt_logprobs_survive_preemption(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, num_blocks=14)
    prompts = [_prompt(10 + i, 90) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        _check(tiny_llama_dir, ids, out.prompt_logprobs, 2)


def test_kv_dtype_changes_prompt_logprobs(tiny_llama_dir):
    """Prefill attention reads K/V back from the cache, so a quantized cache shows in the scores."""
    ids = _prompt(6, 60)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def scores(kv_dtype: str) -> list[float]:
        out = _llm(tiny_llama_dir, kv_cache_dtype=kv_dtype, max_num_batched_tokens=None).generate(
            {"prompt_token_ids": ids}, params
        )[0]
        return [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])]

    ref = scores("float32")
    fp8 = scores("fp8")
    assert max(abs(a - b) for a, b in zip(ref, fp8)) > 1e-6


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_prompt_logprobs_value(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_over_vocab_is_refused(tiny_llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        tiny_llm.generate("hello", SamplingParams(prompt_logprobs=10**6))
    assert not tiny_llm.engine.has_unfinished_requests()
