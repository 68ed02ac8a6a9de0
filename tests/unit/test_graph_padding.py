"""Steps mixing query lengths (verify steps with drafts of different lengths) pad per sequence to a
captured CUDA-graph length (runner/batch.py pad_to_query_len, runner/cuda_graph.py graph_for).

The padded batch must give the real rows exactly the logits of the ragged one: checked on the CPU
by running both layouts through the same eager forward, on the same KV cache.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from specserve import LLM, SamplingParams
from specserve.runner.batch import build_host_batch, pad_to_query_len
from specserve.runner.cuda_graph import CudaGraphRunner
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput


def _ragged_step(llm: LLM, drafts: list[list[int]]):
    """Requests past their prefill, each verifying its own number of draft tokens."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i in range(len(drafts)):
        eng.add_request(f"r{i}", {"prompt_token_ids": list(range(20 + i, 40 + 3 * i))}, params)
    for _ in range(3):
        eng.step()
    sched = SchedulerOutput()
    for req, d in zip(list(eng.scheduler.running), drafts):
        req.spec_token_ids = list(d)
        n = req.num_tokens_with_spec - req.num_computed_tokens
        assert eng.kv.allocate_slots(req, n)
        sched.scheduled.append(ScheduledRequest(req, n, len(d)))
    return sched, build_host_batch(sched, eng.kv.block_ids, eng.kv.block_size)


