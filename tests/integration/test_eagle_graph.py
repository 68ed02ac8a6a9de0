"""The EAGLE head's forwards over static buffers, forced on the CPU without capture: the first
forward of a propose (FirstForwardGraphs, speculative/proposers/eagle_first.py: real rows, and P-EAGLE's mask rows)
and the autoregressive draft steps (HeadStepGraphs, speculative/proposers/eagle_graph.py); the same padding, buffer
layout and metadata the CUDA graphs read on the GPU.

Greedy output equals plain decoding, and every proposal (drafts, and for random rows the draft
distributions) equals the eager path's, for eagle, eagle3 and P-EAGLE heads over batches that need
padding (3 requests -> size 4, 5 -> 8), mixed prompt lengths and requests that finish at different
times (their last proposals draft fewer than k tokens: dead rows in the static batch). Proposes
after a prompt (more rows than the buffers hold) run the eager head in the same runs. Heads with a
reduced draft vocabulary (logits over d2t, argmax mapped through it inside the static forwards)
too."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.speculative.proposers.eagle import EagleProposer
from specserve.speculative.proposers.eagle_first import FirstForwardGraphs
from specserve.speculative.proposers.eagle_graph import HeadStepGraphs, PinnedUpload, attention_arrays
from tests.helpers.eagle_heads import make_random_head_dir
from tests.integration.test_spec_decode import build_d2t

K = 3
BLOCK_BYTES = 2 * 16 * 2 * 2 * 16 * 4  # tiny llama: layers * block * (k, v) * kv heads * head_dim * fp32


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    motif = [rng.randrange(10, 300) for _ in range(5)]
    shapes = [
        motif * 3,
        [rng.randrange(10, 300) for _ in range(2)],
        [42],
        motif + [7] + motif,
        [rng.randrange(10, 300) for _ in range(37)],
        [rng.randrange(10, 300) for _ in range(11)],
    ]
    return shapes[:n]


def _greedy(n: int) -> list[SamplingParams]:
    # Different budgets: requests finish at different steps, and near their end draft < K tokens.
    return [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def d2t(tiny_llama_dir, tiny_llm) -> list[int]:
    return build_d2t(tiny_llama_dir, tiny_llm)


@pytest.fixture(scope="module")
def heads(tiny_llama_dir, tmp_path_factory, d2t):
    base = tmp_path_factory.mktemp("heads")
    out = {m: str(make_random_head_dir(str(tiny_llama_dir), base / m, m)) for m in ("eagle", "eagle3")}
    out["p-eagle"] = str(make_random_head_dir(str(tiny_llama_dir), base / "p-eagle", "eagle3", num_mask_slots=K - 1))
    out["eagle-reduced"] = str(make_random_head_dir(str(tiny_llama_dir), base / "eagle-r", "eagle", d2t=d2t))
    out["eagle3-reduced"] = str(make_random_head_dir(str(tiny_llama_dir), base / "eagle3-r", "eagle3", d2t=d2t))
    out["p-eagle-reduced"] = str(
        make_random_head_dir(str(tiny_llama_dir), base / "p-eagle-r", "eagle3", num_mask_slots=K - 1, d2t=d2t)
    )
    return out


def _run(target: str, method: str | None, head: str | None, mode: str, prompts, params, monkeypatch, **kw):
    """(outputs, proposals, llm): proposals = per propose, per request (drafts, draft probs).
    method "p-eagle": an eagle3 head drafting in parallel; "*-reduced": a head with a reduced vocabulary."""
    monkeypatch.setattr(EagleProposer, "step_graphs", mode)
    parallel = method is not None and method.startswith("p-eagle")
    spec = (
        None
        if method is None
        else {
            "method": "eagle3" if parallel else method.removesuffix("-reduced"),
            "model": head,
            "num_speculative_tokens": K,
            "adaptive": False,
            "parallel_drafting": parallel,
        }
    )
    llm = LLM(
        model=target,
        progress=False,
        speculative_config=spec,
        enable_prefix_caching=False,
        **{"kv_cache_memory_bytes": 4 << 20, **kw},
    )
    proposals: list = []
    proposer = llm.engine.spec.proposer if spec else None
    if proposer is not None:
        propose = proposer.propose

        def recording(inp):
            propose(inp)
            proposer.resolve_deferred()  # drafts left on the device for the verify step: read them now
            proposals.append([(list(r.spec_token_ids), r.spec_draft_probs) for r in inp.requests])

        proposer.propose = recording
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.kv.check_integrity()
    assert llm.engine.num_blocks_in_use() == 0
    if proposer is not None:
        assert proposer.kv.num_free_blocks() == proposer.kv.num_blocks
    return [o.outputs[0].token_ids for o in outs], proposals, llm


def _same_proposals(a: list, b: list) -> None:
    assert len(a) == len(b) and len(a) > 0
    for pa, pb in zip(a, b):
        assert [d for d, _ in pa] == [d for d, _ in pb]
        for (_, qa), (_, qb) in zip(pa, pb):
            assert (qa is None) == (qb is None)
            if qa is not None:
                torch.testing.assert_close(qa, qb, rtol=1e-5, atol=1e-6)


def _check_static_runs(proposer, method: str, n: int, proposals: list) -> None:
    first: FirstForwardGraphs = proposer.first
    assert not first.graphs  # no capture on the CPU: the static buffers only
    padded = {1: 1, 3: 4, 5: 8}[n]
    assert first.runs[padded] > 0  # the full batch ran padded to the next size
    assert 0 < sum(first.runs.values()) < len(proposals)  # proposes after a prompt ran the eager head
    steps: HeadStepGraphs | None = proposer.steps
    if method.startswith("p-eagle"):
        assert steps is None
        return
    assert not steps.graphs and steps.runs[padded] > 0
    # Requests near their end draft fewer than K tokens; beside others their rows run dead.
    assert (steps.dead_rows > 0) == (n > 1)


@pytest.mark.parametrize("n", [3, 5, 1])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "p-eagle"])
def test_static_forwards_greedy_equal_plain_and_eager(method, n, heads, tiny_llama_dir, monkeypatch):
    target, prompts, params = str(tiny_llama_dir), _prompts(n, seed=n), _greedy(n)
    plain, _, _ = _run(target, None, None, "auto", prompts, params, monkeypatch)
    eager, eager_props, eager_llm = _run(target, method, heads[method], "eager", prompts, params, monkeypatch)
    static, static_props, llm = _run(target, method, heads[method], "static", prompts, params, monkeypatch)
    assert eager_llm.engine.spec.proposer.steps is None and eager_llm.engine.spec.proposer.first is None
    assert static == eager == plain
    _same_proposals(static_props, eager_props)
    _check_static_runs(llm.engine.spec.proposer, method, n, static_props)


@pytest.mark.parametrize("method", ["eagle3", "p-eagle"])
def test_static_forwards_with_preemption(method, heads, tiny_llama_dir, monkeypatch):
    # 8 blocks: each request fits alone, six together do not; preempted heads start over.
    target, prompts, params = str(tiny_llama_dir), _prompts(6, seed=6), _greedy(6)
    plain, _, _ = _run(target, None, None, "auto", prompts, params, monkeypatch)
    static, _, llm = _run(
        target, method, heads[method], "static", prompts, params, monkeypatch, kv_cache_memory_bytes=8 * BLOCK_BYTES
    )
    assert static == plain
    assert llm.engine.stats.get("num_preemptions_total") > 0
    assert llm.engine.spec.proposer.first.runs


@pytest.mark.parametrize("method", ["eagle", "eagle3", "p-eagle"])
def test_static_forwards_seeded_sampling_equals_eager(method, heads, tiny_llama_dir, monkeypatch):
    target, prompts = str(tiny_llama_dir), _prompts(5, seed=7)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),  # greedy rows among random
        SamplingParams(temperature=1.2, top_k=20, seed=99, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=8, min_p=0.05, max_tokens=12, ignore_eos=True),
    ]
    eager, eager_props, _ = _run(target, method, heads[method], "eager", prompts, params, monkeypatch)
    static, static_props, llm = _run(target, method, heads[method], "static", prompts, params, monkeypatch)
    again, _, _ = _run(target, method, heads[method], "static", prompts, params, monkeypatch)
    assert static == again == eager
    _same_proposals(static_props, eager_props)
    assert any(q is not None for p in static_props for _, q in p)  # random rows kept their distributions
    proposer = llm.engine.spec.proposer
    assert proposer.first.runs[8] > 0
    if method != "p-eagle":
        assert proposer.steps.runs[8] > 0 and proposer.steps.dead_rows > 0


def test_static_step_metadata(heads, tiny_llama_dir, monkeypatch):
    """What each step sends: padding sequences empty with the pad slot, dead rows one query over
    their first cached row storing nothing, live rows at their next slot inside their own blocks."""
    seen = []
    send = HeadStepGraphs._send

    def recording(self, host, step, n, bs):
        rows = send(self, host, step, n, bs)
        seen.append(
            (
                n,
                bs,
                rows,
                self.cu_query_lens[: bs + 1].tolist(),
                self.seq_lens[:bs].tolist(),
                self.slot_mapping[:bs].tolist(),
                self.positions[:bs].tolist(),
                self.block_tables[:n].clone(),
                [c + step for c in host.ctx],
                [p + step for p in host.last_pos],
            )
        )
        return rows

    monkeypatch.setattr(HeadStepGraphs, "_send", recording)
    _, _, llm = _run(
        str(tiny_llama_dir), "eagle3", heads["eagle3"], "static", _prompts(3, seed=3), _greedy(3), monkeypatch
    )
    pad, bsz = -1, llm.engine.spec.proposer.kv.block_size
    assert any(bs > n for n, bs, *_ in seen) and any(len(rows) < n for n, _, rows, *_ in seen)
    for n, bs, rows, cu, seq_lens, slots, pos, tables, seq_len, position in seen:
        assert cu == list(range(n + 1)) + [n] * (bs - n)
        for r in range(bs):
            if r >= n:  # padding sequence
                assert (seq_lens[r], slots[r]) == (0, pad)
            elif r not in rows:  # dead row: its drafts are done
                assert (seq_lens[r], slots[r]) == (1, pad)
            else:
                assert seq_lens[r] == seq_len[r] and pos[r] == position[r]
                assert slots[r] == int(tables[r, (seq_len[r] - 1) // bsz]) * bsz + (seq_len[r] - 1) % bsz
                assert slots[r] != pad


@pytest.mark.parametrize("method", ["eagle3", "p-eagle"])
def test_first_forward_metadata(method, heads, tiny_llama_dir, monkeypatch):
    """What a propose's first forward reads: per request its real rows (feature rows, next tokens,
    positions), then its mask rows at the positions after its last real row, packed, each at its
    next slot in its own blocks; rows past the last request's store nothing and belong to no
    sequence (padding sequences are empty); picks: each request's last real row (+ mask rows)."""
    seen = []
    send = FirstForwardGraphs.send

    def recording(self, bs, plan, ctx, tables):
        send(self, bs, plan, ctx, tables)
        args = (plan.ks, plan.num_real, ctx, plan.last_pos, plan.feature_rows, plan.next_tokens, plan.positions)
        fields = [
            t.tolist()
            for t in (
                self.rows,
                self.tokens,
                self.positions,
                self.slot_mapping,
                self.mask,
                self.pick,
                self.sel,
                self.cu_query_lens,
                self.seq_lens,
            )
        ]
        seen.append((self, bs, [list(a) for a in args], [list(t) for t in tables], fields, self.block_tables.clone()))

    monkeypatch.setattr(FirstForwardGraphs, "send", recording)
    _run(str(tiny_llama_dir), method, heads[method], "static", _prompts(5, seed=5), _greedy(5), monkeypatch)
    parallel = method == "p-eagle"
    assert any(bs > len(args[0]) for _, bs, args, *_ in seen)
    assert any(len(set(args[0])) > 1 for _, _, args, *_ in seen)  # requests near their end draft fewer
    for first, bs, args, tables, fields, block_tables in seen:
        ks, num_real, ctx, last_pos, feature_rows, next_tokens, positions = args
        rows, tokens, pos, slots, mask, pick, sel, cu, seq_lens = fields
        n, p, bsz = len(ks), first.picks_per_req, first.block_size
        q = [m + (k - 1 if parallel else 0) for m, k in zip(num_real, ks)]
        total = sum(q)
        assert cu[: bs + 1] == list(np.cumsum([0] + q)) + [total] * (bs - n)
        assert seq_lens[:bs] == [c + x for c, x in zip(ctx, q)] + [0] * (bs - n)
        assert slots[total : bs * first.rows_per_req] == [-1] * (bs * first.rows_per_req - total)
        r, picked = 0, []
        for i in range(n):
            start, m, e = cu[i], num_real[i], q[i] - num_real[i]
            assert (
                rows[start : start + m] == feature_rows[r : r + m]
                and tokens[start : start + m] == next_tokens[r : r + m]
            )
            assert pos[start : start + m + e] == positions[r : r + m] + list(
                range(last_pos[i] + 1, last_pos[i] + 1 + e)
            )
            assert mask[start : start + m + e] == [0] * m + [1] * e
            assert slots[start : start + m + e] == [
                tables[i][x // bsz] * bsz + x % bsz for x in range(ctx[i], ctx[i] + m + e)
            ]
            assert block_tables[i, : len(tables[i])].tolist() == tables[i]
            count = ks[i] if parallel else 1
            assert pick[i * p : i * p + count] == list(range(start + m - 1, start + m - 1 + count))
            picked += range(i * p, i * p + count)
            r += m
        assert sel[: len(picked)] == picked


def test_pinned_upload_round_trip():
    up = PinnedUpload(torch.device("cpu"), slots=2)
    rng = np.random.default_rng(0)
    sent = []
    for i in range(5):  # more sends than slots: earlier tensors stay intact (fresh device memory)
        arrays = [
            rng.integers(-5, 1 << 40, size=i + 1),
            rng.integers(0, 1 << 20, size=(2, i + 2)).astype(np.int32),
            np.zeros(0, dtype=np.int64),
            np.arange(3, dtype=np.int32),
        ]
        sent.append((arrays, up.send(arrays)))
    for arrays, dev in sent:
        for a, d in zip(arrays, dev):
            assert d.dtype == {np.int64: torch.int64, np.int32: torch.int32}[a.dtype.type]
            assert d.shape == a.shape and d.numpy().tolist() == a.tolist()
            # Every piece starts 16-byte aligned (one Triton variant whatever the batch's lengths).
            assert d.data_ptr() % 16 == 0, (a.shape, d.data_ptr() % 16)
    cu, seq_lens, tables, slots = attention_arrays([1, 0], [1, 3], [[5], [7, 1]], 2)
    assert cu.tolist() == [0, 1, 4] and seq_lens.tolist() == [2, 3]
    assert tables.tolist() == [[5, 0], [7, 1]] and slots.tolist() == [11, 14, 15, 2]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("method", ["eagle-reduced", "eagle3-reduced", "p-eagle-reduced"])
def test_static_forwards_with_a_reduced_vocab(method, sampling, heads, d2t, tiny_llama_dir, monkeypatch):
    """A reduced-vocabulary head through the static buffers (logits [bs, draft_vocab], argmax mapped
    through d2t inside the forward, fed to the next step) proposes what the eager head proposes,
    only d2t tokens, and greedy output equals plain decoding."""
    target, prompts = str(tiny_llama_dir), _prompts(5, seed=9)
    params = (
        _greedy(5)
        if sampling == "greedy"
        else [
            SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=14, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=1.2, top_k=20, seed=99, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3, max_tokens=17, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=8, min_p=0.05, max_tokens=12, ignore_eos=True),
        ]
    )
    eager, eager_props, _ = _run(target, method, heads[method], "eager", prompts, params, monkeypatch)
    static, static_props, llm = _run(target, method, heads[method], "static", prompts, params, monkeypatch)
    assert static == eager
    if sampling == "greedy":
        plain, _, _ = _run(target, None, None, "auto", prompts, params, monkeypatch)
        assert static == plain
    _same_proposals(static_props, eager_props)
    _check_static_runs(llm.engine.spec.proposer, method, 5, static_props)
    proposer = llm.engine.spec.proposer
    width = len(d2t)
    assert all(out[1].shape[-1] == width for out in proposer.first.outputs.values())  # (out, logits, argmax)
    if proposer.steps is not None:
        assert all(out[0].shape[-1] == width for out in proposer.steps.outputs.values())  # (logits, argmax)
    allowed = set(d2t)
    outside = torch.ones(llm.engine.loaded.arch.vocab_size, dtype=torch.bool)
    outside[d2t] = False
    assert any(drafts for p in static_props for drafts, _ in p)
    for p in static_props:
        for drafts, q in p:
            assert set(drafts) <= allowed
            assert q is None or not q[:, outside].any()
    assert (sampling == "seeded") == any(q is not None for p in static_props for _, q in p)
