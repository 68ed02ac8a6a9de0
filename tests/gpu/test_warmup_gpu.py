"""runner/warmup.py on the GPU: after start-up, the small eager forwards of serving (a few prompt tokens,
a draft model catching up on 3-8 tokens) compile no GEMV variant mid-serving. On the H200 such a
compile stalled one request by ~0.5 s in the controller sweep."""

from __future__ import annotations

import torch

from specserve import LLM, SamplingParams


def _count_compiles(monkeypatch) -> list[str]:
    from triton.runtime.jit import JITFunction

    compiled: list[str] = []
    real = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiled.append(self.__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counting)
    return compiled


def test_small_forwards_compile_no_gemv_after_start_up(tiny_qwen2_dir, monkeypatch, device: torch.device) -> None:
    llm = LLM(
        model=str(tiny_qwen2_dir),
        progress=False,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=8,
        kv_cache_memory_bytes=16 << 20,
        enable_prefix_caching=False,
    )
    assert llm.engine.runner.graphs is not None
    compiled = _count_compiles(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for n in range(1, 9):  # one prompt of n tokens: an eager (or graphed) forward of n rows
        llm.generate([{"prompt_token_ids": list(range(7, 7 + n))}], params)
    assert not [name for name in compiled if "gemv" in name], compiled
    # The counter sees a compile where one happens: float16, a dtype the bf16 model never ran.
    from specserve.model.layers import triton_gemv

    x = torch.randn(3, 40, device=device, dtype=torch.float16)
    triton_gemv.linear(x, torch.randn(24, 40, device=device, dtype=torch.float16))
    assert any("gemv" in name for name in compiled), compiled


def test_chunks_after_a_context_compile_nothing_after_start_up(tmp_path, monkeypatch, device: torch.device) -> None:
    """1..16 new tokens after a cached prefix of 608 (split-KV attention launches) compile no kernel
    after start-up: a draft model catching up after a pause in drafting runs such forwards, and before
    start-up covered query lengths 9-16 the H200 pair sweep's first adaptive run stalled on them."""
    from tests.helpers.tiny_models import make_tiny_model_dir

    model = make_tiny_model_dir(
        tmp_path / "m", arch="qwen2", seed=3, num_heads=4, num_kv_heads=1, max_position_embeddings=1024
    )
    llm = LLM(
        model=str(model),
        progress=False,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=8,
        max_model_len=1024,
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=True,
    )
    base = [7 + i % 300 for i in range(608)]  # 38 full blocks of 16: a prefix hit leaves only the new tokens
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": base}], params)
    compiled = _count_compiles(monkeypatch)
    for n in range(1, 17):
        llm.generate([{"prompt_token_ids": base + [5 + j for j in range(n)]}], params)
    assert compiled == [], compiled


def test_first_eagle_requests_compile_nothing_after_start_up(
    tiny_qwen2_dir, tmp_path, monkeypatch, device: torch.device
) -> None:
    """An EAGLE-3 engine's first requests (prompts of 5-200 tokens, one at a time and four together)
    compile no kernel after start-up (speculative/proposers/eagle_setup.py): on the H200 the first run of the first
    EAGLE-3 engine of a process ran at 215 tok/s against ~1,000 for the later ones."""
    from tests.helpers.eagle_heads import make_random_head_dir

    head = make_random_head_dir(str(tiny_qwen2_dir), tmp_path / "h")
    llm = LLM(
        model=str(tiny_qwen2_dir),
        progress=False,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=8,
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
        speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 4},
    )
    compiled = _count_compiles(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for n in (5, 37, 200):
        llm.generate([{"prompt_token_ids": [7 + i % 300 for i in range(n)]}], params)
    llm.generate([{"prompt_token_ids": [9 + (i * r) % 300 for i in range(20 + 30 * r)]} for r in range(4)], params)
    assert compiled == [], compiled


def test_catch_ups_of_several_requests_compile_nothing_after_start_up(
    tiny_qwen2_dir, monkeypatch, device: torch.device
) -> None:
    """1..16 new tokens of each of 4 sequences after a context (a draft model catching up on a pause in
    drafting feeds every running request) compile no kernel after start-up. No captured graph covers
    that shape, and before the start-up forwards ran eagerly the H200 pair sweep stalled 545 ms on it
    (an attention launch of a query block the single-sequence forwards had only replayed in a graph)."""
    from specserve.kv.manager import KVCacheManager
    from specserve.runner.model_runner import ModelRunner
    from specserve.scheduler.request import Request
    from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput

    llm = LLM(
        model=str(tiny_qwen2_dir),
        progress=False,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=8,
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
    )
    runner = llm.engine.runner
    assert runner.graphs is not None
    contexts = [40 + 7 * i for i in range(4)]
    # the prompts' own forwards (eager prefills of 4 sequences) compile at the first request, as in serving
    llm.generate([{"prompt_token_ids": [3] * c} for c in contexts], SamplingParams(max_tokens=2, ignore_eos=True))
    compiled = _count_compiles(monkeypatch)
    for n in range(1, 17):
        kv = KVCacheManager(64, runner.block_size, enable_prefix_caching=False)
        reqs = [Request(f"c{n}-{i}", [3] * (c + n), SamplingParams(max_tokens=1), 1) for i, c in enumerate(contexts)]
        for r, c in zip(reqs, contexts):
            kv.allocate_slots(r, c + n)
        ModelRunner.execute(
            runner,
            SchedulerOutput([ScheduledRequest(r, c, 0) for r, c in zip(reqs, contexts)], sum(contexts)),
            kv.block_ids,
        )
        for r, c in zip(reqs, contexts):
            r.num_computed_tokens = c
        ModelRunner.execute(runner, SchedulerOutput([ScheduledRequest(r, n, 0) for r in reqs], 4 * n), kv.block_ids)
    assert compiled == [], compiled


def test_a_draft_models_first_long_catch_ups_compile_no_attention(
    tiny_qwen2_dir, monkeypatch, device: torch.device
) -> None:
    """A draft model feeds a new request's whole prompt at its first proposal: an eager forward of more
    than SMALL_QUERY_MAX tokens of several requests, i.e. prefill-sized attention. Start-up compiles it
    (runner/warmup.warm_prompt_forwards): on the H200 pair sweep the draft's prefill attention compiled
    in the middle of a measured run (nineteenth session, twice)."""
    llm = LLM(
        model=str(tiny_qwen2_dir),
        progress=False,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=8,
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
        speculative_config={"method": "draft_model", "model": str(tiny_qwen2_dir), "num_speculative_tokens": 4},
    )
    compiled = _count_compiles(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for n in (37, 200):
        llm.generate([{"prompt_token_ids": [7 + i % 300 for i in range(n)]}], params)
    llm.generate([{"prompt_token_ids": [9 + (i * r) % 300 for i in range(40 + 50 * r)]} for r in range(4)], params)
    assert not [name for name in compiled if "attention" in name], compiled
