"""Sampled draft trees (speculative/tree_sample.py, tree_draft.py's sampled mode) verified by recursive rejection
with siblings drawn without replacement (sample/tree_rejection.py): the emitted first token and first two tokens
follow the target (chi-square), and fail it when a rejected sibling's token stays in q; the tree keeps its shape
and budget with siblings in draw order; a seeded row's first child is the keyed race's token; P-EAGLE's trees
(speculative/tree_parallel.py) branch at the first level and follow the target too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.sample import SamplingMetadata, compute_target_probs, tree_rejection
from specserve.sample.sampler import seeded_tokens
from specserve.sample.tree_rejection import verify_trees
from specserve.sampling_params import SamplingParams
from specserve.speculative.tree import TreeShape, tree_depth, tree_shape
from specserve.speculative.tree_draft import TreeDraft, add_level
from specserve.speculative.tree_parallel import ParallelTree, parallel_trees
from specserve.speculative.tree_sample import sample_children
from tests.unit.test_draft_tree import pooled_chisquare

CPU = torch.device("cpu")
VOCAB = 8
START = 0
SHAPE = TreeShape(depth=3, branching=3, budget=7)


def _markov(seed: int, scale: float) -> torch.Tensor:
    """[VOCAB, VOCAB] next-token logits given the last token."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _meta(params: SamplingParams, n: int) -> SamplingMetadata:
    return SamplingMetadata.build([params] * n, [[1, 2]] * n, [[] for _ in range(n)], VOCAB, CPU)


def _grow(n: int, draft: torch.Tensor, meta: SamplingMetadata) -> list[TreeDraft]:
    """n sampled trees of SHAPE from the Markov draft (a node's logits: its token's row; the root's: START's)."""
    trees = [TreeDraft(SHAPE, SHAPE.budget, SHAPE.depth, SHAPE.budget, sampled=True, row=i) for i in range(n)]
    add_level(trees, draft[[START] * n], meta=meta)
    while active := [t for t in trees if t.expand()]:
        add_level(active, draft[[t.tokens[c] for t in active for c in t.frontier]], meta=meta)
    return trees


def _emitted(num_rows: int, seed: int = 0) -> list[list[int]]:
    target, draft = _markov(3, 1.5), _markov(11, 1.5)
    params = SamplingParams(temperature=1.0)
    torch.manual_seed(seed)  # the drafter's draws (torch's default generator, as the chain drafters')
    trees = _grow(num_rows, draft, _meta(params, num_rows))
    tokens, parents = zip(*(t.result() for t in trees))
    node_logits = torch.cat([target[[START, *toks]] for toks in tokens])  # each tree: its root, then its nodes
    out = verify_trees(
        list(tokens),
        list(parents),
        [t.draft_probs() for t in trees],
        node_logits,
        _meta(params, num_rows),
        torch.Generator().manual_seed(seed + 1),
    )
    return out.output_token_ids


def _pvalues(num_rows: int) -> tuple[float, float]:
    """p-values of the first emitted token against target(a | START) and of the first two against
    target(a | START) * target(b | a); a second token the tree step did not emit is sampled from the target,
    as the next step would."""
    target, params = _markov(3, 1.5), SamplingParams(temperature=1.0)
    probs = compute_target_probs(target, _meta(params, VOCAB)).double()
    gen = torch.Generator().manual_seed(2)
    emitted = _emitted(num_rows)
    pairs = np.array(
        [(t[0], t[1] if len(t) > 1 else int(torch.multinomial(probs[t[0]], 1, generator=gen))) for t in emitted]
    )
    first = pooled_chisquare(np.bincount(pairs[:, 0], minlength=VOCAB), probs[START].numpy())
    joint = (probs[START][:, None] * probs).numpy().ravel()
    return first, pooled_chisquare(np.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB**2), joint)


def test_sampled_tree_shape_budget_and_draw_order() -> None:
    n, draft = 200, _markov(11, 1.5)
    meta = _meta(SamplingParams(temperature=1.0, top_k=5), n)
    for tree in _grow(n, draft, meta):
        tokens, parents = tree.result()
        q = tree.draft_probs()
        assert q is not None and q.shape == (len(tokens), VOCAB)
        assert 0 < len(tokens) <= SHAPE.budget and tree_depth(parents) <= SHAPE.depth
        assert all(p <= i for i, p in enumerate(parents))  # topological
        for p in set(parents):
            kids = [i for i, x in enumerate(parents) if x == p]
            assert len(kids) <= SHAPE.branching and len({tokens[i] for i in kids}) == len(kids)
            assert all(torch.equal(q[i], q[kids[0]]) for i in kids)  # siblings share their parent's q
            assert all(q[i][tokens[i]] > 0 for i in kids)  # drawn within q's support (top_k=5)
    branched = [t.result()[1] for t in _grow(5, draft, meta)]
    assert any(max(parents.count(p) for p in set(parents)) > 1 for parents in branched)


