"""spec/shadow.py: the would-be outcome of n-gram drafts, measured from the token history."""
from __future__ import annotations

from types import SimpleNamespace

from specserve.spec.ngram import find_draft
from specserve.spec.shadow import ShadowDrafts
from specserve.spec.step_stats import count_above, verify_counts


def _req(prompt: list[int], output: list[int], pending: int = 0) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=prompt, all_token_ids=prompt + output, num_pending_tokens=pending)


def test_a_repeating_answer_would_have_accepted_every_draft() -> None:
    req = _req([1, 2, 3], [7, 8, 9] * 6)
    asked, drafted, reached, accepted = ShadowDrafts(4, 1, 3).sample([req])
    # the latest earlier match leaves three tokens after it (the proposer drafts the same)
    assert asked == (1, 1, 1, 1) and drafted == (1, 1, 1, 0)
    assert reached == accepted == (1, 1, 1)


def test_counts_are_the_matched_prefix_of_the_draft_the_proposer_would_have_made() -> None:
    req = _req([1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8, 5, 6])  # the pattern breaks two tokens into the last four
    draft = find_draft(req.all_token_ids[:-4], 1, 3, 4)  # what NgramProposer would have proposed before them
    assert draft == [7, 8, 9]  # the lookup had three tokens to give
    got = ShadowDrafts(4, 1, 3).sample([req])
    assert got == (count_above([4], 4), count_above([3], 4), *verify_counts([3], [2]))
    assert got[2:] == ((1, 1, 1), (1, 1, 0))  # positions 0-2 verified, 0-1 accepted


def test_pending_tokens_and_prompts_are_not_an_answer_yet() -> None:
    shadow = ShadowDrafts(4, 1, 3)
    assert shadow.sample([_req([7, 8, 9] * 4, [7, 8, 9, 7])]) is None  # 4 tokens: no draft came before them
    # the last known tokens repeat; the pending slot (a placeholder 0) must not count as a miss
    req = _req([1, 2, 3], [7, 8, 9] * 4 + [0], pending=1)
    assert shadow.sample([req])[2:] == ((1, 1, 1), (1, 1, 1))


def test_no_match_is_a_draft_that_fails_and_no_history_is_no_draft() -> None:
    misses = ShadowDrafts(2, 1, 3).sample([_req([1, 2], [5, 6, 5, 9, 9])])  # [5, 6, 5] then 9, 9 after "5"
    assert misses == ((1, 1), (1, 1), (1, 0), (0, 0))  # drafted [6, 5]: position 0 reached, rejected
    empty = ShadowDrafts(2, 1, 3).sample([_req([1, 2], [3, 4, 5, 6])])  # nothing ever repeats
    assert empty == ((1, 1), (0, 0), (), ())


def test_round_robin_over_the_batch() -> None:
    reqs = [_req([i], [7, 8, 9] * 3) for i in range(5)]
    shadow, seen = ShadowDrafts(2, 1, 3, per_step=2), []
    for _ in range(5):
        before = shadow._cursor
        assert shadow.sample(reqs)[0] == (2, 2)
        seen += [(before + j) % 5 for j in range(2)]
    assert sorted(set(seen)) == [0, 1, 2, 3, 4]
