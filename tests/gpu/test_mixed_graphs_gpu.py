"""Mixed CUDA graphs on the GPU (runner/cuda_graph.py MIXED_TOKEN_LENS): a 172-token prompt that arrives
beside four decoding requests, and a step of several new prompts at once, replay mixed graphs (no eager
forward of the target), with the same greedy tokens as an engine without CUDA graphs
(enforce_eager), without speculation and with a draft model (whose catch-ups of the new prompt
take the draft's own mixed graphs)."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams


def _serve(path, eager: bool, monkeypatch, spec=None):
    """Returns (tokens per request, [(tokens in the forward, graph key or None)] of the target's steps
    after the arrival, same of the draft's forwards, or [] without a draft)."""
    from specserve.runner.cuda_graph import CudaGraphRunner

    llm = LLM(
        enforce_eager=eager,
        model=str(path),
        progress=False,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=16 << 20,
        enable_prefix_caching=False,
        speculative_config=spec,
    )
    eng = llm.engine
    eng.stream_outputs = False
    target: list[tuple[int, tuple | None]] = []
    draft: list[tuple[int, tuple | None]] = []
    original = CudaGraphRunner.graph_for
    draft_graphs = getattr(eng.spec.proposer.runner, "graphs", None) if spec is not None else None

    def spy(self, batch):
        found = original(self, batch)
        if arrived[0]:
            runs = target if self is eng.runner.graphs else draft if self is draft_graphs else None
            if runs is not None:
                runs.append((batch.num_tokens, None if found is None else found[1]))
        return found

    monkeypatch.setattr(CudaGraphRunner, "graph_for", spy)
    arrived = [False]
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"d{i}", {"prompt_token_ids": [rng.randrange(5, 300) for _ in range(12)]}, params)
    done: dict[str, list[int]] = {}
    for step in range(400):
        if step == 6:
            arrived[0] = True
            eng.add_request("new", {"prompt_token_ids": [rng.randrange(5, 300) for _ in range(172)]}, params)
        if step == 12:  # three prompts in one step: a prefill-only ragged step
            for j in range(3):
                eng.add_request(
                    f"p{j}", {"prompt_token_ids": [rng.randrange(5, 300) for _ in range(30 + 40 * j)]}, params
                )
        for out in eng.step():
            done[out.request_id] = out.outputs[0].token_ids
        if step > 12 and not eng.has_unfinished_requests():
            break
    monkeypatch.setattr(CudaGraphRunner, "graph_for", original)
    eng.kv.check_integrity()
    return done, target, draft


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_arrivals_beside_a_decoding_batch_replay_mixed_graphs(
    tiny_llama_dir, device: torch.device, monkeypatch, spec
) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    cfg = (
        None
        if spec is None
        else {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3, "adaptive": False}
    )
    want, _, _ = _serve(tiny_llama_dir, True, monkeypatch, cfg)
    got, runs, draft = _serve(tiny_llama_dir, False, monkeypatch, cfg)
    assert got == want and len(got) == 8
    assert all(key is not None for _, key in runs), runs
    mixed = [(n, key) for n, key in runs if len(key) == 3]
    assert any(n >= 176 for n, _ in mixed), mixed  # the 172-token prompt beside the four decodes
    assert all(key[2] >= n and key[0] <= 8 for n, key in mixed)
    if spec is not None:
        assert any(key is not None and len(key) == 3 for _, key in draft), draft  # the draft's catch-up
