"""spec/draft_chain.py: a draft model's chained steps as one graph (run eagerly on the CPU) draft what
the per-step path drafts: the same tokens, drafts and acceptance, with rows of different k (requests
near their max_tokens), a padded batch size, and a seeded random row (which falls back)."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def other_draft(tiny_llama_dir, tmp_path_factory):
    """A draft that disagrees with the target now and then: the target's weights plus noise."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(0)
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    noisy = {k: v + 0.5 * v.float().std() * torch.randn(v.shape, generator=gen).to(v.dtype) if v.dim() == 2 else v
             for k, v in weights.items()}
    save_file(noisy, str(out / "model.safetensors"))
    return out


def _run(target, draft, monkeypatch, chain: str, params: list[SamplingParams]):
    monkeypatch.setenv("SPECSERVE_DRAFT_CHAIN_GRAPH", chain)
    llm = LLM(model=str(target), progress=False, kv_cache_memory_bytes=4 << 20,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 5,
                                  "adaptive": False})
    prompts = [[5 + (3 * i + r) % 60 for i in range(4 + 6 * r)] for r in range(len(params))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    st = llm.engine.stats
    graphs = llm.engine.spec.proposer.chain.graphs
    llm.engine.kv.check_integrity()
    return ([o.outputs[0].token_ids for o in outs], st.get("spec_decode_num_draft_tokens_total"),
            st.get("spec_decode_num_accepted_tokens_total"), graphs)


@pytest.mark.parametrize("which", ["self", "other"])
def test_chain_graph_drafts_as_the_steps_do(tiny_llama_dir, other_draft, monkeypatch, which) -> None:
    draft = tiny_llama_dir if which == "self" else other_draft
    # Three requests (padded to a chain of 4 rows), budgets that end mid-draft (rows with fewer steps).
    params = [SamplingParams(temperature=0.0, max_tokens=9 + 4 * r, ignore_eos=True) for r in range(3)]
    *off, none = _run(tiny_llama_dir, draft, monkeypatch, "0", params)
    *on, graphs = _run(tiny_llama_dir, draft, monkeypatch, "1", params)
    assert none is None and graphs is not None and graphs.replays > 0
    assert on == off and on[1] > 0
    if which == "self":  # a model drafting for itself: every draft accepted
        assert on[2] == on[1]
    else:
        assert 0 < on[2] < on[1]


def test_random_rows_fall_back(tiny_llama_dir, other_draft, monkeypatch) -> None:
    """A seeded random request in the batch: the per-step path drafts (its sampling between steps);
    outputs as with the chain off."""
    params = [SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    *off, _ = _run(tiny_llama_dir, other_draft, monkeypatch, "0", params)
    *on, graphs = _run(tiny_llama_dir, other_draft, monkeypatch, "1", params)
    assert on == off
    # The greedy request ends first: it never proposes without the random one beside it.
    assert graphs.replays == 0
