"""What a step measured (specserve/spec/step_stats.py): per-position counts of drafts and acceptances."""
from __future__ import annotations

from specserve.spec.step_stats import ProposalStats, count_above, verify_counts


def test_position_counts() -> None:
    assert count_above([3, 0, 5], 4) == (2, 2, 2, 1)
    assert count_above([], 0) == () and count_above([2], 3) == (1, 1, 0)
    # drafts (3, 2, 0, 4, 1) with (3, 0, 0, 2, 1) accepted: position 2 is reached by the 1st and 4th
    assert verify_counts([3, 2, 0, 4, 1], [3, 0, 0, 2, 1]) == ((4, 2, 2, 0), (3, 2, 1, 0))
    assert verify_counts([], []) == ((), ())
    p = ProposalStats.measure(3, [3, 3, 1], [3, 0, 1], 0.002)
    assert (p.num_seqs, p.asked_per_pos, p.drafted_per_pos) == (3, (3, 2, 2), (2, 1, 1))
