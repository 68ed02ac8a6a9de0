"""runner/warmup.py: the start-up forwards of 1..N tokens run through the runner's own dispatch and
leave nothing behind that a request could see."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.runner.warmup import PROMPT_ROWS, SPLIT_CONTEXT, warm_prompt_forwards, warm_small_forwards

PROMPTS = [{"prompt_token_ids": [5, 9, 11, 3, 7]}, {"prompt_token_ids": [2, 4, 6]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _two_engines(model_dir) -> tuple[list[list[int]], LLM, LLM]:
    """(greedy outputs of PROMPTS from a fresh engine, that engine, a second fresh one to warm up)."""
    plain = LLM(model=str(model_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, PARAMS)]
    return want, plain, LLM(model=str(model_dir), progress=False, kv_cache_memory_bytes=4 << 20)


def test_warm_up_runs_every_small_row_count_and_changes_no_output(tiny_llama_dir) -> None:
    want, plain, warmed = _two_engines(tiny_llama_dir)
    runner = warmed.engine.runner
    calls = []
    real = runner._execute
    runner._execute = lambda sched, *a, **kw: calls.append(sched.num_batched_tokens) or real(sched, *a, **kw)
    # An override of execute (tensor parallelism's rank 0 broadcasts there) is not what warms up.
    runner.execute = lambda *a, **kw: pytest.fail("the warm-up must not go through an execute override")
    assert warm_small_forwards(runner, 8) == list(range(1, 9))
    assert calls == list(range(1, 9))  # one forward of each row count, through the runner's dispatch
    del runner._execute, runner.execute
    assert warmed.engine.kv.pool.num_free_blocks == plain.engine.kv.pool.num_free_blocks  # the engine's KV untouched
    assert [o.outputs[0].token_ids for o in warmed.generate(PROMPTS, PARAMS)] == want


def test_warm_up_fits_a_tiny_pool(tiny_llama_dir) -> None:
    """A pool of two blocks (block size 16) takes forwards of up to 16 tokens: never more rows than fit."""
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    runner = llm.engine.runner
    runner.num_blocks = 2
    assert warm_small_forwards(runner, 64) == list(range(1, 17))


def test_warm_up_runs_eagerly_where_a_graph_would_fit(tiny_llama_dir) -> None:
    """Mid-serving the same query lengths come in shapes no graph covers (a catch-up of several
    requests), so the start-up forwards run eagerly, and the runner's graphs are back afterwards."""
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    runner = llm.engine.runner

    class NoGraphs:
        aux_hidden_layers = ()

        def __getattr__(self, name):
            pytest.fail(f"the warm-up used the graphs ({name})")

    sentinel = NoGraphs()
    runner.graphs = sentinel
    seen = []
    real = runner._execute
    runner._execute = lambda sched, *a, **kw: seen.append(runner.graphs) or real(sched, *a, **kw)
    assert warm_small_forwards(runner, 4) == [1, 2, 3, 4]
    assert seen == [None] * 4 and runner.graphs is sentinel
    del runner._execute


def test_prompt_sized_forwards_run_fresh_and_after_a_split_context(tiny_llama_dir) -> None:
    """A draft model's first catch-up of more than SMALL_QUERY_MAX tokens outside its graphs ran prefill
    attention that no start-up forward had compiled: the warm-up runs the prompt-sized row counts, fresh
    and after a context long enough for split-KV, eagerly, and changes no output."""
    want, _, warmed = _two_engines(tiny_llama_dir)
    runner = warmed.engine.runner
    room = min(runner.loaded.max_model_len - 1, (runner.num_blocks - 1) * runner.block_size)
    expected = [(ctx, t) for ctx in (0, SPLIT_CONTEXT) for t in PROMPT_ROWS if ctx + t <= room]
    assert (0, max(PROMPT_ROWS)) in expected  # the tiny model's pool holds the fresh ones at least
    seen = []
    real = runner._execute
    runner._execute = lambda sched, *a, **kw: (
        seen.append((sched.num_batched_tokens, runner.graphs)) or real(sched, *a, **kw)
    )
    assert warm_prompt_forwards(runner) == expected
    assert seen == [(t, None) for _, t in expected]  # eagerly, one forward per (context, rows)
    del runner._execute
    assert [o.outputs[0].token_ids for o in warmed.generate(PROMPTS, PARAMS)] == want


def test_prompt_sized_forwards_skip_what_the_pool_cannot_hold(tiny_llama_dir) -> None:
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    runner = llm.engine.runner
    runner.num_blocks = 5  # 64 of the 80 slots a forward may use: the 64-row forward fits, nothing else
    assert warm_prompt_forwards(runner) == [(0, 64)]
