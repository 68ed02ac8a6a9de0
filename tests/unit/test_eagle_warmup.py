"""The EAGLE head's start-up forwards (speculative/proposers/eagle_setup.py; an engine runs them on CUDA, where they
compile kernels): every size that fits the head's KV pool and the position table runs once, eagerly,
without taking a block a request could hold, and the tokens afterwards are unchanged."""

from __future__ import annotations

from specserve import LLM, SamplingParams
from specserve.runner import warmup
from specserve.speculative.proposers import eagle_setup
from tests.helpers.eagle_heads import make_random_head_dir


def test_eager_head_forwards_cover_every_size_that_fits(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(warmup, "SPLIT_CONTEXT", 128)  # the tiny model holds 512 positions
    head = make_random_head_dir(str(tiny_llama_dir), tmp_path / "h")
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
    )
    prompt, params = {"prompt_token_ids": list(range(5, 45))}, SamplingParams(temperature=0.0, max_tokens=8)
    before = llm.generate(prompt, params)[0].outputs[0].token_ids
    proposer = llm.engine.spec.proposer
    done = eagle_setup.warm_eager_head(proposer)
    fresh, after = eagle_setup.warm_rows()
    cap = min(proposer.kv.num_blocks * proposer.kv.block_size, proposer.target.cos_sin_cache.shape[0])
    ctx = 128
    expected = [(0, t) for t in fresh if t <= cap] + [(ctx, t) for t in after if ctx + t <= cap]
    assert done == expected and (0, 200) in expected and (ctx, 16) in expected
    assert proposer.kv.num_free_blocks() == proposer.kv.num_blocks
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == before
