"""Drafting within the scheduler's token budget (AdaptiveController._budget_shares).

A step verifies at most max_num_batched_tokens tokens, and the prompts of the requests that replace finished
ones need their share of the same budget. On the H200 pair at 256 requests (twenty-ninth session, 2,048
tokens, ~172-token prompts, 128 output tokens) k = 10 was priced at 46k tokens/s against 33k for no drafts,
and fixed k = 12 made 15.9k against no drafts' 28.5k: 256 requests of 11 verified tokens and ~13 prompt
tokens each asked for 3x the budget."""
from __future__ import annotations

import pytest

from specserve.config import SpeculativeConfig
from specserve.spec.adaptive import AdaptiveController
from tests.helpers.spec_world import World, run_serving

K = 12
CFG = SpeculativeConfig(method="ngram", num_speculative_tokens=K)
PROMPT, OUTPUT = 172, 128


def served_world() -> tuple[AdaptiveController, World]:
    """256 requests where drafting is nearly free (a lookup, verify steps barely dearer than decode steps)."""
    world = World(256, alpha=0.95, step_s=0.004, per_token_s=2e-7, lookup_s=1e-6, graph_qs=tuple(range(1, K + 2)),
                  fill=(1.0,) * K, output_len=OUTPUT, prompt_len=PROMPT, prompt_tok_s=1e-6)
    ctrl = AdaptiveController(CFG)
    run_serving(world, ctrl, 600)
    return ctrl, world


def test_each_k_is_priced_at_the_share_of_the_batch_the_budget_serves() -> None:
    ctrl, _ = served_world()
    rho = ctrl.costs.prompt_tokens_per_output()
    assert rho == pytest.approx(PROMPT / OUTPUT, rel=0.15)  # (measured from the arrivals)
    free = ctrl.estimate(256)
    ctrl.token_budget = 2048
    est = ctrl.estimate(256)
    for k in range(K + 1):
        verified = 1.0 + sum(est.fill_per_pos[:k])
        share = min(1.0, 2048 / (256 * (verified + rho * est.expected_tokens[k])))
        assert est.tokens_per_s[k] == pytest.approx(free.tokens_per_s[k] * share, rel=1e-6)
    assert est.tokens_per_s[0] == free.tokens_per_s[0]  # 256 x (1 + 1.3) tokens fit
    # without the budget the deepest drafts look fastest; within it a few do, and K makes less than half
    fastest = max(range(K + 1), key=est.tokens_per_s.__getitem__)
    assert max(range(K + 1), key=free.tokens_per_s.__getitem__) >= K - 1
    assert 1 <= fastest <= 4
    assert est.tokens_per_s[K] < 0.5 * free.tokens_per_s[K]


def test_without_a_budget_nothing_changes() -> None:
    ctrl, _ = served_world()
    before = ctrl.estimate(256)
    ctrl.token_budget = 10 ** 9
    assert ctrl.estimate(256).tokens_per_s == before.tokens_per_s
