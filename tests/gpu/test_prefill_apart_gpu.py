"""Prompts apart on the GPU (scheduler/scheduler.py prefill_apart, SPECSERVE_PREFILL_APART=1): a 172-token
prompt that arrives beside four decoding requests runs in 64-token prefill-graph pieces in steps of its
own, and every step after it arrives replays a graph (no eager forward of the whole batch), with the
same tokens as the engine without it."""
from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams


def _serve(path, apart: bool, monkeypatch, spec=None) -> tuple[dict[str, list[int]], list[tuple[int, bool]]]:
    from specserve.runner.cuda_graph import CudaGraphRunner

    monkeypatch.setenv("SPECSERVE_PREFILL_APART", "1" if apart else "0")
    monkeypatch.setenv("SPECSERVE_MIXED_GRAPHS", "0")  # else the arrival's mixed step replays a mixed graph
    llm = LLM(model=str(path), progress=False, device="cuda", dtype="float32", max_num_seqs=8,
              kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False, speculative_config=spec)
    eng = llm.engine
    assert eng.scheduler.prefill_piece == 64 and eng.scheduler.prefill_apart is apart
    eng.stream_outputs = False
    runs: list[tuple[int, bool]] = []  # (tokens in the forward, replayed a graph), after the arrival
    original = CudaGraphRunner.graph_for

    def spy(self, batch):
        found = original(self, batch)
        if arrived[0] and self is eng.runner.graphs:
            runs.append((batch.num_tokens, found is not None))
        return found

    monkeypatch.setattr(CudaGraphRunner, "graph_for", spy)
    arrived = [False]
    rng = random.Random(3)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"d{i}", {"prompt_token_ids": [rng.randrange(5, 300) for _ in range(12)]}, params)
    done: dict[str, list[int]] = {}
    for step in range(400):
        if step == 6:
            arrived[0] = True
            eng.add_request("new", {"prompt_token_ids": [rng.randrange(5, 300) for _ in range(172)]}, params)
        for out in eng.step():
            done[out.request_id] = out.outputs[0].token_ids
        if step > 6 and not eng.has_unfinished_requests():
            break
    monkeypatch.setattr(CudaGraphRunner, "graph_for", original)
    eng.kv.check_integrity()
    return done, runs


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_an_arrival_beside_a_decoding_batch_replays_graphs(tiny_llama_dir, device: torch.device, monkeypatch,
                                                           spec) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    cfg = None if spec is None else {"method": "draft_model", "model": str(tiny_llama_dir),
                                     "num_speculative_tokens": 3}
    want, eager = _serve(tiny_llama_dir, False, monkeypatch, cfg)
    got, runs = _serve(tiny_llama_dir, True, monkeypatch, cfg)
    assert got == want and len(got) == 5
    assert any(not replayed for _, replayed in eager)  # without it: the arrival's mixed step runs eagerly
    assert all(replayed for _, replayed in runs), runs
    assert [n for n, _ in runs if n >= 43][:3] == [64, 64, 43], runs  # the pieces (the last token joins a batch)
