"""Sampled draft trees in the engine: random requests' trees are drawn from the drafter's distribution (draft
model, EAGLE, EAGLE-3, P-EAGLE, a reduced draft vocabulary) and carry it to verification; a seeded request's
tokens equal the plain engine's at temperature 1, alone and batched with greedy and unseeded requests (as
test_spec_seeded_load.py checks for chains), and a draft model drafting for itself gets its trees accepted."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from tests.helpers.eagle_heads import make_random_head_dir

TREE = {"num_speculative_tokens": 3, "adaptive": False, "tree_branching": 2, "tree_node_budget": 5}
PROMPT = {"prompt_token_ids": [11, 42, 7, 99, 23] * 6}
OTHER = {"prompt_token_ids": [5, 6, 7] * 5}
SEEDED = SamplingParams(temperature=1.0, top_k=20, seed=1234, max_tokens=24, ignore_eos=True)
UNSEEDED = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
KW = {"progress": False, "kv_cache_memory_bytes": 4 << 20, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> tuple[list[int], list[int]]:
    llm = LLM(model=str(tiny_llama_dir), **KW)
    return llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids, llm.generate(OTHER, GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def drafters(tiny_llama_dir, tmp_path_factory) -> dict[str, dict]:
    base, target = tmp_path_factory.mktemp("sampled-trees"), str(tiny_llama_dir)
    reduced = list(range(0, 384, 2))  # ascending target ids: a reduced draft vocabulary
    return {
        "draft_model": {"method": "draft_model", "model": target},  # the target drafting for itself
        "eagle": {"method": "eagle", "model": str(make_random_head_dir(target, base / "eagle", "eagle"))},
        "eagle3": {"method": "eagle3", "model": str(make_random_head_dir(target, base / "eagle3", "eagle3"))},
        "p-eagle": {  # one parallel forward: the first level branches
            "method": "eagle3",
            "model": str(make_random_head_dir(target, base / "p-eagle", "eagle3", num_mask_slots=2)),
            "parallel_drafting": True,
        },
        "eagle3-reduced": {
            "method": "eagle3",
            "model": str(make_random_head_dir(target, base / "eagle3-r", "eagle3", d2t=reduced)),
        },
    }


@pytest.mark.parametrize("name", ["draft_model", "eagle", "eagle3", "p-eagle", "eagle3-reduced"])
def test_seeded_sampled_trees_equal_plain_sampling(tiny_llama_dir, plain, drafters, name) -> None:
    llm = LLM(model=str(tiny_llama_dir), **KW, speculative_config={**drafters[name], **TREE})
    proposer, trees = llm.engine.spec.proposer, []
    real = proposer.propose_tree

    def recording(inp, shape) -> None:
        real(inp, shape)
        for r in inp.requests:
            trees.append((r.params.temperature, r.spec_token_ids, r.spec_tree_parents, r.spec_draft_probs))

    proposer.propose_tree = recording
    assert llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids == plain[0]
    sampled = [(toks, par, q) for temp, toks, par, q in trees if temp > 0 and toks]
    assert sampled and all(q is not None and q.shape[0] == len(toks) for toks, _, q in sampled)
    assert any(par is not None and max(par.count(p) for p in set(par)) > 1 for _, par, _ in sampled)
    for toks, _, q in sampled:  # every node drawn from its q
        assert all(float(q[i, t]) > 0 for i, t in enumerate(toks))
    if name == "draft_model":  # q is the target's own distribution and the root race its keyed one
        stats = llm.engine.stats
        drafts = stats.get("spec_decode_num_drafts_total")
        assert stats.get("spec_decode_num_accepted_tokens_total") >= 1.5 * drafts, drafts
    trees.clear()
    batch = llm.generate([PROMPT, OTHER, PROMPT], [SEEDED, GREEDY, UNSEEDED])
    assert batch[0].outputs[0].token_ids == plain[0] and batch[1].outputs[0].token_ids == plain[1]
    assert len(batch[2].outputs[0].token_ids) == UNSEEDED.max_tokens
    greedy_trees = [q for temp, toks, _, q in trees if temp == 0 and toks]
    assert greedy_trees and all(q is None for q in greedy_trees)  # greedy rows keep top-k trees (one-hot)
    llm.engine.kv.check_integrity()
    assert llm.engine.num_blocks_in_use() == 0