def test_padded_layout(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    _, host = _ragged_step(llm, [[], [5, 6, 7], [8]])
    assert host.query_lens == [1, 4, 2]
    p = pad_to_query_len(host, 4, llm.engine.max_model_len)
    assert p.query_lens == [4, 4, 4] and p.cu_query_lens.tolist() == [0, 4, 8, 12]
    assert (p.seq_lens == host.seq_lens + np.array([3, 0, 2])).all()
    for i, (c, q) in enumerate(zip(host.cu_query_lens[:-1], host.query_lens)):
        real = slice(4 * i, 4 * i + q)
        assert (p.input_ids[real] == host.input_ids[c : c + q]).all()
        assert (p.positions[real] == host.positions[c : c + q]).all()
        assert (p.slot_mapping[real] == host.slot_mapping[c : c + q]).all()
        assert (p.slot_mapping[4 * i + q : 4 * i + 4] == -1).all()  # padding stores no K/V
        assert (np.diff(p.positions[4 * i : 4 * i + 4]) == 1).all()
    # The same tokens are scored, in the same row order.
    assert (p.input_ids[p.logits_indices] == host.input_ids[host.logits_indices]).all()
    assert p.logit_rows == host.logit_rows
    assert pad_to_query_len(host, 3, llm.engine.max_model_len) is None  # a sequence has 4 tokens
    assert pad_to_query_len(host, 4, int(host.seq_lens.max()) + 1) is None  # past the window


def test_padded_step_gives_the_same_logits(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, dtype="float32")
    sched, host = _ragged_step(llm, [[7, 9], [], [5, 6, 7], [8]])
    runner = llm.engine.runner
    ragged = runner._execute(sched, host, False, None, None)
    padded = runner._execute(sched, pad_to_query_len(host, 4, llm.engine.max_model_len), False, None, None)
    assert ragged.logits.shape == padded.logits.shape == (len(host.logits_indices), ragged.logits.shape[1])
    torch.testing.assert_close(padded.logits, ragged.logits, rtol=1e-5, atol=1e-5)


def _graphs(query_lens, sizes_by_q, max_model_len=64, max_blocks=8, catch_up_query_lens=(), mixed_sizes=None):
    """A CudaGraphRunner's choosing part, without its buffers and graphs (no CUDA on the CPU)."""
    ns = SimpleNamespace(
        query_lens=query_lens,
        sizes_by_q=sizes_by_q,
        max_model_len=max_model_len,
        max_blocks=max_blocks,
        catch_up_query_lens=catch_up_query_lens,
        mixed_sizes=mixed_sizes or {},
    )
    for name in ("graph_key", "scores_rows", "_fits", "mixed_key"):
        setattr(ns, name, getattr(CudaGraphRunner, name).__get__(ns))
    ns.num_tokens_of = CudaGraphRunner.num_tokens_of
    return ns


def test_graph_for_picks_exact_then_shortest_padding(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    _, host = _ragged_step(llm, [[], [5, 6], [8]])  # query lengths 1, 3, 2
    g = _graphs((1, 3, 5), {1: (1, 2, 4), 3: (1, 2, 4), 5: (1, 2, 4, 8)}, max_model_len=llm.engine.max_model_len)
    batch, key = CudaGraphRunner.graph_for(g, host)
    assert key == (4, 3) and batch.query_lens == [3, 3, 3]
    g.sizes_by_q = {1: (1, 2, 4), 3: (1, 2), 5: (1, 2, 4, 8)}  # no length-3 graph holds 3 sequences
    batch, key = CudaGraphRunner.graph_for(g, host)
    assert key == (4, 5) and batch.query_lens == [5, 5, 5]
    g.query_lens = (1, 2)  # nothing holds a 3-token sequence: eager
    assert CudaGraphRunner.graph_for(g, host) is None
    _, uniform = _ragged_step(
        LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20), [[1, 2], [3, 4]]
    )
    g = _graphs((1, 3), {1: (1, 2), 3: (1, 2)}, max_model_len=llm.engine.max_model_len)
    batch, key = CudaGraphRunner.graph_for(g, uniform)
    assert batch is uniform and key == (2, 3)


def test_catch_up_graphs_only_for_one_scored_row_per_sequence(tiny_llama_dir):
    """A catch-up graph scores one row per sequence: a step that scores more (a verify step) pads to a
    graph that scores every row, or runs eagerly; a catch-up of 3 sequences, each scoring its last row,
    pads to it."""
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    _, verify = _ragged_step(llm, [[], [5, 6], [8]])  # query lengths 1, 3, 2, every row scored
    g = _graphs(
        (1, 2, 4, 16),
        {1: (1, 2, 4), 2: (1, 2, 4), 4: (1, 2, 4), 16: (1, 2, 4)},
        max_model_len=llm.engine.max_model_len,
        catch_up_query_lens=(4,),
    )
    batch, key = CudaGraphRunner.graph_for(g, verify)
    assert key == (4, 16) and batch.query_lens == [16, 16, 16]  # not the catch-up length 4
    g.query_lens, g.catch_up_query_lens = (1, 2, 4), (4, 16)
    assert CudaGraphRunner.graph_for(g, verify) is None
    g.query_lens = (1, 2, 4, 16)
    eng = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20).engine
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"c{i}", {"prompt_token_ids": list(range(40 + i, 43 + 2 * i))}, params)
    sched = eng.scheduler.schedule()  # prompts of 3, 4 and 5 tokens, each scoring its last row
    host = build_host_batch(sched, eng.kv.block_ids, eng.kv.block_size)
    assert host.query_lens == [3, 4, 5] and len(host.logits_indices) == 3
    batch, key = CudaGraphRunner.graph_for(g, host)
    assert key == (4, 16) and batch.query_lens == [16, 16, 16]
    assert [int(batch.input_ids[i]) for i in batch.logits_indices] == [42, 44, 46]  # each one's last token


def test_middle_lengths_only_for_small_batches():
    from specserve.runner.cuda_graph import DEFAULT_BATCH_SIZES, MID_QUERY_MAX_BATCH, sizes_by_query_len

    sizes = sizes_by_query_len(list(DEFAULT_BATCH_SIZES), (1, 2, 3, 4, 5))
    assert sizes[1] == sizes[5] == DEFAULT_BATCH_SIZES
    assert sizes[3] == tuple(b for b in DEFAULT_BATCH_SIZES if b <= MID_QUERY_MAX_BATCH)
    assert sizes_by_query_len([64, 128], (1, 3, 4))[3] == (64,)  # at least one size per length
    assert sizes_by_query_len([1, 2], (1,)) == {1: (1, 2)}