def test_sampled_tree_follows_an_explicit_token_tree() -> None:
    shape = tree_shape(4, None, None, "[(0,), (1,), (2,), (3,), (0, 0), (0, 2)]")  # (0, 2) without (0, 1)
    assert shape is not None
    tree, draft = TreeDraft(shape, shape.budget, shape.depth, shape.budget, sampled=True), _markov(11, 1.0)
    meta = _meta(SamplingParams(temperature=1.0), 1)
    add_level([tree], draft[[START]], meta=meta)
    while tree.expand():
        add_level([tree], draft[[tree.tokens[c] for c in tree.frontier]], meta=meta)
    # every level-1 rank, and under rank 0 only the leading listed ranks: a sampled node's children are its
    # first draws, so (0, 2) cannot follow without (0, 1)
    assert sorted(tree.path) == [(0,), (0, 0), (1,), (2,), (3,)]


def test_sampled_trees_follow_the_target() -> None:
    first, joint = _pvalues(6000)
    print(f"chi-square p-values (correct rule): first token {first:.3g}, first two {joint:.3g}")
    assert first > 1e-3 and joint > 1e-3


def test_chi_square_catches_a_rejected_sibling_left_in_q(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_rejection, "sibling_q", lambda q, drawn: q)  # as if siblings were drawn i.i.d.
    first, joint = _pvalues(6000)
    print(f"chi-square p-values (rejected sibling kept in q): first token {first:.3g}, first two {joint:.3g}")
    assert first < 1e-6 and joint < 1e-6


def test_seeded_first_child_is_the_keyed_race_token() -> None:
    draft = _markov(11, 1.5)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(40)]
    meta = SamplingMetadata.build(params, [[1, 2]] * 40, [[5] * (s % 7) for s in range(40)], VOCAB, CPU)
    logits = draft[[s % VOCAB for s in range(40)]]
    drawn = sample_children(logits, meta, 3)
    rows, race = seeded_tokens(compute_target_probs(logits, meta), meta)  # type: ignore[misc]
    assert rows.tolist() == list(range(40))
    assert [t[0] for t in drawn.tokens] == race.tolist()
    again = sample_children(logits, meta, 3)  # keyed: the same draws whatever the default generator did
    assert again.tokens == drawn.tokens


def _parallel(num_rows: int, params: SamplingParams) -> list[ParallelTree]:
    """P-EAGLE-like trees: per request 3 rows, the first START's draft row, the others fixed rows (they do not
    see the drafts before them)."""
    draft = _markov(11, 1.5)
    logits = draft[[START, 5, 6] * num_rows]
    shape = TreeShape(depth=3, branching=3, budget=5)
    torch.manual_seed(4)
    return parallel_trees(
        logits, [3] * num_rows, [5] * num_rows, shape, [params.greedy] * num_rows, None, _meta(params, num_rows)
    )


def test_parallel_trees_branch_at_the_first_level() -> None:
    draft = _markov(11, 1.5)
    (greedy,) = _parallel(1, SamplingParams(temperature=0.0))
    top = draft[START].topk(3).indices.tolist()
    assert greedy.tokens == [top[0], int(draft[5].argmax()), int(draft[6].argmax()), *top[1:]]
    assert greedy.parents == [0, 1, 2, 0, 0] and greedy.draft_probs is None
    q = compute_target_probs(draft[[START, 5, 6]], _meta(SamplingParams(temperature=1.0), 3))
    for tree in _parallel(50, SamplingParams(temperature=1.0)):
        assert tree.parents == [0, 1, 2, 0, 0] and len(set(tree.tokens[i] for i in (0, 3, 4))) == 3
        assert tree.draft_probs is not None
        assert torch.equal(tree.draft_probs, q[[0, 1, 2, 0, 0]])  # node at depth d: row d - 1's q


def test_parallel_sampled_trees_follow_the_target() -> None:
    target, params = _markov(3, 1.5), SamplingParams(temperature=1.0)
    trees = _parallel(6000, params)
    node_logits = torch.cat([target[[START, *t.tokens]] for t in trees])
    out = verify_trees(
        [t.tokens for t in trees],
        [t.parents for t in trees],
        [t.draft_probs for t in trees],
        node_logits,
        _meta(params, len(trees)),
        torch.Generator().manual_seed(5),
    )
    probs = compute_target_probs(target, _meta(params, VOCAB)).double()
    gen = torch.Generator().manual_seed(6)
    pairs = np.array(
        [
            (t[0], t[1] if len(t) > 1 else int(torch.multinomial(probs[t[0]], 1, generator=gen)))
            for t in out.output_token_ids
        ]
    )
    joint = (probs[START][:, None] * probs).numpy().ravel()
    p = pooled_chisquare(np.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB**2), joint)
    print(f"chi-square p-value (P-EAGLE trees, first two tokens): {p:.3g}")
    assert p > 1e-3
