"""spec/draft_chain.py on the GPU: a draft model's chained steps replayed as one captured CUDA graph
draft what the per-step replays draft (the same tokens, drafts and acceptance), and the graphs ran."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams


def _run(target, monkeypatch, chain: str):
    monkeypatch.setenv("SPECSERVE_DRAFT_CHAIN_GRAPH", chain)
    llm = LLM(model=str(target), progress=False, device="cuda", dtype="float32", max_num_seqs=8,
              kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "draft_model", "model": str(target), "num_speculative_tokens": 5,
                                  "adaptive": False})
    prompts = [[5 + (3 * i + r) % 60 for i in range(4 + 6 * r)] for r in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=9 + 4 * r, ignore_eos=True) for r in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    st = llm.engine.stats
    llm.engine.kv.check_integrity()
    return ([o.outputs[0].token_ids for o in outs], st.get("spec_decode_num_draft_tokens_total"),
            st.get("spec_decode_num_accepted_tokens_total")), llm.engine.spec.proposer.chain.graphs


def test_chain_graph_replays_draft_as_the_steps_do(tiny_llama_dir, monkeypatch, device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    off, none = _run(tiny_llama_dir, monkeypatch, "0")
    on, graphs = _run(tiny_llama_dir, monkeypatch, "1")
    assert none is None and graphs is not None
    assert set(graphs.graphs) == {(b, s) for b in (1, 2, 4) for s in range(1, 5)}
    assert graphs.replays > 0
    assert on == off and on[2] == on[1] > 0  # drafting for itself: every draft accepted
