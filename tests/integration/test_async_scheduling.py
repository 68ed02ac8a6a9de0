"""Asynchronous scheduling (engine/async_loop.py) gives exactly the synchronous engine's outputs.

On the CPU the "device" runs synchronously, but every piece of the overlap runs all the same:
placeholders scheduled before their tokens are known, device-side input fill, resolution one
step later, dropped rows of requests that finished, block hashes that wait for the real token.
"""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams


def _prompts(n: int = 24, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 300) for _ in range(40)]
    return [
        shared[: rng.choice([0, 16, 40])] + [rng.randrange(5, 300) for _ in range(rng.randint(1, 30))] for _ in range(n)
    ]


def _llm(path, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    llm = LLM(model=str(path), progress=False, async_scheduling=async_scheduling, **kw)
    assert llm.engine.async_scheduling is async_scheduling
    return llm


def _check_freed(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.engine.num_blocks_in_use() == 0


def _same(path, prompts, params, **kw):
    outs = []
    for mode in (False, True):
        llm = _llm(path, mode, **kw)
        outs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
        _check_freed(llm)
    sync, overlap = outs
    for a, b in zip(sync, overlap):
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids
            assert (y.finish_reason, y.stop_reason, y.text) == (x.finish_reason, x.stop_reason, x.text)
    return sync, overlap


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 7},  # chunked prefill mixed with decodes
        {"max_num_seqs": 1},
        {"max_num_seqs": 3, "block_size": 4},
        {"kv_cache_memory_bytes": 60_000},  # a pool this small preempts running requests
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default",
)
def test_greedy_output_identical(tiny_llama_dir, kw):
    params = [
        SamplingParams(temperature=0.0, max_tokens=random.Random(i).randint(1, 20), ignore_eos=True) for i in range(24)
    ]
    _same(tiny_llama_dir, _prompts(), params, **kw)


def test_preemption_really_happens_under_the_small_pool(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, True, kv_cache_memory_bytes=60_000)
    llm.generate(
        [{"prompt_token_ids": p} for p in _prompts()], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    )
    assert llm.engine.scheduler.num_preemptions > 0
    _check_freed(llm)


def test_sampling_features_identical(tiny_qwen2_dir):
    """Seeds, penalties, min_tokens, top-k/p and logprobs read the history one step later than the
    forward was launched: they must still see every token."""
    params = []
    for i in range(12):
        params.append(
            SamplingParams(
                temperature=0.9,
                seed=100 + i,
                top_k=40 if i % 2 else -1,
                top_p=0.9 if i % 3 else 1.0,
                repetition_penalty=1.3 if i % 4 == 1 else 1.0,
                frequency_penalty=0.5 if i % 4 == 2 else 0.0,
                min_tokens=6 if i % 5 == 0 else 0,
                logprobs=3 if i % 3 == 0 else None,
                max_tokens=18,
            )
        )
    sync, overlap = _same(tiny_qwen2_dir, _prompts(12, seed=5), params)
    for a, b in zip(sync, overlap):
        assert b.outputs[0].logprobs == a.outputs[0].logprobs
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob)


