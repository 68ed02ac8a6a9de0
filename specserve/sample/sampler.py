"""The sampler: min_tokens mask -> penalties -> [greedy: argmax] -> temperature -> min_p -> top_k -> top_p
-> softmax -> exponential race (argmax(probs / E), E ~ Exp(1)), each stage skipped when no row uses it.
`compute_target_probs` is shared with the rejection sampler, which is lossless only on this exact
distribution. A seeded row's noise is a hash of (seed, output position, token): its token at a position
depends only on those and the probabilities there, whatever the batch or the speculation."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from specserve.sample.h2d import h2d_packed
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.penalties import apply_penalties


class LogprobsTensors(NamedTuple):
    """Log-probabilities from the log-softmax of the RAW logits (vLLM's default `raw_logprobs`)."""

    logprob_token_ids: Tensor  # [num_seqs, max_num_logprobs + 1] int64; column 0 = sampled token
    logprobs: Tensor  # [num_seqs, max_num_logprobs + 1] float32; columns 1.. = top-N, descending
    sampled_token_ranks: Tensor  # [num_seqs] int64; 1 = the most likely token


class SamplerOutput(NamedTuple):
    token_ids: Tensor  # [num_seqs] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


def check_vocab(columns: int, meta: SamplingMetadata) -> None:
    if columns != meta.vocab_size:
        raise ValueError(
            f"logits have {columns} columns, metadata has vocab_size={meta.vocab_size}: slice padding off."
        )


def _check_logits(logits: Tensor, meta: SamplingMetadata) -> None:
    if logits.dim() != 2 or logits.shape[0] != meta.num_seqs:
        raise ValueError(f"logits must be [num_seqs={meta.num_seqs}, vocab], got {tuple(logits.shape)}.")
    check_vocab(logits.shape[1], meta)


def penalized_logits(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """min_tokens mask then penalties: [num_seqs, vocab] float32."""
    logits = logits.float()
    if meta.min_tokens_mask is not None:
        logits = logits.clone()
        logits[meta.min_tokens_mask.row_ids, meta.min_tokens_mask.token_ids] = float("-inf")
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """In place: drop tokens with prob < min_p * max prob, as l_i < l_max + log(min_p) (min_p = 0: off)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [num_seqs, 1]
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Keep the top_k largest logits (ties with the k-th kept), then the smallest set of those whose probability
    reaches top_p (renormalized after top-k, as HF and vLLM do)."""
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth_index = (logits_sort.shape[1] - top_k).unsqueeze(1)  # [num_seqs, 1]
        kth_value = logits_sort.gather(1, kth_index)
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        cum_probs = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
        drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, float("-inf"))
    return logits_sort.scatter(1, logits_idx, logits_sort)


def _random_probs(penalized: Tensor, meta: SamplingMetadata) -> Tensor:
    """temperature -> min_p -> top_k -> top_p -> softmax for every row (greedy rows: the caller overwrites)."""
    logits = penalized / meta.temperature.unsqueeze(1)  # a new tensor: the stages below may write
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return logits.softmax(dim=-1)


def _one_hot(token_ids: Tensor, vocab_size: int) -> Tensor:
    return torch.nn.functional.one_hot(token_ids, vocab_size).float()


def compute_target_probs(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """The distribution the Sampler samples from, after every processing stage."""
    _check_logits(logits, meta)
    penalized = penalized_logits(logits, meta)
    if meta.all_greedy:
        return _one_hot(penalized.argmax(dim=-1), meta.vocab_size)
    probs = _random_probs(penalized, meta)
    if meta.greedy_mask is not None:
        greedy = _one_hot(penalized.argmax(dim=-1), meta.vocab_size)
        probs = torch.where(meta.greedy_mask.unsqueeze(1), greedy, probs)
    return probs


def draw_exponential(num_rows: int, vocab_size: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """[num_rows, vocab] Exp(1) noise from `generator` (None: torch's default). Seeded rows use
    `keyed_exponential` instead."""
    noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device).exponential_(generator=generator)
    # Exp(1) can be exactly 0 on some backends: probs / 0 would be inf, or NaN (argmax prefers it) at prob 0.
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)


_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x, c in [0, 2**32), in 16-bit halves so no int64 product overflows."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's finalizer: a bijection of [0, 2**32) with full avalanche."""
    x = _mul32(x ^ (x >> 16), 0x85EBCA6B)
    x = _mul32(x ^ (x >> 13), 0xC2B2AE35)
    return x ^ (x >> 16)


def keyed_exponential(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """seeds, positions: [num_rows] int64 -> [num_rows, vocab] Exp(1) noise, a pure function of (seed, position,
    token): counter-based, so no generator state and the same values on every device."""
    key = _fmix32(_fmix32(_fmix32(positions & _M32) ^ (seeds & _M32)) ^ ((seeds >> 32) & _M32)).unsqueeze(1)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = _fmix32(_fmix32((key + _mul32(tokens, 0x9E3779B9)) & _M32) ^ _fmix32(key ^ 0x5BD1E995))
    return (bits.double().add_(0.5).mul_(2.0**-32)).log_().neg_().float()  # u in (0, 1): E > 0


def seeded_tokens(probs: Tensor, meta: SamplingMetadata) -> tuple[Tensor, Tensor] | None:
    """(row ids [num_seeded], tokens [num_seeded]) for meta's seeded rows of probs [num_seqs, vocab], by an
    exponential race on `keyed_exponential`; None when no row is seeded."""
    seeded = [(i, (s + (1 << 63)) % (1 << 64) - (1 << 63)) for i, s in enumerate(meta.seeds) if s is not None]
    if not seeded:
        return None
    rows, seeds = zip(*seeded)  # seeds as int64
    row_ids, seed_t, pos_t = h2d_packed([rows, seeds, [meta.positions[i] for i in rows]], probs.device)
    return row_ids, random_sample(probs.index_select(0, row_ids), keyed_exponential(seed_t, pos_t, probs.shape[1]))


def random_sample(probs: Tensor, noise: Tensor) -> Tensor:
    """Exponential race: probs [num_rows, vocab] (unnormalized is fine), Exp(1) noise -> [num_rows] int64."""
    return (probs / noise).argmax(dim=-1)


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_logprobs: int) -> LogprobsTensors:
    """logits: RAW [num_seqs, vocab]; token_ids: [num_seqs] the sampled tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_seqs, 1]
    # vLLM's rank: how many tokens are at least as likely as the sampled one.
    ranks = (logprobs >= sampled).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(min(num_logprobs, logprobs.shape[1]), dim=-1)
    return LogprobsTensors(
        torch.cat([token_ids.unsqueeze(1), top_ids], dim=1), torch.cat([sampled, top_logprobs], dim=1), ranks
    )


class Sampler:
    """Samples one token per row."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [num_seqs, vocab], not modified. No host sync."""
        _check_logits(logits, meta)
        penalized = penalized_logits(logits, meta)
        if meta.all_greedy:
            token_ids = penalized.argmax(dim=-1)
        else:
            probs = _random_probs(penalized, meta)
            noise = draw_exponential(meta.num_seqs, meta.vocab_size, self.generator, logits.device)
            token_ids = random_sample(probs, noise)
            seeded = seeded_tokens(probs, meta)
            if seeded is not None:
                token_ids = token_ids.index_copy(0, *seeded)
            if meta.greedy_mask is not None:
                token_ids = torch.where(meta.greedy_mask, penalized.argmax(dim=-1), token_ids)
        n = meta.max_num_logprobs
        return SamplerOutput(token_ids, None if n is None else compute_logprobs(logits, token_ids, n))
