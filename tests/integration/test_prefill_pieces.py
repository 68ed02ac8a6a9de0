"""Short prompts fed in graph-sized pieces (scheduler/scheduler.py prefill_piece, set where prefill
graphs were captured): the same greedy tokens as one whole prefill, without speculation, with n-gram
and with a draft model, with prefix hits and with asynchronous scheduling; the pieces really ran."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

SPECS = {
    "none": None,
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft_model": {"method": "draft_model"},
}


def _prompts() -> list[list[int]]:
    motif = [11, 42, 7, 99, 23]
    return [
        [5 + (7 * i) % 300 for i in range(50)],  # 50 tokens: 4 pieces of 16
        motif * 8 + [3, 4],  # 42 tokens, repetitive (n-gram drafts)
        [5 + (7 * i) % 300 for i in range(50)] + [8, 9, 10],
    ]  # a prefix hit on the first, then 3 new


@pytest.mark.parametrize("method", list(SPECS))
def test_pieces_give_the_same_tokens(tiny_llama_dir, monkeypatch, method) -> None:
    spec = SPECS[method]
    if spec is not None:
        spec = {**spec, "num_speculative_tokens": 3, "adaptive": False}
        if method == "draft_model":
            spec["model"] = str(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for piece in (None, 16):
        llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, speculative_config=spec)
        eng = llm.engine
        assert eng.scheduler.prefill_piece is None  # no prefill graphs on the CPU
        eng.scheduler.prefill_piece = piece
        chunks: list[int] = []
        real = eng.scheduler.schedule

        def spy(real=real, chunks=chunks):
            out = real()
            chunks.extend(
                s.num_new_tokens for s in out.scheduled if s.request.num_computed_tokens < s.request.num_prompt_tokens
            )
            return out

        monkeypatch.setattr(eng.scheduler, "schedule", spy)
        outs = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in _prompts()]
        runs[piece] = outs
        # Whole prompts in one chunk each, or pieces of at most 16 (the third prompt's 3 new tokens
        # after its prefix hit need none).
        assert max(chunks) == (50 if piece is None else 16), chunks
        eng.kv.check_integrity()
    assert runs[16] == runs[None]


def test_two_requests_share_pieces_and_async_steps(tiny_llama_dir) -> None:
    """Two prompts at once (both in pieces, in the same steps), asynchronous scheduling on."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:2]]
    runs = {}
    for piece in (None, 16):
        llm = LLM(
            model=str(tiny_llama_dir),
            progress=False,
            kv_cache_memory_bytes=4 << 20,
            enable_prefix_caching=False,
            async_scheduling=True,
        )
        assert llm.engine.async_scheduling
        llm.engine.scheduler.prefill_piece = piece
        runs[piece] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runs[16] == runs[None]


def test_pieces_with_preemption(tiny_llama_dir) -> None:
    """Two requests in pieces in a pool of 8 blocks of 16: preemption between pieces and decode steps;
    the same tokens as whole prompts in a large pool."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + (7 * i + r) % 300 for i in range(45 + 5 * r)]} for r in range(2)]
    plain = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    block = plain.engine.runner.spec.bytes_per_block
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=8 * block)
    llm.engine.scheduler.prefill_piece = 16
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv.check_integrity()