def test_decode_graphs_up_to_the_largest_batch_verify_graphs_to_256():
    """Every decode batch up to max_num_seqs has a graph (past 256, padding it by at most a quarter); verify graphs
    (query length > 1) stop at VERIFY_MAX_BATCH."""
    from specserve.runner.cuda_graph import VERIFY_MAX_BATCH, graph_batch_sizes, sizes_by_query_len

    for m in (1, 7, 256, 300, 1000, 1024, 2048):
        sizes = graph_batch_sizes(m)
        assert sizes[-1] == m and list(sizes) == sorted(set(sizes))
        for n in range(1, m + 1):
            padded = next(b for b in sizes if b >= n)
            assert padded - n <= (n // 4 if n > 256 else max(16, n // 2)), (m, n, padded)
    sizes = sizes_by_query_len(list(graph_batch_sizes(1024)), (1, 2, 5))
    assert sizes[1][-1] == 1024 and sizes[5][-1] == VERIFY_MAX_BATCH and max(sizes[2]) <= VERIFY_MAX_BATCH


def test_prefill_lengths_only_for_one_or_two_sequences():
    from specserve.runner.cuda_graph import PREFILL_MAX_BATCH, sizes_by_query_len

    sizes = sizes_by_query_len([1, 2, 4, 8], (1, 4), (16, 64))
    assert sizes[1] == sizes[4] == (1, 2, 4, 8)  # the verify edges are unchanged by prefill lengths
    assert sizes[16] == sizes[64] == tuple(b for b in (1, 2, 4, 8) if b <= PREFILL_MAX_BATCH)
    assert sizes_by_query_len([1, 2], (1, 16), (16,))[16] == (1, 2)  # already a verify length


def test_catch_up_lengths_up_to_32_sequences():
    """Catch-up graphs (one scored row per sequence) get batch sizes up to CATCH_UP_MAX_BATCH; a length
    that is already a verify or prefill length keeps those graphs (which score every row)."""
    from specserve.runner.cuda_graph import (
        CATCH_UP_MAX_BATCH,
        DEFAULT_BATCH_SIZES,
        catch_up_lens_of,
        sizes_by_query_len,
    )

    assert catch_up_lens_of((1, 2), (), (4, 16, 64)) == (4, 16, 64)
    assert catch_up_lens_of((1, 4), (16,), (4, 16, 64)) == (64,)
    sizes = sizes_by_query_len(list(DEFAULT_BATCH_SIZES), (1, 2), (), (4, 64))
    assert sizes[1] == sizes[2] == DEFAULT_BATCH_SIZES
    assert sizes[4] == sizes[64] == tuple(b for b in DEFAULT_BATCH_SIZES if b <= CATCH_UP_MAX_BATCH)
    assert CATCH_UP_MAX_BATCH > 2  # beyond the prefill graphs' two sequences


def test_short_prefill_pads_to_a_prefill_graph(tiny_llama_dir):
    """A 13-token prefill tail after a prefix hit, alone or beside a decode, takes the 16-token graph;
    three sequences, or a tail longer than every prefill length, run eagerly."""
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    doc = list(range(30, 30 + 4 * eng.kv.block_size))
    llm.generate({"prompt_token_ids": doc}, params)  # caches the document's blocks
    eng.add_request("d", {"prompt_token_ids": list(range(200, 210))}, params)
    eng.step()  # "d" is now decoding
    eng.add_request("q", {"prompt_token_ids": doc + list(range(300, 313))}, params)
    sched = eng.scheduler.schedule()
    host = build_host_batch(sched, eng.kv.block_ids, eng.kv.block_size)
    assert sorted(host.query_lens) == [1, 13]  # the document was a prefix hit
    g = _graphs(
        (1, 2, 16, 64),
        {1: (1, 2, 4), 2: (1, 2, 4), 16: (1, 2), 64: (1, 2)},
        max_model_len=eng.max_model_len,
        max_blocks=64,
    )
    batch, key = CudaGraphRunner.graph_for(g, host)
    assert key == (2, 16) and batch.query_lens == [16, 16]
    assert (batch.input_ids[batch.logits_indices] == host.input_ids[host.logits_indices]).all()
    g.sizes_by_q = {1: (1, 2, 4), 2: (1, 2, 4), 16: (1,), 64: (1,)}
    assert CudaGraphRunner.graph_for(g, host) is None  # two sequences, prefill graphs for one only
    g.query_lens = (1, 2, 4)
    g.sizes_by_q = {1: (1, 2, 4), 2: (1, 2, 4), 4: (1, 2, 4)}
    assert CudaGraphRunner.graph_for(g, host) is None  # no length holds 13 tokens


def test_padded_prefill_gives_the_same_logits(tiny_llama_dir):
    """The padded layout of a prefill tail (as its graph would run it) scores the last real token
    exactly as the ragged eager step does, on the CPU."""
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, dtype="float32")
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    doc = list(range(40, 40 + 3 * eng.kv.block_size))
    llm.generate({"prompt_token_ids": doc}, params)
    eng.add_request("q", {"prompt_token_ids": doc + list(range(300, 311))}, params)
    sched = eng.scheduler.schedule()
    host = build_host_batch(sched, eng.kv.block_ids, eng.kv.block_size)
    assert host.query_lens == [11]
    ragged = eng.runner._execute(sched, host, False, None, None)
    padded = eng.runner._execute(sched, pad_to_query_len(host, 16, eng.max_model_len), False, None, None)
    torch.testing.assert_close(padded.logits, ragged.logits, rtol=1e-5, atol=1e-5)


