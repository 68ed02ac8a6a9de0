"""Tree drafting by model drafters (speculative/tree_draft.py): the best-first tree within the shape and the
budget, closed under ancestors; the draft model drafts real trees (a node with several children) and stays
lossless; after a tree step the accepted nodes' target features sit at their depths' rows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from specserve import LLM, SamplingParams
from specserve.speculative.decoder import SpecDecoder
from specserve.speculative.tree import TreeShape, tree_depth, tree_shape
from specserve.speculative.tree_draft import TreeDraft, add_level


def _grow(tree: TreeDraft, vocab: int, seed: int) -> None:
    """Expand with random distributions until the tree is done."""
    gen = torch.Generator().manual_seed(seed)
    add_level([tree], torch.randn(1, vocab, generator=gen))
    while tree.expand():
        assert len(tree.frontier) <= tree.shape.branching and len(tree.fed) <= tree.max_fed
        add_level([tree], torch.randn(len(tree.frontier), vocab, generator=gen))


def test_tree_is_best_first_within_shape_and_budget() -> None:
    for seed in range(20):
        shape = TreeShape(depth=4, branching=3, budget=9)
        tree = TreeDraft(shape, 9, 4, 9)
        _grow(tree, 16, seed)
        tokens, parents = tree.result()
        assert len(tokens) == 9 and tree_depth(parents) <= 4
        assert all(p <= i for i, p in enumerate(parents))  # topological: a parent comes first
        assert max(parents.count(n) for n in set(parents)) <= 3
        assert len(tree.tokens) > 9  # more proposed than kept
        siblings = {}
        for i, p in enumerate(parents):
            assert tokens[i] not in siblings.setdefault(p, set())  # distinct tokens among siblings
            siblings[p].add(tokens[i])


def test_tree_follows_an_explicit_token_tree() -> None:
    shape = tree_shape(4, None, None, "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]")
    assert shape is not None
    tree = TreeDraft(shape, shape.budget, shape.depth, shape.budget)
    _grow(tree, 16, 0)
    tokens, parents = tree.result()
    assert sorted(tree.path[c] for c in range(len(tree.tokens))) == sorted(shape.paths)
    assert len(tokens) == 5 and tree_depth(parents) == 3


def test_draft_model_drafts_real_trees_within_the_budget(tiny_llama_dir) -> None:
    model = str(tiny_llama_dir)
    cfg = {"method": "draft_model", "model": model, "num_speculative_tokens": 3, "adaptive": False}
    tree = {"tree_branching": 2, "tree_node_budget": 5}
    kw = {"progress": False, "kv_cache_memory_bytes": 4 << 20}
    prompts = [{"prompt_token_ids": [11, 42, 7, 99, 23] * 3}, {"prompt_token_ids": [5, 6, 7, 8]}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=model, **kw).generate(prompts, params)]
    llm = LLM(model=model, **kw, speculative_config={**cfg, **tree})
    proposer, trees = llm.engine.spec.proposer, []
    real = proposer.propose_tree

    def recording(inp, shape) -> None:
        real(inp, shape)
        trees.extend((r.spec_token_ids, r.spec_tree_parents, n) for r, n in zip(inp.requests, inp.num_draft_tokens))

    proposer.propose_tree = recording
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert trees and all(len(t) <= min(n, 5) for t, _, n in trees)
    branched = [p for _, p, _ in trees if p is not None and max(p.count(n) for n in set(p)) > 1]
    assert branched and all(tree_depth(p) <= 3 for p in branched)
    assert llm.engine.stats.get("spec_decode_num_accepted_tokens_total") > 0  # the draft is the target


def test_accepted_tree_features_move_to_their_depth_rows() -> None:
    dec = object.__new__(SpecDecoder)
    dec.proposer = SimpleNamespace(needs_target_hidden=True)
    dec.runner = SimpleNamespace(device=torch.device("cpu"))
    dec._paths = {"b": [2, 4]}  # request b's accepted nodes: 2 at depth 1, then 4
    sched = SimpleNamespace(
        scheduled=[
            SimpleNamespace(request=SimpleNamespace(request_id="a"), num_spec_tokens=0),
            SimpleNamespace(request=SimpleNamespace(request_id="b"), num_spec_tokens=4),
        ]
    )
    hidden = torch.arange(7.0)[:, None].repeat(1, 2)  # rows: a's one token, then b's root and 4 nodes, then ...
    aux = [hidden.clone() * 10]
    step = SimpleNamespace(host=SimpleNamespace(cu_query_lens=np.array([0, 1, 6])), all_hidden=hidden, aux_hidden=aux)
    dec._move_features(sched, step)
    assert hidden[:, 0].tolist() == [0, 1, 3, 5, 4, 5, 6] and aux[0][:, 0].tolist() == [0, 10, 30, 50, 40, 50, 60]
    assert dec._paths == {}
