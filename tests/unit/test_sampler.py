"""Sampler: greedy, seeds, filters, penalties, min_tokens, logprobs (CPU, seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.sample import Sampler, SamplingMetadata, compute_target_probs
from specserve.sample.sampler import penalized_logits
from specserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 32


def build(
    params: list[SamplingParams],
    vocab: int = VOCAB,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    stop_ids: list[list[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        vocab,
        CPU,
        stop_ids,
    )


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Straightforward float64 reference: temperature, min_p, top_k, top_p, each stage on the
    distribution left by the previous one."""
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    probs /= probs.sum()
    probs[probs < min_p * probs.max()] = 0.0
    order = np.argsort(-probs, kind="stable")
    if top_k > 0:
        probs[order[top_k:]] = 0.0
    probs /= probs.sum()
    mass_above = np.cumsum(probs[order]) - probs[order]
    probs[order[mass_above >= top_p]] = 0.0
    return probs / probs.sum()


def pooled_chisquare(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of a chi-square test; cells expecting < 5 draws are pooled into one."""
    expected = expected_probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def test_greedy_rows_are_argmax_of_the_raw_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, top_k=5) for i in range(6)]
    out = Sampler()(logits, build(params))
    assert torch.equal(out.token_ids[::2], logits[::2].argmax(-1))
    all_greedy = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 6))
    assert torch.equal(all_greedy.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None


@pytest.mark.parametrize("position", [0, 7])
def test_seeded_rows_over_many_seeds_follow_the_distribution(position: int) -> None:
    """One row per seed, same logits: the tokens over seeds follow the filtered softmax (chi-square)."""
    torch.manual_seed(9)
    num_seeds = 20000
    params = SamplingParams(temperature=0.9, top_k=20)
    row = torch.randn(VOCAB)
    meta = build(
        [params.clone(seed=s - num_seeds // 2) for s in range(num_seeds)], outputs=[[1] * position] * num_seeds
    )
    tokens = Sampler()(row.expand(num_seeds, VOCAB), meta).token_ids.numpy()
    expected = reference_probs(row.double().numpy(), 0.9, 20, 1.0, 0.0)
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts[expected == 0].sum() == 0 and pooled_chisquare(counts, expected) > 1e-3


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    torch.manual_seed(1)
    row_logits = torch.randn(5, VOCAB)  # one step per row of this

    def run(batch_size: int, position: int) -> list[int]:
        params = [SamplingParams(temperature=1.0, top_p=0.9) for _ in range(batch_size)]
        params[position] = SamplingParams(temperature=0.8, seed=1234)
        if batch_size > 2:  # another seeded row, which must not disturb ours
            params[(position + 1) % batch_size] = SamplingParams(temperature=1.0, seed=9)
        meta = build(params)
        tokens = []
        for step in range(row_logits.shape[0]):
            logits = torch.randn(batch_size, VOCAB)
            logits[position] = row_logits[step]
            tokens.append(int(Sampler()(logits, meta).token_ids[position]))
        return tokens

    alone = run(1, 0)
    assert run(7, 3) == alone and run(3, 2) == alone and run(16, 0) == alone


FILTERS = [
    {"top_k": 4},
    {"top_p": 0.6},
    {"min_p": 0.2},
    {"top_k": 6, "top_p": 0.7, "min_p": 0.05},
    {"temperature": 0.5, "top_p": 0.8},
    {"temperature": 1.7},
]


@pytest.mark.parametrize("filters", FILTERS)
def test_filters_match_reference_and_never_leave_their_set(filters: dict) -> None:
    torch.manual_seed(2)
    logits_row = torch.randn(VOCAB, dtype=torch.float64) * 2
    params = SamplingParams(**{"temperature": 1.0, **filters})
    expected = reference_probs(logits_row.numpy(), params.temperature, params.top_k, params.top_p, params.min_p)
    num_rows = 40_000
    meta = build([params] * num_rows)
    logits = logits_row.float().expand(num_rows, VOCAB)
    probs = compute_target_probs(logits[:2], build([params] * 2))
    np.testing.assert_allclose(probs[0].numpy(), expected, atol=1e-5)
    tokens = Sampler(torch.Generator().manual_seed(3))(logits, meta).token_ids
    counts = np.bincount(tokens.numpy(), minlength=VOCAB)
    assert counts[expected == 0].sum() == 0, "a token outside the filtered set was emitted"
    assert pooled_chisquare(counts, expected) > 1e-3


def test_mixed_batch_rows_are_independent_of_each_other() -> None:
    """Each row gets its own temperature/filters in one vectorized call."""
    torch.manual_seed(4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(temperature=2.0, min_p=1.0),
    ]
    logits = torch.randn(4, VOCAB)
    for _ in range(20):
        out = Sampler()(logits, build(params)).token_ids
        assert torch.equal(out, logits.argmax(-1))  # every row here can only pick its argmax


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(5)
    prompts, outputs = [[1, 2, 3, 3], [7], []], [[4, 2], [], [9, 9, 30]]
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    logits = torch.randn(3, VOCAB) * 3
    got = penalized_logits(logits, build(params, prompts=prompts, outputs=outputs))
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(3):
        ids = torch.tensor([prompts[row] + outputs[row]])
        want = processor(ids, logits[row : row + 1].clone())
        torch.testing.assert_close(got[row : row + 1], want)


def test_presence_and_frequency_penalties_follow_openai() -> None:
    torch.manual_seed(6)
    prompt, output = [5, 6], [6, 8, 8, 8]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2)
    logits = torch.randn(1, VOCAB)
    got = penalized_logits(
        logits, build([params, SamplingParams()], prompts=[prompt, prompt], outputs=[output, output]).select_rows([0])
    )
    want = logits[0].clone()
    for token in set(prompt + output):  # repetition first, on prompt + output
        want[token] = want[token] * 1.2 if want[token] < 0 else want[token] / 1.2
    for token in set(output):  # then OpenAI's presence/frequency, on output only
        want[token] -= 0.5 + (-0.25) * output.count(token)
    torch.testing.assert_close(got[0], want)
    neutral = build([SamplingParams(), SamplingParams(temperature=0.0)])
    assert neutral.penalties is None and neutral.min_tokens_mask is None


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    eos, stop = 3, 11
    logits = torch.zeros(3, VOCAB)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(min_tokens=5),
        SamplingParams(temperature=0.0, min_tokens=2),
    ]
    outputs = [[1], [1, 2], [1, 2]]  # rows 0 and 1 are short of min_tokens; row 2 has reached it
    meta = build(params, outputs=outputs, stop_ids=[[eos, stop]] * 3)
    for _ in range(50):
        tokens = Sampler()(logits, meta).token_ids.tolist()
        assert tokens[0] not in (eos, stop) and tokens[1] not in (eos, stop)
        assert tokens[2] == eos
    assert build(params, outputs=outputs).min_tokens_mask is None  # no ids passed: nothing masked


def test_logprobs_come_from_the_raw_logits() -> None:
    torch.manual_seed(7)
    logits = torch.randn(4, VOCAB) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, logprobs=5),
        SamplingParams(top_k=2, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
    ]
    before = logits.clone()
    out = Sampler()(logits, build(params, outputs=[[1, 2]] * 4))
    assert torch.equal(logits, before), "the sampler must not modify its input"
    lp = out.logprobs
    assert lp is not None and lp.logprobs.shape == (4, 6) and lp.logprob_token_ids.shape == (4, 6)
    raw = logits.log_softmax(-1)
    top, top_ids = raw.topk(5, dim=-1)
    torch.testing.assert_close(lp.logprobs[:, 1:], top)
    assert torch.equal(lp.logprob_token_ids[:, 1:], top_ids)
    assert torch.equal(lp.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, out.token_ids[:, None])[:, 0])
    ranks = (raw > raw.gather(1, out.token_ids[:, None])).sum(-1) + 1
    assert torch.equal(lp.sampled_token_ranks, ranks)
    assert int(lp.sampled_token_ranks[0]) == 1  # the greedy row took the top token


def test_compute_target_probs_greedy_rows_are_one_hot_and_rows_map() -> None:
    torch.manual_seed(8)
    logits = torch.randn(3, VOCAB)
    meta = build([SamplingParams(temperature=0.0), SamplingParams(top_k=3)])
    probs = compute_target_probs(logits, meta.select_rows([0, 1, 1]))
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), VOCAB).float())
    assert int((probs[1] > 0).sum()) == 3 and int((probs[2] > 0).sum()) == 3
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_bad_shapes_are_clear_errors() -> None:
    meta = build([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.randn(2, VOCAB + 3), meta)
    with pytest.raises(ValueError, match="num_seqs"):
        Sampler()(torch.randn(3, VOCAB), meta)
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingMetadata.build([SamplingParams()], [[]], [], VOCAB, CPU)
