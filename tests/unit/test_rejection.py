"""Rejection sampler: lossless against the target distribution, exact for greedy rows (CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.sample import RejectionSampler, SamplingMetadata, compute_target_probs
from specserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 8
START = 0  # context token every simulated sequence starts from
PROMPT = [1, 2]  # every row's prompt (the repetition penalty counts it)
NUM_ROWS = 20_000  # sequences per distribution test; the chi-square sees NUM_ROWS pairs
FILTERS = {"none": {}, "filtered": {"temperature": 0.8, "top_k": 5, "top_p": 0.85}}
SEEDS = {(k, f): 100 * i + j for i, k in enumerate([1, 2, 3, 4, "mixed"]) for j, f in enumerate(FILTERS)}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """These tensors are tiny: intra-op threads only add contention on a 2-core runner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    vocab: int = VOCAB,
    stop_ids: list[list[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [PROMPT] * n, outputs or [[] for _ in range(n)], vocab, CPU, stop_ids)


def pooled_chisquare(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of a chi-square test; cells expecting < 5 draws are pooled into one."""
    expected = expected_probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


class MarkovPair:
    """A toy target and a nearby draft model: next-token logits depend on the last token only."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.target = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5  # [context, next]
        self.draft = self.target + torch.randn(VOCAB, VOCAB, generator=gen)

    def propose(
        self,
        contexts: torch.Tensor,
        num_drafts: list[int],
        one_hot: bool,
        gen: torch.Generator,
        draft_params: SamplingParams | None = None,
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Drafts chained from each context; random ones sampled from softmax(draft), or with
        draft_params from compute_target_probs(draft) (as DraftSampler filters a request's drafts)."""
        max_k = max(num_drafts, default=0)
        tokens, probs, ctx = [], [], contexts
        for _ in range(max_k):
            draft_probs = (
                self.draft[ctx].softmax(-1)
                if draft_params is None  # [rows, vocab]
                else compute_target_probs(self.draft[ctx], build([draft_params] * len(ctx)))
            )
            ctx = draft_probs.argmax(-1) if one_hot else torch.multinomial(draft_probs, 1, generator=gen)[:, 0]
            tokens.append(ctx)
            probs.append(draft_probs)
        if max_k == 0:
            return [[] for _ in num_drafts], None if one_hot else torch.empty(0, VOCAB)
        drafts = [row[:k] for row, k in zip(torch.stack(tokens, 1).tolist(), num_drafts)]
        valid = torch.arange(max_k)[None, :] < torch.tensor(num_drafts)[:, None]
        return drafts, None if one_hot else torch.stack(probs, 1)[valid]  # row-major = concatenated

    def target_logits(self, contexts: list[int], drafts: list[list[int]]) -> torch.Tensor:
        flat = [c for ctx, row in zip(contexts, drafts) for c in [ctx, *row]]
        return self.target[torch.tensor(flat)]  # [total_drafts + rows, vocab]


def generate_prefix(
    pair: MarkovPair,
    params: list[SamplingParams],
    num_drafts: list[int],
    one_hot: bool,
    seed: int,
    length: int = 2,
    draft_params: SamplingParams | None = None,
) -> np.ndarray:
    """Speculatively decode until every row has >= length tokens: [rows, length] first tokens."""
    gen = torch.Generator().manual_seed(seed)
    sampler = RejectionSampler(torch.Generator().manual_seed(seed + 1))
    generated: list[list[int]] = [[] for _ in params]
    while True:
        rows = [i for i, out in enumerate(generated) if len(out) < length]
        if not rows:
            return np.array([out[:length] for out in generated])
        contexts = [generated[i][-1] if generated[i] else START for i in rows]
        drafts, draft_probs = pair.propose(
            torch.tensor(contexts), [num_drafts[i] for i in rows], one_hot, gen, draft_params
        )
        meta = build([params[i] for i in rows], outputs=[generated[i] for i in rows])
        out = sampler(drafts, draft_probs, pair.target_logits(contexts, drafts), meta)
        for i, tokens, n, row_drafts in zip(rows, out.output_token_ids, out.num_accepted, drafts):
            assert len(tokens) == n + 1 and tokens[:n] == row_drafts[:n]
            generated[i].extend(tokens)


@pytest.mark.parametrize("k", [1, 2, 3, 4, "mixed"])
@pytest.mark.parametrize("filters", list(FILTERS))
@pytest.mark.parametrize("one_hot", [False, True], ids=["random_drafts", "one_hot_drafts"])
def test_output_follows_the_target_distribution(k: int | str, filters: str, one_hot: bool) -> None:
    """Joint of the first two emitted tokens == target(a | START) * target(b | a), by chi-square."""
    num_rows = NUM_ROWS
    pair = MarkovPair(seed=11)
    params = SamplingParams(**FILTERS[filters])
    num_drafts = [i % 5 for i in range(num_rows)] if k == "mixed" else [k] * num_rows
    pairs = generate_prefix(pair, [params] * num_rows, num_drafts, one_hot, seed=SEEDS[k, filters])
    probs = compute_target_probs(pair.target, build([params] * VOCAB)).double().numpy()  # [ctx, next]
    if filters == "filtered":
        assert (probs > 0).sum(-1).max() <= 5
    joint = probs[START][:, None] * probs  # [a, b]
    counts = np.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    assert counts[joint.ravel() == 0].sum() == 0, "emitted a token outside the top-k/top-p set"
    assert pooled_chisquare(counts, joint.ravel()) > 1e-3
    first = np.bincount(pairs[:, 0], minlength=VOCAB)
    second = np.bincount(pairs[:, 1], minlength=VOCAB)
    assert pooled_chisquare(first, probs[START]) > 1e-3
    assert pooled_chisquare(second, probs[START] @ probs) > 1e-3


@pytest.mark.parametrize("one_hot", [False, True], ids=["random_drafts", "one_hot_drafts"])
def test_seeded_rows_follow_the_target_and_ignore_k(one_hot: bool) -> None:
    """Rows seeded 0..NUM_ROWS-1: the first two tokens follow the target joint (chi-square over seeds) and
    are the same with k = 0 (no drafts), 1, 3 and mixed k, whatever the drafts."""
    pair = MarkovPair(seed=14)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(NUM_ROWS)]
    runs = [
        generate_prefix(pair, params, num_drafts, one_hot, seed=21 + i)
        for i, num_drafts in enumerate(
            [[0] * NUM_ROWS, [1] * NUM_ROWS, [3] * NUM_ROWS, [i % 5 for i in range(NUM_ROWS)]]
        )
    ]
    for run in runs[1:]:
        assert (run == runs[0]).all()
    probs = compute_target_probs(pair.target, build([SamplingParams()] * VOCAB)).double().numpy()
    counts = np.bincount(runs[0][:, 0] * VOCAB + runs[0][:, 1], minlength=VOCAB * VOCAB)
    assert pooled_chisquare(counts, (probs[START][:, None] * probs).ravel()) > 1e-3


def test_mixed_greedy_and_random_rows_in_one_batch() -> None:
    num_rows = NUM_ROWS
    pair = MarkovPair(seed=12)
    random_params = SamplingParams(temperature=0.9, top_p=0.9)
    params = [SamplingParams(temperature=0.0) if i % 3 == 0 else random_params for i in range(num_rows)]
    pairs = generate_prefix(pair, params, [1 + i % 4 for i in range(num_rows)], one_hot=False, seed=5)
    first_greedy = int(pair.target[START].argmax())
    assert (pairs[::3] == [first_greedy, int(pair.target[first_greedy].argmax())]).all()
    probs = compute_target_probs(pair.target, build([random_params] * VOCAB)).double().numpy()
    random_rows = pairs[np.arange(num_rows) % 3 != 0]
    counts = np.bincount(random_rows[:, 0] * VOCAB + random_rows[:, 1], minlength=VOCAB * VOCAB)
    joint = (probs[START][:, None] * probs).ravel()
    assert counts[joint == 0].sum() == 0
    assert pooled_chisquare(counts, joint) > 1e-3


# The filters below are checked against an independent numpy reference of the sampler's semantics
# (penalties -> temperature -> min_p -> softmax), not against compute_target_probs: a stage that
# verification skipped or reordered would otherwise change the expectation along with the output.
LENGTH = 3  # tokens checked per sequence: with k = 2 drafts, draft positions 0, 1 and the bonus
FILTER_ROWS = 12_000  # sequences per case: enough power for these effects, ~0.5 s a case
# Each keeps 3-6 of the 8 tokens per context; at T = 1.3 applying min-p before the temperature
# would keep other sets (7 tokens over the 8 contexts).
MIN_P = {"min_p=0.1": {"min_p": 0.1}, "min_p=0.2,T=1.3": {"min_p": 0.2, "temperature": 1.3}}
PENALTIES = {
    "repetition": {"repetition_penalty": 1.8},
    "presence+frequency": {"presence_penalty": 1.0, "frequency_penalty": 0.6},
    "all+min_p,T=0.8": {
        "repetition_penalty": 1.5,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.4,
        "min_p": 0.1,
        "temperature": 0.8,
    },
}
# one_hot: argmax drafts (draft_probs None); raw: sampled from softmax(draft), unfiltered (min-p on
# the target side only, still lossless); filtered: sampled from the draft logits after the request's
# temperature and min-p (DraftSampler's way), so draft_probs have zeros too.
DRAFTS = ["one_hot", "raw", "filtered"]


def reference_probs(logits: np.ndarray, params: SamplingParams, output: list[int]) -> np.ndarray:
    """[vocab] float64: the distribution the plain sampler draws the next token from, after
    `output` (prompt PROMPT), per the documented semantics (sample/penalties.py, sampler.py)."""
    x = logits.astype(np.float64).copy()
    seen = sorted(set(PROMPT) | set(output))
    x[seen] = np.where(x[seen] < 0, x[seen] * params.repetition_penalty, x[seen] / params.repetition_penalty)
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(x))
    x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    probs = np.exp((x - x.max()) / params.temperature)
    ratio = probs / probs.max()
    # float32 rounding in the sampler could flip a token sitting on the threshold: keep clear of it.
    assert params.min_p == 0 or np.abs(ratio / params.min_p - 1).min() > 1e-3
    probs[ratio < params.min_p] = 0.0
    return probs / probs.sum()


def reference_joint(pair: MarkovPair, params: SamplingParams, length: int) -> np.ndarray:
    """[vocab] * length: probability of each sequence of the first `length` tokens."""
    target = pair.target.double().numpy()

    def extend(prefix: list[int]) -> np.ndarray:
        probs = reference_probs(target[prefix[-1] if prefix else START], params, prefix)
        if len(prefix) + 1 == length:
            return probs
        rest = (VOCAB,) * (length - len(prefix) - 1)
        return np.stack([p * extend(prefix + [t]) if p > 0 else np.zeros(rest) for t, p in enumerate(probs)])

    return extend([])


def assert_follows(seqs: np.ndarray, joint: np.ndarray) -> None:
    """seqs [rows, length] ~ joint, by chi-square on the joint and on each position's marginal;
    never a sequence of probability 0 (e.g. with a token min-p removed)."""
    length = seqs.shape[1]
    counts = np.bincount(np.ravel_multi_index(tuple(seqs.T), joint.shape), minlength=joint.size)
    assert counts[joint.ravel() == 0].sum() == 0, "emitted a token the filters removed"
    assert pooled_chisquare(counts, joint.ravel()) > 1e-3
    for j in range(length):
        marginal = joint.sum(axis=tuple(a for a in range(length) if a != j))
        assert pooled_chisquare(np.bincount(seqs[:, j], minlength=VOCAB), marginal) > 1e-3, f"token {j}"


def run_filter_case(params: SamplingParams, drafts: str, k: int | str, seed: int) -> None:
    pair = MarkovPair(seed=13)
    num_drafts = [i % 5 for i in range(FILTER_ROWS)] if k == "mixed" else [k] * FILTER_ROWS
    draft_params = None
    if drafts == "filtered":  # DraftSampler applies the request's params; penalties are not used here
        draft_params = SamplingParams(temperature=params.temperature, min_p=params.min_p)
    seqs = generate_prefix(pair, [params] * FILTER_ROWS, num_drafts, drafts == "one_hot", seed, LENGTH, draft_params)
    assert_follows(seqs, reference_joint(pair, params, LENGTH))


def filter_cases(settings: list[str], drafts: list[str], mixed: list[tuple[str, str]]) -> list:
    """Every setting x drafts with k = 2, plus the (setting, drafts) pairs in `mixed` with 0-4 drafts
    per row (so rows batch different numbers of drafts)."""
    cases = [(s, d, 2) for s in settings for d in drafts] + [(s, d, "mixed") for s, d in mixed]
    return [pytest.param(s, d, k, 3000 + i, id=f"{s}-{d}-{k}") for i, (s, d, k) in enumerate(cases)]


@pytest.mark.parametrize(
    "setting, drafts, k, seed",
    filter_cases(list(MIN_P), DRAFTS, [("min_p=0.1", "filtered"), ("min_p=0.2,T=1.3", "raw")]),
)
def test_min_p_output_follows_the_filtered_target(setting: str, drafts: str, k: int | str, seed: int) -> None:
    """Every draft position and the bonus emit the min-p-filtered target distribution, and a token
    min-p removed is never emitted: not by acceptance, recovery (the residual) or the bonus."""
    params = SamplingParams(**MIN_P[setting])
    assert (reference_joint(MarkovPair(seed=13), params, 1) == 0).sum() >= 2  # min-p bites at token 0
    run_filter_case(params, drafts, k, seed)


@pytest.mark.parametrize(
    "setting, drafts, k, seed", filter_cases(list(PENALTIES), ["one_hot", "raw"], [("all+min_p,T=0.8", "raw")])
)
def test_penalized_output_follows_the_penalized_target(setting: str, drafts: str, k: int | str, seed: int) -> None:
    """With penalties each emitted token follows the target penalized by everything emitted before
    it: earlier steps' tokens and, within a step, the accepted drafts before its position."""
    params = SamplingParams(**PENALTIES[setting])
    unpenalized = SamplingParams(temperature=params.temperature, min_p=params.min_p)
    pair = MarkovPair(seed=13)
    # The penalties move the distribution far more than the chi-square can miss.
    assert np.abs(reference_joint(pair, params, LENGTH) - reference_joint(pair, unpenalized, LENGTH)).sum() > 0.2
    run_filter_case(params, drafts, k, seed)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_rows_are_accepted_prefix_plus_target_argmax(with_draft_probs: bool) -> None:
    torch.manual_seed(3)
    vocab = 32
    # Rows 0-4 draft 3 tokens (4 positions each); row r's first matches[r] drafts are the target
    # argmax. Row 4 is a random row in the same batch; row 5 drafts nothing.
    matches = [0, 1, 2, 3, 1]
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(), SamplingParams(temperature=0.0)]
    target_logits = torch.randn(5 * 4 + 1, vocab)
    argmax = target_logits.argmax(-1).tolist()
    drafts = []
    for r, m in enumerate(matches):
        row = argmax[r * 4 : r * 4 + 3]
        for j in range(m, 3):
            row[j] = (row[j] + 1 + j) % vocab  # anything but the argmax
        drafts.append(row)
    drafts.append([])
    draft_probs = torch.rand(15, vocab).softmax(-1) if with_draft_probs else None
    meta = build(params, vocab=vocab)
    out = RejectionSampler()(drafts, draft_probs, target_logits, meta)
    for r in range(4):
        m = matches[r]
        assert out.num_accepted[r] == m
        assert out.output_token_ids[r] == drafts[r][:m] + [argmax[r * 4 + m]]
    assert out.output_token_ids[5] == [argmax[20]] and out.num_accepted[5] == 0
    assert 1 <= len(out.output_token_ids[4]) <= 4


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    torch.manual_seed(4)
    vocab = 16
    row_logits = torch.randn(4, vocab) * 0.3  # flat-ish target: rejections happen
    row_drafts, row_draft_probs = [2, 5, 7], torch.rand(3, vocab).softmax(-1)

    def run(others: int) -> tuple[tuple[int, ...], int]:
        drafts = [[1] * (i % 3) for i in range(others)] + [row_drafts]
        logits = torch.cat([torch.randn(sum(len(d) + 1 for d in drafts[:-1]), vocab), row_logits])
        probs = torch.cat([torch.rand(sum(len(d) for d in drafts[:-1]), vocab).softmax(-1), row_draft_probs])
        params = [SamplingParams()] * others + [SamplingParams(seed=77, top_k=9)]
        out = RejectionSampler()(drafts, probs, logits, build(params, vocab=vocab))
        return tuple(out.output_token_ids[-1]), out.num_accepted[-1]

    assert len({run(n) for n in (0, 1, 5, 9)}) == 1


def test_draft_equal_to_target_is_always_accepted() -> None:
    torch.manual_seed(5)
    params = [SamplingParams(top_k=4)] * 64
    target_logits = torch.randn(64 * 4, VOCAB)
    meta = build(params)
    target_probs = compute_target_probs(target_logits, meta.select_rows([i // 4 for i in range(256)]))
    is_draft = torch.arange(256) % 4 != 3
    drafts = torch.multinomial(target_probs[is_draft], 1)[:, 0].view(64, 3).tolist()
    out = RejectionSampler()(drafts, target_probs[is_draft], target_logits, meta)
    assert out.num_accepted == [3] * 64


def test_penalties_and_min_tokens_count_the_drafts_before_each_position() -> None:
    torch.manual_seed(6)
    vocab, eos = 16, 15
    params = SamplingParams(
        repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2, min_tokens=3, temperature=0.7
    )
    output, drafts = [4], [5, 4, 9]
    logits = torch.randn(4, vocab)
    meta = build([params], outputs=[output], vocab=vocab, stop_ids=[[eos]])
    got = compute_target_probs(logits, meta.expand_for_drafts([drafts]))
    for j in range(4):
        step_meta = build([params], outputs=[output + drafts[:j]], vocab=vocab, stop_ids=[[eos]])
        torch.testing.assert_close(got[j : j + 1], compute_target_probs(logits[j : j + 1], step_meta))
    assert (got[:2, eos] == 0).all() and (got[2:, eos] > 0).all()  # output reaches 3 at j = 2


def test_no_drafts_and_bad_shapes() -> None:
    meta = build([SamplingParams(temperature=0.0), SamplingParams()])
    logits = torch.randn(2, VOCAB)
    out = RejectionSampler()([[], []], None, logits, meta)
    assert out.num_accepted == [0, 0] and out.output_token_ids[0] == [int(logits[0].argmax())]
    with pytest.raises(ValueError, match="target_logits"):
        RejectionSampler()([[1], []], None, logits, meta)
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler()([[1], []], torch.rand(2, VOCAB), torch.randn(3, VOCAB), meta)
    with pytest.raises(ValueError, match="draft_token_ids"):
        RejectionSampler()([[VOCAB], []], None, torch.randn(3, VOCAB), meta)
    assert RejectionSampler()([], None, torch.empty(0, VOCAB), build([])) == ([], [])
