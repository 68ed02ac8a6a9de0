"""Drafts left on the device for the verify step (speculative/proposers/draft_tokens.py DeferredDrafts): the verify
batch's placeholder drafts are filled from them, the ids reach the host before the rejection sampler,
and the output is the same as when propose reads its drafts back itself."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.runner.batch import (
    HostBatch,
    PendingTokens,
    pad_to_query_len,
    pending_fill,
)
from specserve.scheduler.request import PLACEHOLDER
from specserve.speculative.proposers import draft_tokens
from specserve.speculative.proposers.draft_tokens import (
    DeferredDrafts,
    DraftTokens,
    assign_resolved,
)
from tests.unit.test_draft_chain import assert_self_draft_is_plain


def _host(query_lens: list[int], ids: list[int]) -> HostBatch:
    n = len(ids)
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = np.asarray([10 + q for q in query_lens], dtype=np.int32)
    return HostBatch(
        np.asarray(ids, dtype=np.int64),
        np.arange(n, dtype=np.int64),
        np.arange(n, dtype=np.int64),
        np.zeros((len(query_lens), 4), dtype=np.int32),
        seq_lens,
        cu,
        np.arange(n, dtype=np.int64),
        query_lens,
        [(i, 1) for i in range(len(query_lens))],
    )


def test_pending_fill_reads_consecutive_rows_per_request() -> None:
    """A request's i-th placeholder reads row_of[request] + i, also after padding to a graph's length."""
    p = PLACEHOLDER
    host = _host([3, 1, 4], [7, p, p, 9, 8, p, p, p])
    pending = PendingTokens(torch.arange(100, 105), {"a": 0, "c": 2})
    dst, rows = pending_fill(host, ["a", "b", "c"], pending)
    assert dst.tolist() == [1, 2, 5, 6, 7] and rows.tolist() == [0, 1, 2, 3, 4]
    padded = pad_to_query_len(host, 4, 100)
    dst, rows = pending_fill(padded, ["a", "b", "c"], pending)
    assert padded.input_ids[dst].tolist() == [p] * 5 and rows.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="placeholder"):
        pending_fill(host, ["a", "b", "x"], pending)


def test_deferred_drafts_are_request_major_and_resolve_once() -> None:
    """Step-major drafts (requests dropping out as they reach their k) come out per request, in the
    pending rows and in what resolve() hands over."""
    dt = DraftTokens()
    dt.add([0, 1, 2], torch.tensor([10, 20, 30]), None)
    dt.add([0, 2], torch.tensor([11, 31]), None)
    dt.add([2], torch.tensor([32]), None)
    got = []
    flat, counts, probs = dt.request_major(3)
    assert counts == [2, 1, 3]
    d = DeferredDrafts(flat, counts, probs, ["a", "b", "c"], lambda drafts, probs: got.append((drafts, probs)))
    assert d.pending.tokens.tolist() == [10, 11, 20, 30, 31, 32]
    assert d.pending.row_of == {"a": 0, "b": 2, "c": 3}
    d.resolve()
    assert got == [([[10, 11], [20], [30, 31, 32]], [[], [], []])]


def test_assign_resolved_keeps_what_the_scheduler_left() -> None:
    p = PLACEHOLDER
    cut, whole, preempted = (
        SimpleNamespace(spec_token_ids=ids, spec_draft_probs=None) for ids in ([p, p], [p, p, p], [])
    )
    probs = [[torch.full((5,), float(i)) for i in range(3)]] * 3
    assign_resolved([cut, whole, preempted], [[1, 2, 3], [4, 5, 6], [7, 8, 9]], probs, [False, True, False])
    assert cut.spec_token_ids == [1, 2] and cut.spec_draft_probs.shape == (2, 5)
    assert whole.spec_token_ids == [4, 5, 6] and whole.spec_draft_probs is None  # greedy: one-hot
    assert preempted.spec_token_ids == []


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "p-eagle"])
def test_deferred_and_immediate_drafts_give_the_same_tokens(tiny_llama_dir, tmp_path, monkeypatch, method) -> None:
    """Greedy and seeded random requests in one batch, k = 3: the same tokens and acceptance with the
    drafts deferred (verify inputs filled on the device) as read back in propose, and the placeholders
    of deferred drafts were really filled; unset, deferral is on by default except for P-EAGLE.
    P-EAGLE: greedy requests only (its random drafts
    are read back in propose), through the static first forward (the GPU's graph path)."""
    from specserve.speculative.proposers.eagle import EagleProposer
    from tests.helpers.eagle_heads import make_random_head_dir

    spec = {"method": method, "model": str(tiny_llama_dir)}
    if method == "eagle3":
        spec["model"] = str(make_random_head_dir(str(tiny_llama_dir), tmp_path / "h"))
    elif method == "p-eagle":
        spec = {
            "method": "eagle3",
            "parallel_drafting": True,
            "model": str(make_random_head_dir(str(tiny_llama_dir), tmp_path / "p", num_mask_slots=2)),
        }
        monkeypatch.setattr(EagleProposer, "step_graphs", "static")
    prompts = [[5 + (3 * i + r) % 60 for i in range(6 + 5 * r)] for r in range(4)]
    params = [
        SamplingParams(
            temperature=0.0 if r % 2 == 0 or method == "p-eagle" else 0.8,
            seed=r,
            max_tokens=12 + 3 * r,
            ignore_eos=True,
        )
        for r in range(4)
    ]
    filled = []
    real_fill = pending_fill

    def spy(host, ids, pending):
        out = real_fill(host, ids, pending)
        filled.append(0 if out is None else len(out[0]))
        return out

    monkeypatch.setattr("specserve.runner.model_runner.pending_fill", spy)
    runs = {}
    for defer in ("1", "0"):
        llm = LLM(
            model=str(tiny_llama_dir),
            progress=False,
            kv_cache_memory_bytes=4 << 20,
            speculative_config={**spec, "num_speculative_tokens": 3, "adaptive": False},
        )
        llm.engine.spec.proposer.defer_drafts = defer == "1"  # either way, whatever the proposer's default
        filled.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        st = llm.engine.stats
        runs[defer] = (
            [o.outputs[0].token_ids for o in outs],
            st.get("spec_decode_num_accepted_tokens_total"),
            st.get("spec_decode_num_draft_tokens_total"),
        )
        assert (sum(filled) > 0) is (defer == "1")
        llm.engine.kv.check_integrity()
    assert runs["1"] == runs["0"] and runs["1"][2] > 0
    # Each proposer's default: P-EAGLE reads back (measured slower deferred), the others defer.
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={**spec, "num_speculative_tokens": 3, "adaptive": False},
    )
    assert llm.engine.spec.proposer.defer_drafts is (method != "p-eagle")


