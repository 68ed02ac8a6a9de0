"""Asynchronous scheduling on the GPU, with CUDA graphs: the same tokens as the synchronous engine
and as the CPU torch reference path, whatever finishes while a step is in flight."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _generate(path, device: str, params, prompts, **kw) -> list:
    llm = LLM(
        model=str(path),
        progress=False,
        device=device,
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=8 << 20,
        **kw,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.kv.check_integrity()
    assert llm.engine.num_blocks_in_use() == 0
    if device == "cuda":
        assert llm.engine.async_scheduling is kw.get("async_scheduling", True)
        assert llm.engine.runner.graphs is not None
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def test_greedy_matches_sync_and_cpu(tiny_llama_dir, device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("asynchronous scheduling overlaps host work with a GPU")
    prompts = _prompts(12, seed=1)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=random.Random(i).randint(1, 30),
            ignore_eos=i % 2 == 0,
            stop_token_ids=[] if i % 3 else [17, 42],
        )
        for i in range(12)
    ]
    overlap = _generate(tiny_llama_dir, "cuda", params, prompts)
    assert overlap == _generate(tiny_llama_dir, "cuda", params, prompts, async_scheduling=False)
    assert overlap == _generate(tiny_llama_dir, "cpu", params, prompts)


def test_seeded_sampling_and_penalties_match_sync(tiny_llama_dir, device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("asynchronous scheduling overlaps host work with a GPU")
    prompts = _prompts(10, seed=2)
    params = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            top_p=0.9,
            repetition_penalty=1.2 if i % 2 else 1.0,
            min_tokens=5 if i % 3 == 0 else 0,
            max_tokens=24,
        )
        for i in range(10)
    ]
    assert _generate(tiny_llama_dir, "cuda", params, prompts) == _generate(
        tiny_llama_dir, "cuda", params, prompts, async_scheduling=False
    )


@pytest.mark.parametrize("method", ["draft_other", "draft_self", "eagle3", "p-eagle"])
def test_speculation_with_device_chained_drafts(tiny_llama_dir, tmp_path, method, device: torch.device) -> None:
    """Drafts stay on the device between draft forwards (speculative/proposers/draft_tokens.py); greedy output must
    equal plain decoding, and a model drafting for itself must have every draft accepted."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs and device-chained drafts need a GPU")
    from tests.helpers.eagle_heads import make_random_head_dir
    from tests.helpers.tiny_models import make_tiny_model_dir

    target = str(tiny_llama_dir)
    cfg = {
        "draft_other": {
            "method": "draft_model",
            "model": str(make_tiny_model_dir(tmp_path / "d", arch="llama", seed=11, num_layers=1)),
        },
        "draft_self": {"method": "draft_model", "model": target},
        "eagle3": {"method": "eagle3", "model": str(make_random_head_dir(target, tmp_path / "e", "eagle3"))},
        "p-eagle": {
            "method": "eagle3",
            "parallel_drafting": True,
            "model": str(make_random_head_dir(target, tmp_path / "p", "eagle3", num_mask_slots=3)),
        },
    }[method]
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _generate(tiny_llama_dir, "cuda", params, prompts, async_scheduling=False)
    llm = LLM(
        model=target,
        progress=False,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=8 << 20,
        speculative_config={**cfg, "num_speculative_tokens": 4, "adaptive": False},
    )
    got = [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason)
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert got == plain
    st = llm.engine.stats
    assert st.get("spec_decode_num_drafts_total") > 0
    if method == "draft_self":
        assert st.get("spec_decode_num_accepted_tokens_total") == st.get("spec_decode_num_draft_tokens_total")


def test_mixed_draft_lengths_replay_padded_graphs(tiny_llama_dir, device: torch.device) -> None:
    """n-gram drafts of different lengths in one verify step pad to a captured length
    (runner/cuda_graph.py graph_for): same tokens as plain decoding, and padded replays happen."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    rng = random.Random(5)
    prompts = []
    for _ in range(8):  # repeated spans give the n-gram proposer matches of varying length
        span = [rng.randrange(5, 300) for _ in range(rng.randint(2, 6))]
        prompts.append((span * 6)[: rng.randint(10, 36)])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = _generate(tiny_llama_dir, "cuda", params, prompts, async_scheduling=False)
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=8 << 20,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "adaptive": False,
        },
    )
    graphs = llm.engine.runner.graphs
    assert graphs.verify_query_lens == (1, 2, 3, 4, 5)
    inner, kinds = graphs.graph_for, []

    def counting(batch):
        found = inner(batch)
        kinds.append("eager" if found is None else "graph" if found[0] is batch else "padded")
        return found

    graphs.graph_for = counting
    got = [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason)
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert got == plain
    assert kinds.count("padded") > 0, kinds


@pytest.mark.parametrize("method", ["ngram", "draft_self", "eagle3"])
def test_speculation_with_overlapped_k0_steps(tiny_llama_dir, tmp_path, method, device: torch.device) -> None:
    """Asynchronous scheduling with speculation on the GPU: the table drafts k=3 while at most 2
    requests run and nothing above, so overlapped k=0 runs and switches back (drafting from the step
    in flight, EAGLE from its graph's hidden states) both happen. Same tokens as plain decoding."""
    if device.type != "cuda":
        pytest.skip("asynchronous scheduling overlaps host work with a GPU")
    from tests.helpers.eagle_heads import make_random_head_dir

    table = {
        "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 0]],
        "adaptive": False,
        "num_speculative_tokens": 3,
    }
    cfg = {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_self": {"method": "draft_model", "model": str(tiny_llama_dir)},
        "eagle3": {"method": "eagle3", "model": str(make_random_head_dir(str(tiny_llama_dir), tmp_path / "h"))},
    }[method]
    prompts = _prompts(6, seed=13)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(6)]
    plain = _generate(tiny_llama_dir, "cuda", params, prompts, async_scheduling=False)
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=8 << 20,
        speculative_config={**cfg, **table},
    )
    assert llm.engine.async_scheduling
    got = [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason)
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert got == plain
    assert llm.engine.stats.get("spec_decode_num_drafts_total") > 0


