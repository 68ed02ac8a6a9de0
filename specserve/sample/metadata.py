"""SamplingMetadata: how each row of a step's logits is sampled, as device tensors (None where no row uses a
feature), plus host copies of per-row facts so `select_rows` / `expand_for_drafts` read nothing back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specserve.sample.h2d import cached_tensor, h2d
from specserve.sample.penalties import PenaltyTensors, add_output_tokens, build_penalty_tensors, select_penalty_rows
from specserve.sampling_params import SamplingParams

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily: SamplingParams.greedy (a test checks they agree)


class MinTokensMask(NamedTuple):
    """(row, token) pairs forced to -inf: stop tokens of rows that have not reached min_tokens."""

    row_ids: Tensor  # [num_pairs] int64
    token_ids: Tensor  # [num_pairs] int64


@dataclass(frozen=True)
class SamplingMetadata:
    temperature: Tensor  # [num_seqs] float32; greedy rows hold 1.0 so nothing divides by zero
    greedy_mask: Tensor | None  # [num_seqs] bool; None when all_greedy or all_random
    all_greedy: bool
    all_random: bool
    top_k: Tensor | None  # [num_seqs] int64 in [1, vocab]; vocab = off; None when no row uses it
    top_p: Tensor | None  # [num_seqs] float32; 1.0 = off; None when no row uses it
    min_p: Tensor | None  # [num_seqs] float32; 0.0 = off; None when no row uses it
    penalties: PenaltyTensors | None  # None when every row is neutral
    min_tokens_mask: MinTokensMask | None
    max_num_logprobs: int | None  # the largest `logprobs` asked for; None = no row wants any
    vocab_size: int
    # Host-side state (see module docstring).
    is_greedy: list[bool] = field(repr=False)
    min_tokens_remaining: list[int] = field(repr=False)  # tokens still to emit before stops may
    min_tokens_stop_ids: list[list[int]] = field(repr=False)
    seeds: list[int | None] = field(repr=False)  # SamplingParams.seed of random rows; None: greedy or unseeded
    positions: list[int] = field(repr=False)  # the output index of the token each row samples

    @property
    def num_seqs(self) -> int:
        return len(self.is_greedy)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        stop_token_ids_for_min_tokens: list[list[int]] | None = None,
    ) -> SamplingMetadata:
        """One row per entry of `params`. stop_token_ids_for_min_tokens: per row, the ids a row below its
        min_tokens must not emit (EOS + stop_token_ids); None = mask nothing."""
        num_seqs, stops = len(params), stop_token_ids_for_min_tokens
        lists: dict[str, Sequence[object]] = {
            "prompt_token_ids": prompt_token_ids,
            "output_token_ids": output_token_ids,
        }
        for name, values in [*lists.items(), ("stop_token_ids_for_min_tokens", stops or params)]:
            if len(values) != num_seqs:
                raise ValueError(f"{name} has {len(values)} rows, params has {num_seqs}.")
        # Vectorized over rows: one list comprehension per SamplingParams field, the rest in numpy, so the
        # Python work per row is a few attribute reads; rows using min_tokens / penalties are few.
        temps = np.array([p.temperature for p in params], dtype=np.float64)
        greedy_rows = temps < GREEDY_BELOW
        is_greedy = greedy_rows.tolist()
        num_greedy = is_greedy.count(True)
        all_greedy, all_random = num_greedy == num_seqs, num_greedy == 0
        use: dict[str, bool] = {}
        if not all_greedy:  # greedy rows read no scalar: cached neutral temperatures, no copy
            scalars, use = _row_scalars(params, temps, greedy_rows, vocab_size)
            scalars = h2d(scalars, device)  # one host->device copy for all per-row scalars
        positions = list(map(len, output_token_ids))
        min_tokens = [p.min_tokens for p in params]
        if min_tokens.count(0) == num_seqs:  # the common case: no row holds stop tokens back
            remaining, below = [0] * num_seqs, np.zeros(0, dtype=np.int64)
        else:
            left = np.maximum(np.array(min_tokens, dtype=np.int64) - np.array(positions, dtype=np.int64), 0)
            remaining, below = left.tolist(), np.flatnonzero(left)
        # (the caller's lists, not copies: nothing here writes to them)
        stop_ids = list(stops) if stops is not None else [[] for _ in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        seeds: list[int | None] = [None] * num_seqs
        if not all_greedy:
            seeds = [None if g else p.seed for g, p in zip(is_greedy, params)]
        return cls(
            temperature=_ones(num_seqs, device) if all_greedy else scalars[:, 0],
            greedy_mask=None if all_greedy or all_random else scalars[:, 4] > 0,
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=scalars[:, 3].long() if use.get("top_k") else None,
            top_p=scalars[:, 1] if use.get("top_p") else None,
            min_p=scalars[:, 2] if use.get("min_p") else None,
            penalties=build_penalty_tensors(params, prompt_token_ids, output_token_ids, vocab_size, device),
            min_tokens_mask=_build_min_tokens_mask(remaining, stop_ids, vocab_size, device, below),
            max_num_logprobs=max(logprobs) if logprobs else None,
            vocab_size=vocab_size,
            is_greedy=is_greedy,
            min_tokens_remaining=remaining,
            min_tokens_stop_ids=stop_ids,
            seeds=seeds,
            positions=positions,
        )

    def select_rows(self, row_ids: Sequence[int], offsets: Sequence[int] | None = None) -> SamplingMetadata:
        """Row r of the result is row row_ids[r] of self (e.g. one row per verified position), `offsets[r]`
        tokens further into its output (default 0)."""
        return self._select(row_ids, [0] * len(row_ids) if offsets is None else offsets)

    def _select(self, row_ids: Sequence[int], offsets: Sequence[int]) -> SamplingMetadata:
        """select_rows, each selected row `offsets[r]` tokens further into its output."""
        device = self.temperature.device
        row_ids = tuple(row_ids)
        is_greedy = [self.is_greedy[i] for i in row_ids]
        all_greedy, all_random = all(is_greedy), not any(is_greedy)
        index = None  # greedy rows without penalties read no tensor: no copy
        if not all_greedy or self.penalties is not None:
            index = cached_tensor(device, ("rows", row_ids), lambda: torch.tensor(row_ids, dtype=torch.int64))

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None or index is None or all_greedy else t.index_select(0, index)

        remaining = [max(0, self.min_tokens_remaining[i] - j) for i, j in zip(row_ids, offsets)]
        stop_ids = [self.min_tokens_stop_ids[i] for i in row_ids]
        return replace(
            self,
            temperature=_ones(len(row_ids), device) if index is None or all_greedy else self.temperature[index],
            greedy_mask=None if all_random else pick(self.greedy_mask),
            top_k=pick(self.top_k),
            top_p=pick(self.top_p),
            min_p=pick(self.min_p),
            all_greedy=all_greedy,
            all_random=all_random,
            penalties=None if self.penalties is None or index is None else select_penalty_rows(self.penalties, index),
            is_greedy=is_greedy,
            min_tokens_stop_ids=stop_ids,
            seeds=[self.seeds[i] for i in row_ids],
            positions=[self.positions[i] + j for i, j in zip(row_ids, offsets)],
            min_tokens_remaining=remaining,
            min_tokens_mask=_build_min_tokens_mask(remaining, stop_ids, self.vocab_size, device),
        )

    def expand_for_drafts(self, draft_token_ids: Sequence[Sequence[int]]) -> SamplingMetadata:
        """One row per verified position: for sequence i, rows for its k_i + 1 positions, in order. Position j
        is sampled as if draft_token_ids[i][:j] had been emitted (min_tokens and penalties count them), so
        every position's distribution is the one the plain sampler would use there."""
        if len(draft_token_ids) != self.num_seqs:
            raise ValueError(f"draft_token_ids has {len(draft_token_ids)} rows, metadata has {self.num_seqs}.")
        row_ids = [i for i, drafts in enumerate(draft_token_ids) for _ in range(len(drafts) + 1)]
        offsets = [j for drafts in draft_token_ids for j in range(len(drafts) + 1)]
        meta = self._select(row_ids, offsets)
        if meta.penalties is not None:  # row r (offset j) also counts its sequence's first j drafts
            pos_rows = [r for r, j in enumerate(offsets) for _ in range(j)]
            pos_tokens = [t for i, j in zip(row_ids, offsets) for t in draft_token_ids[i][:j]]
            meta = replace(meta, penalties=add_output_tokens(meta.penalties, pos_rows, pos_tokens))
        return meta


