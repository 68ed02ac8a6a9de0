"""Greedy output is identical across prefix caching, chunk sizes, block sizes, batch sizes, preemption."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams

MAX_TOKENS = 8


def _prompts(n: int = 32, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 300) for _ in range(40)]  # common prefixes -> prefix-cache hits
    out = []
    for _ in range(n):
        head = shared[: rng.choice([0, 16, 33, 40])]
        out.append(head + [rng.randrange(5, 300) for _ in range(rng.randint(1, 25))])
    return out


def _run(path, prompts, **kw) -> tuple[list[list[int]], LLM]:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    llm = LLM(model=str(path), progress=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.kv.check_integrity()
    assert llm.engine.num_blocks_in_use() == 0
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    prompts = _prompts()
    ref, _ = _run(tiny_llama_dir, prompts, enable_prefix_caching=False, max_num_batched_tokens=4096)
    return prompts, ref


@pytest.mark.parametrize(
    "kw",
    [
        dict(enable_prefix_caching=True),
        dict(block_size=4),
        dict(block_size=32),
        dict(max_num_batched_tokens=7),  # chunked prefill, prefills mixed with decodes
        dict(max_num_batched_tokens=33, block_size=8),
        dict(max_num_seqs=1),
        dict(max_num_seqs=3, max_num_batched_tokens=16),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_same_greedy_output(tiny_llama_dir, reference, kw):
    prompts, ref = reference
    got, _ = _run(tiny_llama_dir, prompts, **kw)
    assert got == ref


def test_prefix_cache_hits_and_same_output(tiny_llama_dir, reference):
    prompts, ref = reference
    got, llm = _run(tiny_llama_dir, prompts, enable_prefix_caching=True)
    assert got == ref
    # A second pass over the same prompts hits their cached full blocks.
    before = llm.engine.kv.prefix_hits
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in again] == ref
    assert llm.engine.kv.prefix_hits > before
    assert any(o.num_cached_tokens > 0 for o in again)


@pytest.mark.parametrize("batch", [1, 2, 5, 32])
def test_batch_size_does_not_change_output(tiny_llama_dir, reference, batch):
    prompts, ref = reference
    got, _ = _run(tiny_llama_dir, prompts[:batch])
    assert got == ref[:batch]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_by_tiny_kv_budget(tiny_llama_dir, reference, prefix_caching):
    prompts, ref = reference
    # Room for ~10 blocks of 16 tokens: a few sequences at a time, so running ones get preempted.
    got, llm = _run(
        tiny_llama_dir,
        prompts,
        kv_cache_memory_bytes=10 * _block_bytes(llm_dir=tiny_llama_dir),
        enable_prefix_caching=prefix_caching,
    )
    assert got == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats.get("num_preemptions_total") == llm.engine.scheduler.num_preemptions


def _block_bytes(llm_dir) -> int:
    llm = LLM(model=str(llm_dir), progress=False, kv_cache_memory_bytes=1 << 20)
    return llm.engine.runner.spec.bytes_per_block