def test_graph_output_bytes_counts_every_captured_pair():
    """The KV pool holds back what the graphs keep: logits + hidden rows summed over every captured
    (batch size, query length), so verify and prefill lengths add to the decode graphs."""
    from specserve.runner.cuda_graph import PREFILL_QUERY_LENS, graph_batch_sizes, graph_output_bytes

    assert graph_batch_sizes(8) == (1, 2, 4, 8) and graph_batch_sizes(10) == (1, 2, 4, 8, 10)
    per_row = 1000 * 4 + 64 * 2
    decode = graph_output_bytes(8, (1,), (), 1000, 64, 2)
    assert decode == int((1 + 2 + 4 + 8) * per_row * 1.1)
    verify = graph_output_bytes(8, (1, 2, 3), (), 1000, 64, 2)
    assert verify == int((1 + 2 + 3) * (1 + 2 + 4 + 8) * per_row * 1.1)
    prefill = graph_output_bytes(8, (1,), PREFILL_QUERY_LENS, 1000, 64, 2)
    assert prefill == int((15 + sum(PREFILL_QUERY_LENS) * (1 + 2)) * per_row * 1.1)  # batch sizes 1 and 2
    # catch-up graphs keep [bs, vocab] logits and [bs * q, hidden] states, at every size up to 8 here
    catch_up = graph_output_bytes(8, (1,), (), 1000, 64, 2, (1, 4, 16))
    assert catch_up == int((15 * per_row + 2 * 15 * 1000 * 4 + 15 * (4 + 16) * 64 * 2) * 1.1)


def test_gc_paused_for_capture_collects_first_and_restores() -> None:
    """Cycles dead before a capture are collected on entry; none is collected during it (an automatic
    collection mid-capture can free pinned buffers, which invalidates the capture); the collector's
    state is restored after, also when the capture raises."""
    import gc
    import weakref

    from specserve.runner.cuda_graph import gc_paused_for_capture

    class Cycle:
        pass

    def dead_cycle() -> weakref.ref:
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        return weakref.ref(a)

    before = dead_cycle()
    assert gc.isenabled()
    with gc_paused_for_capture():
        assert before() is None and not gc.isenabled()
        during = dead_cycle()
        kept = [Cycle() for _ in range(3 * gc.get_threshold()[0])]  # would trigger an automatic collection
        assert during() is not None
        del kept
    assert gc.isenabled()
    gc.collect()
    assert during() is None
    try:
        with gc_paused_for_capture():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()