def test_deferred_self_drafts_are_all_accepted(tiny_llama_dir, monkeypatch) -> None:
    """A model drafting for itself through deferred drafts: every draft accepted, plain output; the
    drafts were resolved from DeferredDrafts (not read back in propose)."""
    resolved = []
    real = draft_tokens.DeferredDrafts.resolve
    monkeypatch.setattr(draft_tokens.DeferredDrafts, "resolve", lambda self: (resolved.append(1), real(self))[1])
    prompts = [[5 + i for i in range(8 + 3 * r)] for r in range(4)]
    assert_self_draft_is_plain(tiny_llama_dir, prompts, [6, 9, 11, 14], num_speculative_tokens=4)
    assert resolved


def test_abort_and_preemption_with_drafts_in_flight(tiny_llama_dir) -> None:
    """A request aborted while its deferred drafts are in flight, and preemptions forced by a small KV
    pool: the others still get plain decoding's tokens, and every block (target and draft) comes back."""
    prompts = [[5 + (7 * i + r) % 90 for i in range(10 + 6 * r)] for r in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=96 << 10,
        max_num_seqs=4,
        speculative_config={
            "method": "draft_model",
            "model": str(tiny_llama_dir),
            "num_speculative_tokens": 4,
            "adaptive": False,
        },
    )
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    got, aborted = {}, False
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        if not aborted and eng.spec.pending_drafts() is not None and "r1" in eng.spec.pending_drafts().row_of:
            eng.abort_request("r1")  # its placeholders are in flight: the next verify must not read them
            aborted = True
    assert aborted and eng.stats.get("num_preemptions_total") > 0
    assert {r: got[r] for r in ("r0", "r2", "r3")} == {"r0": want[0], "r2": want[2], "r3": want[3]}
    eng.kv.check_integrity()
    assert eng.num_blocks_in_use() == 0
    assert eng.spec.proposer.kv.num_free_blocks() == eng.spec.proposer.kv.num_blocks
