"""Draft trees (speculative/tree.py): shapes, the ancestor mask of the torch attention, and lossless
tree verification (greedy = the argmax path; sampling follows the target, by chi-square, and fails it
when the residual is not renormalized)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.attention.torch_ref import _causal_attention
from specserve.attention.tree_mask import tree_inputs, tree_layout
from specserve.sample import SamplingMetadata, compute_target_probs, tree_rejection
from specserve.sample.tree_rejection import verify_trees
from specserve.sampling_params import SamplingParams
from specserve.speculative.tree import TreeShape, accepted_kv_moves, build_tree, path_nodes, tree_shape

CPU = torch.device("cpu")
VOCAB = 8
START = 0
# Root children 1, 2, 3; node 1 (token 1) has children 4, 5 (tokens 4, 5); node 2 (token 2) a child 6 (token 1).
TOKENS = [1, 2, 3, 4, 5, 1]
PARENTS = [0, 0, 0, 1, 1, 2]


def test_build_tree_merges_shared_prefixes_within_the_shape() -> None:
    shape = TreeShape(depth=3, branching=2, budget=5)
    tokens, parents = build_tree([[7, 8, 9], [7, 8, 1], [7, 2], [3, 4], [5]], shape, budget=5)
    assert (tokens, parents) == ([7, 8, 9, 1, 2], [0, 1, 2, 2, 1])  # [3, 4], [5]: the budget is spent
    tokens, parents = build_tree([[7, 8], [3], [5]], shape, budget=9)
    assert (tokens, parents) == ([7, 8, 3], [0, 1, 0])  # a third root child exceeds the branching
    explicit = tree_shape(4, None, None, "[(0,), (1,), (0, 0)]")
    assert explicit == TreeShape(2, 2, 3, frozenset({(0,), (1,), (0, 0)}))
    assert build_tree([[7, 8, 9], [3, 4]], explicit, budget=9) == ([7, 8, 3], [0, 1, 0])  # (1, 0) not allowed
    assert tree_shape(4, None, None, None) is None and tree_shape(4, 1, 8, None) is None  # chains by default
    with pytest.raises(ValueError):
        tree_shape(4, None, None, "[(0, 0)]")  # not prefix-closed


def test_layout_positions_masks_and_kv_moves() -> None:
    depth, mask = tree_layout(PARENTS)
    assert depth.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert [bin(m) for m in mask.tolist()] == [bin(b) for b in (1, 3, 5, 9, 0b10011, 0b100011, 0b1000101)]
    positions = np.arange(10, dtype=np.int64) + 40  # one sequence, 2 query tokens before the root
    cu, seq_index = np.array([0, 9]), np.zeros(9, dtype=np.int64)
    out = tree_inputs([(2, PARENTS)], positions[:9], cu, seq_index)
    assert positions[:9].tolist() == [40, 41, 42, 43, 43, 43, 44, 44, 44]
    assert out[0] == -1 and out[1] == -1 and int(out[8]) == (0b1000101 << 2) | 3
    assert path_nodes(PARENTS, 6) == [2, 6]
    # node 2 at root + 2 moves to root + 1, node 6 at root + 6 to root + 2 (block size 4, blocks [9, 3])
    assert accepted_kv_moves([9, 3], 4, 1, [2, 6]) == ([9 * 4 + 3, 3 * 4 + 3], [9 * 4 + 2, 9 * 4 + 3])


def test_torch_attention_sees_the_committed_kv_and_ancestors_only() -> None:
    gen = torch.Generator().manual_seed(0)
    context, q_len, heads, dim = 5, len(PARENTS) + 1, 4, 16
    q = torch.randn(q_len, heads, dim, generator=gen)
    k, v = (torch.randn(context + q_len, 2, dim, generator=gen) for _ in range(2))
    _, mask = tree_layout(PARENTS)
    out = _causal_attention(q, k, v, context, 2, 0.25, torch.from_numpy(mask))
    for i in range(q_len):
        keys = list(range(context)) + [context + j for j in range(q_len) if int(mask[i]) >> j & 1]
        kk, vv = k[keys].repeat_interleave(2, dim=1), v[keys].repeat_interleave(2, dim=1)
        att = torch.einsum("hd,khd->hk", q[i], kk).mul(0.25).softmax(-1)
        torch.testing.assert_close(out[i], torch.einsum("hk,khd->hd", att, vv))
    chain = _causal_attention(q, k, v, context, 2, 0.25, torch.full((q_len,), -1))  # -1 rows: causal
    torch.testing.assert_close(chain, _causal_attention(q, k, v, context, 2, 0.25))


def _target(seed: int) -> torch.Tensor:
    """[VOCAB, VOCAB] next-token logits given the last token (a Markov target)."""
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.2
    logits[START, [1, 2, 3]] += 1.5  # the drafted siblings are likely: the later ones' acceptance matters
    logits[1, [4, 5]] += 1.0
    return logits


def _meta(params: SamplingParams, n: int) -> SamplingMetadata:
    return SamplingMetadata.build([params] * n, [[1, 2]] * n, [[] for _ in range(n)], VOCAB, CPU)


def _node_logits(target: torch.Tensor, n: int) -> torch.Tensor:
    rows = target[torch.tensor([START, *TOKENS])]  # a node's next-token logits: its own token's row
    return rows.repeat(n, 1)


def test_greedy_follows_the_argmax_path() -> None:
    for seed in range(6):
        target = _target(seed)
        out = verify_trees(
            [TOKENS], [PARENTS], [None], _node_logits(target, 1), _meta(SamplingParams(temperature=0), 1)
        )
        want, tok = [], START
        for _ in range(3):
            tok = int(target[tok].argmax())
            want.append(tok)
        got = out.output_token_ids[0]
        assert got == want[: len(got)] and len(got) == len(out.paths[0]) + 1
        assert [TOKENS[n - 1] for n in out.paths[0]] == got[:-1]


def pooled_chisquare(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * counts.sum()
    small = expected < 5
    obs, exp = np.append(counts[~small], counts[small].sum()), np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def _two_token_pvalue(num_rows: int) -> float:
    """p-value of the emitted first two tokens against target(a | START) * target(b | a); a second token
    the tree step did not emit is sampled from the target, as the next step would."""
    target, params = _target(3), SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1)
    out = verify_trees(
        [TOKENS] * num_rows,
        [PARENTS] * num_rows,
        [None] * num_rows,
        _node_logits(target, num_rows),
        _meta(params, num_rows),
        gen,
    )
    probs = compute_target_probs(target, _meta(params, VOCAB)).double()
    pairs = np.array(
        [
            (t[0], t[1] if len(t) > 1 else int(torch.multinomial(probs[t[0]], 1, generator=gen)))
            for t in out.output_token_ids
        ]
    )
    joint = (probs[START][:, None] * probs).numpy().ravel()
    return pooled_chisquare(np.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB), joint)


def test_tree_sampling_follows_the_target() -> None:
    assert _two_token_pvalue(6000) > 1e-3


def test_chi_square_catches_an_unnormalized_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(r: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
        out = r.clone()
        out[token] = 0.0
        return out  # max(0, r - q) without renormalizing: later siblings are under-accepted

    monkeypatch.setattr(tree_rejection, "residual", broken)
    assert _two_token_pvalue(6000) < 1e-6
