"""The rejection sampler's host path (issue 5): the all-greedy fast path, the packed index upload
and the cached layouts give exactly what a plain per-row implementation gives (same random
numbers, same tokens), and a greedy batch costs one argmax and one read-back (CPU)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specserve.sample import RejectionSampler, SamplingMetadata, compute_target_probs
from specserve.sample.h2d import cached_tensor, h2d_packed
from specserve.sample.rejection import layout
from specserve.sample.sampler import draw_exponential, keyed_exponential
from specserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 12


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def reference(
    drafts: list[list[int]],
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    meta: SamplingMetadata,
    generator: torch.Generator,
) -> tuple[list[list[int]], list[int]]:
    """The rejection sampler row by row, drawing the same random numbers in the same order; a seeded row
    emits the race on its keyed noise at each position and accepts drafts equal to it."""
    num_seqs, total = len(drafts), sum(map(len, drafts))
    probs = compute_target_probs(logits, meta.expand_for_drafts(drafts))
    draft_start = np.cumsum([0] + [len(d) for d in drafts]).tolist()
    row_start = [draft_start[i] + i for i in range(num_seqs)]
    uniform = None
    if not meta.all_greedy and total:
        uniform = torch.empty(total, dtype=torch.float64).uniform_(generator=generator)

    def keyed(i: int, j: int) -> int:
        seed, pos = torch.tensor([meta.seeds[i]]), torch.tensor([meta.positions[i] + j])
        return int((probs[row_start[i] + j] / keyed_exponential(seed, pos, VOCAB)[0]).argmax())

    counts = []
    for i, d in enumerate(drafts):
        n = 0
        for j, x in enumerate(d):
            p = probs[row_start[i] + j]
            if meta.seeds[i] is not None:
                ok = x == keyed(i, j)
            elif meta.is_greedy[i]:
                ok = x == int(p.argmax())
            else:
                q = 1.0 if draft_probs is None else float(draft_probs[draft_start[i] + j, x])
                ok = float(uniform[draft_start[i] + j]) * q < float(p[x])
            if not ok:
                break
            n += 1
        counts.append(n)
    if meta.all_greedy:
        finals = [int(probs[row_start[i] + n].argmax()) for i, n in enumerate(counts)]
    else:
        noise = draw_exponential(num_seqs, VOCAB, generator, CPU)
        finals = []
        for i, (d, n) in enumerate(zip(drafts, counts)):
            fp = probs[row_start[i] + n]
            residual = fp
            if n < len(d):
                if draft_probs is None:
                    residual = fp.clone()
                    residual[d[n]] = 0.0
                else:
                    residual = (fp - draft_probs[draft_start[i] + n]).clamp(min=0.0)
                if residual.sum() <= 0:
                    residual = fp
            if meta.seeds[i] is not None:
                finals.append(keyed(i, n))
            else:
                finals.append(int(fp.argmax()) if meta.is_greedy[i] else int((residual / noise[i]).argmax()))
    return [d[:n] + [t] for d, n, t in zip(drafts, counts, finals)], counts


def scenario(seed: int):
    rng = random.Random(seed)
    num_seqs = rng.randint(1, 6)
    ks = [rng.choice([0, 1, 2, 3, 4]) for _ in range(num_seqs)]
    if rng.random() < 0.4:
        ks = [rng.choice([1, 3])] * num_seqs  # uniform k: the accepted prefix without padding
    kind = ["greedy", "random", "mixed"][seed % 3]
    params, seeds = [], []
    for _ in range(num_seqs):
        greedy = kind == "greedy" or (kind == "mixed" and rng.random() < 0.5)
        extra = {}
        if rng.random() < 0.25:
            extra["repetition_penalty"] = 1.3
        if rng.random() < 0.2:
            extra["min_tokens"] = 3
        if not greedy and rng.random() < 0.3:
            extra["top_k"] = 5
        s = rng.choice([None, 7, 11])
        params.append(SamplingParams(temperature=0.0 if greedy else 0.8, seed=s, **extra))
        seeds.append(s)
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))] for _ in range(num_seqs)]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(ks) + num_seqs, VOCAB, generator=gen) * 2
    argmax = logits.argmax(-1).tolist()
    drafts, row = [], 0
    for k in ks:  # mostly the target's argmax, so prefixes of every length get accepted
        drafts.append([argmax[row + j] if rng.random() < 0.7 else rng.randrange(VOCAB) for j in range(k)])
        row += k + 1
    draft_probs = None
    if rng.random() < 0.5 and sum(ks):
        draft_probs = torch.rand(sum(ks), VOCAB, generator=gen).softmax(-1)

    def meta() -> SamplingMetadata:
        return SamplingMetadata.build(params, [[1, 2]] * num_seqs, outputs, VOCAB, CPU, [[VOCAB - 1]] * num_seqs)

    return drafts, draft_probs, logits, meta


@pytest.mark.parametrize("seed", range(60))
def test_same_tokens_as_the_per_row_reference(seed: int) -> None:
    drafts, draft_probs, logits, meta = scenario(seed)
    got = RejectionSampler(torch.Generator().manual_seed(seed))(drafts, draft_probs, logits, meta())
    want = reference(drafts, draft_probs, logits, meta(), torch.Generator().manual_seed(seed))
    assert (got.output_token_ids, got.num_accepted) == want


def test_greedy_batch_is_one_argmax_and_one_read_back() -> None:
    params = [SamplingParams(temperature=0.0)] * 3
    drafts = [[1, 2, 3], [4], []]
    logits = torch.randn(7, VOCAB)
    meta = SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, VOCAB, CPU)
    sampler = RejectionSampler()
    with Ops() as ops:
        sampler(drafts, None, logits, meta)
    assert set(ops.names) <= {"argmax", "detach", "_to_copy"} and ops.names["argmax"] == 1
    assert sum(ops.names.values()) <= 3


def test_all_greedy_metadata_copies_nothing() -> None:
    params = [SamplingParams(temperature=0.0)] * 4
    drafts = [[1, 2], [], [3], [4, 5, 6]]
    for _ in range(2):  # the first round makes the cached ones (a new batch size, a new k)
        with Ops() as ops:
            meta = SamplingMetadata.build(params, [[1]] * 4, [[]] * 4, VOCAB, CPU)
            meta.expand_for_drafts(drafts)
    assert not ops.names
    assert meta.temperature.tolist() == [1.0] * 4 and meta.all_greedy and meta.greedy_mask is None


def test_selected_rows_keep_their_greedy_flags_and_scalars() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=0.9, top_p=0.5),
        SamplingParams(temperature=0.0),
    ]
    meta = SamplingMetadata.build(params, [[1]] * 4, [[]] * 4, VOCAB, CPU)
    assert meta.greedy_mask.tolist() == [True, False, False, True]
    rows = [3, 1, 1, 0, 2]
    sel = meta.select_rows(rows)
    assert sel.greedy_mask.tolist() == [True, False, False, True, False]
    assert sel.temperature.tolist() == pytest.approx([1.0, 0.7, 0.7, 1.0, 0.9])
    assert sel.top_k.tolist() == [VOCAB, 3, 3, VOCAB, VOCAB]
    assert sel.top_p.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.5])
    greedy_only = meta.select_rows([0, 3])
    assert greedy_only.all_greedy and greedy_only.greedy_mask is None
    random_only = meta.select_rows([2, 1])
    assert random_only.all_random and random_only.greedy_mask is None


def test_layout_matches_a_loop_and_is_cached() -> None:
    ks = (2, 0, 3, 1)
    lay = layout(ks)
    assert layout(ks) is lay and lay.total == 6 and lay.max_k == 3 and not lay.uniform
    seq, offset, row = [], [], []
    start = 0
    for i, k in enumerate(ks):
        seq += [i] * k
        offset += list(range(k))
        row += [start + j for j in range(k)]
        start += k + 1
    assert lay.draft_seq.tolist() == seq and lay.draft_offset.tolist() == offset
    assert lay.draft_target_row.tolist() == row
    assert lay.seq_target_start.tolist() == [0, 3, 4, 8] and lay.seq_draft_start.tolist() == [0, 2, 2, 5]
    assert layout((3, 3)).uniform and layout(()).total == 0


def test_packed_upload_equals_separate_tensors() -> None:
    arrays = [
        np.array([5, -1, 7], dtype=np.int64),
        np.arange(6, dtype=np.int32).reshape(2, 3),
        np.array([], dtype=np.int64),
        np.array([True, False]),
    ]
    got = h2d_packed(arrays, CPU)
    for t, a in zip(got, arrays):
        assert t.dtype == torch.int64 and t.tolist() == a.reshape(-1).astype(np.int64).tolist()


def test_cached_tensor_is_built_once_per_key() -> None:
    made = []

    def make():
        made.append(1)
        return torch.arange(3)

    a = cached_tensor(CPU, ("test", 3), make)
    assert cached_tensor(CPU, ("test", 3), make) is a and len(made) == 1


@pytest.mark.parametrize("seed", range(5))
def test_verify_metrics_equal_per_request_counting(seed: int) -> None:
    """record_verify_metrics adds each spec_decode_* counter once per step; the totals are those of
    counting request by request and position by position."""
    from types import SimpleNamespace

    from specserve.metrics.stats import StatsCollector
    from specserve.speculative.verify import position_counts, record_verify_metrics

    rng = random.Random(seed)
    got, want = SimpleNamespace(stats=StatsCollector()), StatsCollector()
    for _ in range(4):
        ks = [rng.choice([0, 1, 3, 5]) for _ in range(rng.randint(1, 7))]
        accepted = [rng.randint(0, k) for k in ks]
        record_verify_metrics(got.stats, ks, accepted, position_counts(ks, accepted, max(ks))[1])
        for k, a in zip(ks, accepted):
            if k:
                want.inc("spec_decode_num_drafts_total")
                want.inc("spec_decode_num_draft_tokens_total", k)
                want.inc("spec_decode_num_accepted_tokens_total", a)
                for pos in range(a):
                    want.inc("spec_decode_num_accepted_tokens_per_pos_total", 1, {"position": str(pos)})
    for name in (
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
    ):
        assert got.stats.get(name) == want.get(name)
    per_pos = "spec_decode_num_accepted_tokens_per_pos_total"
    assert got.stats._families[per_pos].values == want._families[per_pos].values