def _ones(n: int, device: torch.device) -> Tensor:
    """[n] float32 ones on `device`, cached (never written: the sampler divides by it)."""
    return cached_tensor(device, ("ones", n), lambda: torch.ones(n, dtype=torch.float32))


def _row_scalars(
    params: Sequence[SamplingParams], temps: np.ndarray, greedy: np.ndarray, vocab_size: int
) -> tuple[Tensor, dict[str, bool]]:
    """Host [num_seqs, 5] float32 (temperature, top_p, min_p, top_k, greedy), and the filters random rows use.
    Greedy rows hold the neutral (1.0, 1.0, 0.0, vocab, 1.0)."""
    top_p = np.array([p.top_p for p in params], dtype=np.float64)
    min_p = np.array([p.min_p for p in params], dtype=np.float64)
    top_k = np.array([p.top_k for p in params], dtype=np.int64)
    top_k = np.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    random = ~greedy
    use = {
        "top_k": bool((top_k[random] < vocab_size).any()),
        "top_p": bool((top_p[random] < 1.0).any()),
        "min_p": bool((min_p[random] > 0.0).any()),
    }
    cols = (
        np.where(greedy, 1.0, temps),
        np.where(greedy, 1.0, top_p),
        np.where(greedy, 0.0, min_p),
        np.where(greedy, vocab_size, top_k),
        greedy,
    )
    return torch.from_numpy(np.stack(cols, axis=1).astype(np.float32)), use


def _build_min_tokens_mask(
    remaining: Sequence[int],
    stop_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
    rows: np.ndarray | None = None,
) -> MinTokensMask | None:
    """rows: the rows with remaining > 0 where the caller knows them (then only those are visited)."""
    if rows is None:
        rows = np.flatnonzero(np.asarray(remaining, dtype=np.int64) > 0)
    # An id outside the logits (an added EOS past a padded vocab) cannot be sampled; indexing would crash.
    pairs = [(row, t) for row in rows.tolist() for t in stop_ids[row] if t < vocab_size]
    if not pairs:
        return None
    index = h2d(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device)
    return MinTokensMask(index[0], index[1])
