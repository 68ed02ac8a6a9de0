"""runner/step_costs.py: the cost table's interpolation, and the start-up measurement on the tiny
model (structure only: CPU timings are not monotone) leaving the KV pool as it found it."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.runner.step_costs import (
    CPU_BATCH_SIZES,
    CostTable,
    measure_step_costs,
    step_cost_batch_sizes,
)


def test_cost_table_interpolates_and_extrapolates() -> None:
    t = CostTable({(1, 1): 1.0, (1, 3): 3.0, (4, 1): 2.0, (4, 3): 6.0})
    assert t.seconds(1, 1) == 1.0 and t.seconds(4, 3) == 6.0
    assert t.seconds(1, 2) == pytest.approx(2.0)  # between query lengths
    assert t.seconds(1, 5) == pytest.approx(5.0)  # past the longest: the line through the last two
    assert t.seconds(2, 1) == pytest.approx(4 / 3)  # between batch sizes
    assert t.seconds(2, 2) == pytest.approx(2.0 + (4.0 - 2.0) / 3)
    assert t.seconds(10, 1) == pytest.approx(4.0)  # past the largest batch size
    assert t.batch_sizes == (1, 4)


def test_cost_table_clamps_below_and_never_prices_more_tokens_cheaper() -> None:
    t = CostTable({(8, 2): 2.0, (8, 3): 1.5, (8, 4): 3.0, (16, 2): 1.0, (16, 4): 0.5})
    assert t.seconds(8, 1) == 2.0  # below the shortest length, below the smallest size: their cost
    assert t.seconds(1, 2) == 2.0
    assert t.seconds(8, 3) == 2.0  # a noisy cheap length is raised to the one below it
    assert t.seconds(16, 4) == 1.0
    assert t.seconds(64, 2) == 1.0  # a decreasing line is not extrapolated downwards
    assert t.grid[(8, 3)] == 2.0


def test_cost_table_one_measurement_scales_with_tokens() -> None:
    t = CostTable({(4, 1): 1.0})
    assert t.seconds(4, 3) == pytest.approx(3.0) and t.seconds(8, 1) == pytest.approx(2.0)


@pytest.mark.parametrize("grid", [{}, {(0, 1): 1.0}, {(1, 0): 1.0}, {(1, 1): 0.0}, {(1, 1): float("nan")}])
def test_cost_table_rejects_a_bad_grid(grid) -> None:
    with pytest.raises(ValueError, match="grid"):
        CostTable(grid)


PROMPTS = [{"prompt_token_ids": [5, 9, 11, 3, 7]}, {"prompt_token_ids": [2, 4, 6]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_measure_step_costs_on_the_tiny_model_leaves_the_kv_pool_as_it_was(tiny_llama_dir) -> None:
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, max_num_seqs=8)
    engine = llm.engine
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]  # (prompt blocks now cached)
    free = engine.kv.num_free_blocks()
    sizes = step_cost_batch_sizes(engine.runner, 8)
    assert sizes == tuple(b for b in CPU_BATCH_SIZES if b <= 8)  # no graphs on the CPU
    table = measure_step_costs(engine.runner, sizes, 4, kv=engine.kv)
    assert set(table.grid) == {(b, q) for b in sizes for q in range(1, 5)}
    assert all(s > 0.0 for s in table.grid.values())
    assert table.seconds(100, 5) > 0.0  # past what was measured
    assert engine.kv.num_free_blocks() == free
    engine.kv.check_integrity()
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert again == want


def test_measure_step_costs_skips_what_the_pool_cannot_hold(tiny_llama_dir) -> None:
    """Without a KV manager it uses the runner's first blocks (start-up): a pool of two blocks of 16
    holds one request of a short context, not 16 requests."""
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    runner = llm.engine.runner
    free = llm.engine.kv.num_free_blocks()
    runner.num_blocks = 2
    table = measure_step_costs(runner, (1, 16), 3)
    assert set(table.grid) == {(1, 1), (1, 2), (1, 3)}
    assert llm.engine.kv.num_free_blocks() == free
    with pytest.raises(ValueError, match="max_query_len"):
        measure_step_costs(runner, (1,), 0)
