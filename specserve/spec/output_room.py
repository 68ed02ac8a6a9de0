"""How far into a k-token draft the requests of a batch can go: their output room (what is left of their
output budget or the context window, less the next token), and per draft position the share of the
batch that can still take a draft there. The adaptive controller (adaptive.py) prices drafting on it.

Where requests end together (a wave of requests with one max_tokens, a benchmark's ignore_eos load),
the batch drains at the end with every request a few tokens from its end. A k priced as if each
request could take k drafts is then priced several times too high: on the H200 pair at 64 requests
(thirtieth session) the controller drafted k = 11 at 21-31 requests of such drains, priced at 9.5
tokens a request, and the steps made 1.3-1.7. With the draft model's catch-ups (12-26 ms proposals) its
six drafting choices cost ~0.14 s of the 0.22 s by which its seven parts outlasted those of no drafts
(0.93 of them).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.spec.step_stats import count_above

if TYPE_CHECKING:
    from specserve.scheduler.request import Request


def output_rooms(reqs: Sequence[Request], max_model_len: int) -> list[int]:
    """Per request: the drafts it could take at its next proposal (base.draft_budget without the k):
    the tokens left to its output budget and to the context window, less the one the step samples
    anyway. Tokens still in flight (asynchronous scheduling) count as generated: all_token_ids holds
    their placeholders. A request that has sampled nothing yet, nor has a token in flight, is still
    computing its prompt: the next proposal is not for it (0)."""
    # (it runs over the whole batch at every priced choice: no min() calls, ~0.1 us a request)
    rooms: list[int] = []
    append = rooms.append
    for r in reqs:
        n, p = len(r.all_token_ids), len(r.prompt_token_ids)
        end = r.max_tokens + p
        append(((end if end < max_model_len else max_model_len) - n - 1) if n > p else 0)
    return rooms


def reach_shares(rooms: Sequence[int], max_k: int) -> tuple[float, ...] | None:
    """Per draft position i < max_k: the share of the requests whose room exceeds i (rounded to 1%, so
    that a controller's cached terms change only when the shares do); None where every request can
    take max_k drafts (or there are none): nothing is cut. (min first: it runs in C, and a batch
    far from its end is the common case.)"""
    if not rooms or min(rooms) >= max_k:
        return None
    n = len(rooms)
    return tuple(round(c / n, 2) for c in count_above(rooms, max_k))
