"""Mixed CUDA graphs (runner/cuda_graph.py MIXED_TOKEN_LENS): a ragged step that no uniform query length
holds (a new prompt's chunk beside decoding requests) replays a graph captured per (batch size, token
count), its padding tokens after the real ones in no sequence and its padding sequences empty.

On the CPU: which graph a step takes, and that the padded layout gives the real rows exactly the logits
of the ragged eager step (the same forward, the same KV cache). tests/gpu/test_mixed_graphs_gpu.py
replays the graphs themselves.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve import LLM, SamplingParams
from specserve.runner.batch import HostBatch, build_host_batch
from specserve.runner.cuda_graph import CudaGraphRunner, graph_batch_sizes, graph_output_bytes, mixed_graph_sizes
from tests.unit.test_graph_padding import _graphs, _ragged_step


def _arrival_step(llm: LLM, num_decoding: int, prompt_len: int):
    """num_decoding requests past their prefill, then a new prompt of prompt_len tokens: one step
    with query lengths [1] * num_decoding + [prompt_len]."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i in range(num_decoding):
        eng.add_request(f"d{i}", {"prompt_token_ids": list(range(20 + i, 30 + 2 * i))}, params)
    for _ in range(2):
        eng.step()
    eng.add_request("new", {"prompt_token_ids": [(7 * j) % 200 + 3 for j in range(prompt_len)]}, params)
    sched = eng.scheduler.schedule()
    return sched, build_host_batch(sched, eng.kv.block_ids, eng.kv.block_size)


def _pad_like_a_mixed_graph(host: HostBatch, num_seqs: int, num_tokens: int) -> HostBatch:
    """The layout CudaGraphRunner.run gives a mixed graph's inputs: padding tokens (id 0, slot -1) after
    the real ones, in no sequence; padding sequences empty (cu_query_lens repeats its last entry)."""
    n, s, extra = host.num_tokens, host.num_seqs, num_seqs - host.num_seqs
    tail = num_tokens - n
    return HostBatch(
        input_ids=np.concatenate([host.input_ids, np.zeros(tail, np.int64)]),
        positions=np.concatenate([host.positions, np.zeros(tail, np.int64)]),
        slot_mapping=np.concatenate([host.slot_mapping, np.full(tail, -1, np.int64)]),
        block_tables=np.concatenate([host.block_tables, np.zeros((extra, host.block_tables.shape[1]), np.int32)]),
        seq_lens=np.concatenate([host.seq_lens, np.zeros(extra, np.int32)]),
        cu_query_lens=np.concatenate([host.cu_query_lens, np.full(extra, host.cu_query_lens[s], np.int32)]),
        logits_indices=host.logits_indices,
        query_lens=host.query_lens + [0] * extra,
        logit_rows=host.logit_rows,
    )


def test_mixed_graph_sizes_take_powers_of_two_below_the_token_count():
    sizes = mixed_graph_sizes(graph_batch_sizes(48), (128, 256, 512), 4096)
    assert sizes == {128: (1, 2, 4, 8, 16, 32, 48), 256: (1, 2, 4, 8, 16, 32, 48), 512: (1, 2, 4, 8, 16, 32, 48)}
    assert mixed_graph_sizes((1, 2, 4, 8, 16, 24, 32), (16, 64), 4096) == {16: (1, 2, 4, 8), 64: (1, 2, 4, 8, 16, 32)}
    # the capture's dummy spreads the tokens evenly: 128 tokens need >= 2 sequences of at most 64
    assert mixed_graph_sizes((1, 2, 4), (128,), 64) == {128: (2, 4)}
    assert mixed_graph_sizes((1,), (128,), 64) == {}
    assert mixed_graph_sizes((), (128,), 4096) == {}


def test_a_prompt_beside_decoding_requests_takes_the_smallest_mixed_graph(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    _, host = _arrival_step(llm, 3, 40)
    assert host.query_lens == [1, 1, 1, 40]
    uniform = {1: (1, 2, 4, 8), 2: (1, 2, 4, 8), 16: (1, 2), 64: (1, 2)}
    g = _graphs((1, 2, 16, 64), uniform, max_model_len=llm.engine.max_model_len, max_blocks=64)
    assert CudaGraphRunner.graph_for(g, host) is None  # no uniform graph for 4 sequences of up to 40
    g.mixed_sizes = {32: (1, 2, 4, 8, 16), 64: (1, 2, 4, 8, 16, 32), 128: (1, 2, 4, 8, 16, 32)}
    batch, key = CudaGraphRunner.graph_for(g, host)
    assert batch is host and key == (4, 64, 64)  # 43 tokens: the 64-token graph, 4 sequences
    assert CudaGraphRunner.num_tokens_of(key) == 64 and CudaGraphRunner.is_mixed(key)
    g.mixed_sizes = {32: (1, 2, 4), 64: (1, 2)}
    assert CudaGraphRunner.graph_for(g, host) is None  # none holds 4 sequences of 43 tokens
    g.mixed_sizes = {128: (1, 2, 4)}
    g.max_blocks = host.block_tables.shape[1] - 1
    assert CudaGraphRunner.graph_for(g, host) is None  # the block tables are wider than the graphs'


def test_uniform_padding_wins_when_it_runs_fewer_rows(tiny_llama_dir):
    """Verify steps mixing draft lengths pad to a uniform graph when that runs no more token rows than
    the smallest mixed graph that holds them; otherwise the mixed graph takes them as they are."""
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    _, host = _ragged_step(llm, [[], [5, 6], [8]])  # query lengths 1, 3, 2: 6 tokens
    g = _graphs(
        (1, 3, 13),
        {1: (1, 2, 4), 3: (1, 2, 4), 13: (1, 2, 4)},
        max_model_len=llm.engine.max_model_len,
        mixed_sizes={8: (1, 2, 4), 16: (1, 2, 4)},
    )
    batch, key = CudaGraphRunner.graph_for(g, host)
    assert key == (4, 8, 8) and batch is host  # 8 rows against the length-3 graph's 4 x 3 = 12
    g.mixed_sizes = {12: (1, 2, 4)}
    batch, key = CudaGraphRunner.graph_for(g, host)
    assert key == (4, 3) and batch.query_lens == [3, 3, 3]  # a tie: the uniform graph scores in the graph


def test_mixed_layout_gives_the_same_logits(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, dtype="float32")
    sched, host = _arrival_step(llm, 3, 21)
    assert host.query_lens == [1, 1, 1, 21]
    runner = llm.engine.runner
    ragged = runner._execute(sched, host, False, None, None)
    padded = runner._execute(sched, _pad_like_a_mixed_graph(host, 8, 64), False, None, None)
    assert ragged.logits.shape == padded.logits.shape == (4, ragged.logits.shape[1])
    torch.testing.assert_close(padded.logits, ragged.logits, rtol=1e-5, atol=1e-5)
    llm.engine.kv.check_integrity()


def test_graph_output_bytes_counts_the_mixed_graphs_hidden_states():
    """A mixed graph keeps only its [tokens, hidden] states (its LM head runs after the replay)."""
    decode = (1 + 2 + 4 + 8) * (1000 * 4 + 64 * 2)  # [bs, vocab] float32 logits + [bs, hidden] states
    mixed = (4 * 16 + 4 * 64) * 64 * 2  # 16 tokens: sizes 1, 2, 4, 8; 64 tokens: the same four
    assert graph_output_bytes(8, (1,), (), 1000, 64, 2, (), (16, 64), 4096) == int((decode + mixed) * 1.1)
    assert graph_output_bytes(8, (1,), (), 1000, 64, 2, (), (), 4096) == int(decode * 1.1)