def test_short_prefills_replay_prefill_graphs(tiny_llama_dir, device: torch.device) -> None:
    """A short prompt and a short tail after a prefix-cache hit run through the padded prefill graphs
    (runner/cuda_graph.py PREFILL_QUERY_LENS) and give the CPU path's tokens."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from specserve.runner.cuda_graph import CudaGraphRunner

    doc = [random.Random(5).randrange(5, 300) for _ in range(64)]
    prompts = [[7, 8, 9], doc + [11, 12, 13, 14, 15], doc + list(range(20, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    keys: list[tuple[int, int]] = []
    original = CudaGraphRunner.graph_for

    def spy(self, batch):
        found = original(self, batch)
        if found is not None:
            keys.append(found[1])
        return found

    CudaGraphRunner.graph_for = spy
    try:
        llm = LLM(
            model=str(tiny_llama_dir),
            progress=False,
            device="cuda",
            dtype="float32",
            max_num_seqs=8,
            kv_cache_memory_bytes=8 << 20,
        )
        got = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    finally:
        CudaGraphRunner.graph_for = original
    assert any(q in (16, 64) for _, q in keys), f"no prefill graph replayed: {keys}"
    cpu = LLM(model=str(tiny_llama_dir), progress=False, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert got == [cpu.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("drafting_up_to", [2, 4])
def test_draft_catch_ups_replay_catch_up_graphs(
    tiny_llama_dir, device: torch.device, monkeypatch, drafting_up_to: int
) -> None:
    """A draft model catching up after steps without drafts (here: k = 0 while more than 2 or 4 requests
    run) pads its catch-up of every running request to a captured catch-up graph, which scores each
    sequence's last row only, instead of a ~10 ms eager forward; the tokens stay plain decoding's, and
    drafting for itself, every draft is accepted."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from specserve.runner.cuda_graph import CATCH_UP_QUERY_LENS, CudaGraphRunner

    table = {
        "num_speculative_tokens_per_batch_size": [[1, drafting_up_to, 3], [drafting_up_to + 1, 64, 0]],
        "adaptive": False,
        "num_speculative_tokens": 3,
    }
    prompts = _prompts(6, seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(6)]
    plain = _generate(tiny_llama_dir, "cuda", params, prompts, async_scheduling=False)
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=8 << 20,
        speculative_config={"method": "draft_model", "model": str(tiny_llama_dir), **table},
    )
    draft_graphs = llm.engine.spec.proposer.runner.graphs
    assert draft_graphs is not None and draft_graphs.catch_up_query_lens == CATCH_UP_QUERY_LENS
    keys: list[tuple[int, ...]] = []
    original = CudaGraphRunner.graph_for

    def spy(self, batch):
        found = original(self, batch)
        if found is not None and self is draft_graphs:
            keys.append(found[1])
        return found

    monkeypatch.setattr(CudaGraphRunner, "graph_for", spy)
    got = [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason)
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert got == plain
    st = llm.engine.stats  # drafting for itself: the catch-ups' scored rows are the right ones
    assert st.get("spec_decode_num_accepted_tokens_total") == st.get("spec_decode_num_draft_tokens_total") > 0
    # a catch-up graph, or a mixed graph (runner/cuda_graph.py MIXED_TOKEN_LENS) where padding every
    # sequence to a catch-up length would run more token rows
    caught_up = {key[0] for key in keys if key[1] in CATCH_UP_QUERY_LENS or len(key) > 2}
    assert caught_up and max(caught_up) >= drafting_up_to, f"no catch-up of {drafting_up_to} replayed a graph: {keys}"


def test_short_prompts_prefill_in_graph_pieces(tiny_llama_dir, tmp_path, device: torch.device, monkeypatch) -> None:
    """A 172-token prompt alone is fed in 64-token pieces, each a prefill-graph replay (no eager
    forward), with the CPU path's tokens; an EAGLE engine too (its head absorbs each piece's features),
    with the same tokens."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from specserve.runner.cuda_graph import CudaGraphRunner
    from tests.helpers.eagle_heads import make_random_head_dir

    prompt = [random.Random(9).randrange(5, 300) for _ in range(172)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=8 << 20,
    )
    assert llm.engine.scheduler.prefill_piece == 64
    runs: list[tuple[int, bool]] = []  # (tokens in the step, replayed)
    original = CudaGraphRunner.graph_for

    def spy(self, batch):
        found = original(self, batch)
        runs.append((batch.num_tokens, found is not None))
        return found

    monkeypatch.setattr(CudaGraphRunner, "graph_for", spy)
    got = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert [n for n, _ in runs[:3]] == [64, 64, 44] and all(replayed for _, replayed in runs), runs
    cpu = LLM(model=str(tiny_llama_dir), progress=False, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert got == cpu.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    head = make_random_head_dir(str(tiny_llama_dir), tmp_path / "h")
    eagle = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=8 << 20,
        speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2},
    )
    assert eagle.engine.scheduler.prefill_piece == 64
    runs.clear()
    assert eagle.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == got
    assert [n for n, _ in runs[:3]] == [64, 64, 44] and all(replayed for _, replayed in runs[:3]), runs