def test_stops_on_tokens_the_host_had_not_seen(tiny_llama_dir):
    """EOS / stop tokens / stop strings end a request after its next step was already launched."""
    ref = (
        _llm(tiny_llama_dir, False)
        .generate(["numbers 0 1"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
        .outputs[0]
    )
    stop_tok = ref.token_ids[5]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, stop=[ref.text[6:9]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=3, n=2, seed=1),
    ]
    prompts = ["numbers 0 1", "numbers 0 1", "The quick brown", "Paris is"]
    outs = []
    for mode in (False, True):
        llm = _llm(tiny_llama_dir, mode)
        outs.append(llm.generate(prompts, params))
        _check_freed(llm)
    for a, b in zip(*outs):
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in b.outputs] == [
            (o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in a.outputs
        ]
    assert outs[1][0].outputs[0].finish_reason == "stop" and outs[1][0].outputs[0].token_ids[-1] == stop_tok


def test_abort_while_tokens_are_in_flight(tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(6, seed=9)
    ref = [
        o.outputs[0].token_ids
        for o in _llm(tiny_llama_dir, False).generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    engine = _llm(tiny_llama_dir, True).engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    finished = {}
    for step in range(200):
        if step == 4:
            engine.abort_request(["1", "4"])
            assert engine.async_loop.inflight is not None  # aborted with a step still in flight
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    engine.step()  # resolves what is still in flight for the aborted requests
    assert set(finished) == {str(i) for i in range(6)}
    for i in (0, 2, 3, 5):
        assert finished[str(i)].outputs[0].token_ids == ref[i]
    for i in (1, 4):
        out = finished[str(i)].outputs[0]
        assert out.finish_reason == "abort" and out.token_ids == ref[i][: len(out.token_ids)]
    engine.kv.check_integrity()
    assert engine.num_blocks_in_use() == 0


def test_generated_blocks_are_hashed_with_the_real_tokens(tiny_llama_dir):
    """A block that a placeholder completes gets its hash once the token is known: a follow-up
    prompt made of prompt + output hits every full block of it, as with synchronous scheduling."""
    prompt = list(range(10, 30))
    params = SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)
    hits = []
    for mode in (False, True):
        llm = _llm(tiny_llama_dir, mode, block_size=8)
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        follow = prompt + out.outputs[0].token_ids + [7]
        again = llm.generate([{"prompt_token_ids": follow}], SamplingParams(temperature=0.0, max_tokens=2))[0]
        hits.append(again.num_cached_tokens)
        _check_freed(llm)
    assert hits[1] == hits[0] == (len(prompt) + 45) // 8 * 8


def test_prompt_logprobs_identical(tiny_llama_dir):
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=9),
    ]
    prompts = _prompts(2, seed=11)
    sync, overlap = _same(tiny_llama_dir, prompts, params, max_num_batched_tokens=16)
    assert overlap[0].prompt_logprobs == sync[0].prompt_logprobs
    assert overlap[0].prompt_logprobs is not None


def test_structured_output_identical(tiny_llama_dir):
    pytest.importorskip("xgrammar")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": {"type": "string", "maxLength": 5}},
        "required": ["n", "s"],
    }
    params = [
        SamplingParams(
            temperature=t, seed=s, max_tokens=40, structured_outputs={"json": schema, "disable_any_whitespace": True}
        )
        for t, s in [(0.0, None), (1.0, 3), (0.8, 4)]
    ]
    _same(tiny_llama_dir, [[5, 6, 7], [8, 9], [10]], params)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3", "adaptive"])
def test_speculation_overlaps_the_steps_that_draft_nothing(tiny_llama_dir, tmp_path, method):
    """k = 3 while at most 2 requests run, k = 0 above (vLLM's per-batch-size table): overlapped runs
    of k = 0 steps, and switches both ways as requests finish at different times. Same tokens as plain
    decoding; the switch back drafts from the step in flight (EAGLE reads its hidden states)."""
    from tests.helpers.eagle_heads import make_random_head_dir

    table = {"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 0]], "adaptive": False}
    cfg = {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, **table},
        "draft_model": {"method": "draft_model", "model": str(tiny_llama_dir), **table},
        "eagle3": {
            "method": "eagle3",
            "model": str(make_random_head_dir(str(tiny_llama_dir), tmp_path / "h")),
            **table,
        },
        "adaptive": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    }[method]
    prompts = _prompts(6, seed=13)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(6)]
    plain = [
        o.outputs[0].token_ids
        for o in _llm(tiny_llama_dir, False).generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    llm = _llm(tiny_llama_dir, True, speculative_config={**cfg, "num_speculative_tokens": 3})
    eng, kinds = llm.engine, []
    for owner, name in ((eng.async_loop, "overlapped"), (eng, "step_sync")):
        inner = getattr(owner, name)

        def counted(inner=inner, name=name):
            kinds.append(name)
            return inner()

        setattr(owner, name, counted)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == plain
    _check_freed(llm)
    if method != "adaptive":  # the table makes both kinds of steps happen
        assert "overlapped" in kinds and "step_sync" in kinds
        assert eng.stats.get("spec_decode_num_drafts_total") > 0
        if method == "draft_model":  # a model drafting for itself: every draft is accepted
            assert eng.stats.get("spec_decode_num_accepted_tokens_total") == eng.stats.get(
                "spec_decode_num_draft_tokens_total"
            )


def test_async_scheduling_with_tensor_parallelism_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(
            model=str(tiny_llama_dir),
            progress=False,
            async_scheduling=True,
            kv_cache_memory_bytes=4 << 20,
            tensor_parallel_size=2,
        )


def test_default_is_off_on_cpu(tiny_llm):
    assert tiny_llm.engine.async_scheduling is False
