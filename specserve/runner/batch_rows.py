"""A step's queries as flat rows: token ids, query lengths, computed lengths, logits rows. Two builders
with one result: a per-request loop (cheapest for a few requests) and a vectorized one whose Python
work per request is a few list-comprehension reads, the rest numpy over the batch."""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import numpy as np

from specserve.runner.block_tables import ranks
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import ScheduledRequest

# At and above this many requests the vectorized builder is the faster (bench/host_step.py).
VECTORIZE_MIN_SEQS = 32


class QueryRows(NamedTuple):
    input_ids: np.ndarray  # [num_tokens] int64
    query_lens: np.ndarray  # [num_seqs] int64
    computed: np.ndarray  # [num_seqs] int64: tokens already in the KV cache before the step
    cu_query_lens: np.ndarray  # [num_seqs + 1] int64
    logits_indices: np.ndarray  # [num_logit_rows] int64: flat token index of each row to score
    logit_rows: list[tuple[int, int] | None]  # per request: (first logit row, number of rows) or None
    request_ids: list[str]


def query_rows(scheduled: list[ScheduledRequest], vectorized: bool | None = None) -> QueryRows:
    """vectorized: None picks by batch size."""
    if vectorized is None:
        vectorized = len(scheduled) >= VECTORIZE_MIN_SEQS
    return rows_vectorized(scheduled) if vectorized else rows_loop(scheduled)


def query_tokens(req: Request, c: int, n: int) -> list[int]:
    """The n query tokens of req from computed position c: known tokens, then drafts under verification."""
    tokens = req.all_token_ids[c : c + n]
    if len(tokens) < n:
        tokens = tokens + req.spec_token_ids[: n - len(tokens)]
    return tokens


def rows_loop(scheduled: list[ScheduledRequest]) -> QueryRows:
    ids: list[int] = []
    query_lens, computed, cu = [], [], [0]
    logits_idx: list[int] = []
    logit_rows: list[tuple[int, int] | None] = []
    for s in scheduled:
        n, c = s.num_new_tokens, s.request.num_computed_tokens
        ids.extend(query_tokens(s.request, c, n))
        query_lens.append(n)
        computed.append(c)
        if s.samples:  # a sampling request scores its last rows tokens (its drafts and the one before)
            rows = s.num_spec_tokens + 1
            logit_rows.append((len(logits_idx), rows))
            logits_idx.extend(range(cu[-1] + n - rows, cu[-1] + n))
        else:
            logit_rows.append(None)
        cu.append(cu[-1] + n)
    i64 = np.int64
    arrays = (np.array(ids, i64), np.array(query_lens, i64), np.array(computed, i64), np.array(cu, i64))
    request_ids = [s.request.request_id for s in scheduled]
    return QueryRows(*arrays, np.array(logits_idx, dtype=i64), logit_rows, request_ids)


def rows_vectorized(scheduled: list[ScheduledRequest]) -> QueryRows:
    """Rows whose query is not "one known token, then none or all of the request's drafts" (prefill
    chunks) are sliced one by one: their tokens are O(tokens) work anyway."""
    ns = len(scheduled)
    # One list comprehension per field (the cheapest Python read), then one conversion for all of them.
    reqs = [s.request for s in scheduled]
    c_list = [r.num_computed_tokens for r in reqs]
    token_lists = [r.all_token_ids for r in reqs]
    num_tokens_list = list(map(len, token_lists))
    try:  # the token at each query's start
        first_list = [t[i] for t, i in zip(token_lists, c_list)]
    except IndexError:  # a query of drafts only: 0 here, and the row goes the slow way below
        first_list = [t[i] if i < k else 0 for t, i, k in zip(token_lists, c_list, num_tokens_list)]
    fields = [[s.num_new_tokens for s in scheduled], [s.num_spec_tokens for s in scheduled]]
    table = np.array([*fields, c_list, num_tokens_list, first_list], dtype=np.int64).reshape(5, ns)
    n, spec, c, num_tokens, first = table
    known = np.minimum(np.maximum(num_tokens - c, 0), n)  # query tokens from all_token_ids; the rest: drafts
    drafts = n - known
    draft_rows = np.flatnonzero(drafts).tolist()
    draft_lists = {i: reqs[i].spec_token_ids for i in draft_rows}
    num_drafts = np.zeros(ns, dtype=np.int64)
    num_drafts[draft_rows] = np.fromiter(map(len, draft_lists.values()), np.int64, len(draft_rows))
    simple = (known == 1) & ((drafts == 0) | (drafts == num_drafts))
    cu = np.zeros(ns + 1, dtype=np.int64)
    np.cumsum(n, out=cu[1:])
    ids = np.empty(int(cu[-1]), dtype=np.int64)
    ids[cu[:-1][simple]] = first[simple]
    with_drafts = np.flatnonzero(simple & (drafts > 0))
    if with_drafts.size:
        dn = drafts[with_drafts]
        flat = chain.from_iterable(draft_lists[i] for i in with_drafts.tolist())
        ids[np.repeat(cu[with_drafts] + 1, dn) + ranks(dn)] = np.fromiter(flat, np.int64, int(dn.sum()))
    for i in np.flatnonzero(~simple).tolist():
        ids[cu[i] : cu[i + 1]] = query_tokens(reqs[i], c_list[i], int(n[i]))
    logits_indices, logit_rows = _logit_rows(c + n - spec >= num_tokens, spec + 1, cu)
    return QueryRows(ids, n, c, cu, logits_indices, logit_rows, [r.request_id for r in reqs])


def _logit_rows(
    samples: np.ndarray, rows: np.ndarray, cu: np.ndarray
) -> tuple[np.ndarray, list[tuple[int, int] | None]]:
    """(flat token index of each logits row, per request (first logits row, rows) or None): a sampling
    request scores its last `rows` tokens (its drafts and the token before them)."""
    sampled = np.flatnonzero(samples)
    r = rows[sampled]
    logits_indices = np.repeat(cu[sampled + 1] - r, r) + ranks(r)
    pairs: list[tuple[int, int] | None] = list(zip((np.cumsum(r) - r).tolist(), r.tolist()))
    if sampled.size == len(samples):
        return logits_indices, pairs
    logit_rows: list[tuple[int, int] | None] = [None] * len(samples)
    for i, pair in zip(sampled.tolist(), pairs):
        logit_rows[i] = pair
    return logits_indices, logit_rows
