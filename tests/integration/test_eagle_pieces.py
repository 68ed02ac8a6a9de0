"""An EAGLE head with prompts fed in pieces or chunks (SpecDecoder.absorb, EagleProposer.absorb): every
prefill step that does not sample hands its target features to the head, so the head's context is the
whole prompt when the last piece drafts. Greedy output equals plain decoding, and the head's first
proposal after the prompt equals the one after a whole-prompt prefill."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.proposers.eagle import EagleProposer
from tests.helpers.eagle_heads import make_random_head_dir

K = 3
PROMPTS = [
    [5 + (7 * i) % 300 for i in range(50)],  # 50 tokens: pieces of 16, 16, 16, 2
    [11, 42, 7, 99, 23] * 8 + [3, 4],
]  # 42 tokens


@pytest.fixture(scope="module")
def heads(tiny_llama_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("piece-heads")
    return {
        "eagle3": str(make_random_head_dir(str(tiny_llama_dir), base / "eagle3", "eagle3")),
        "p-eagle": str(make_random_head_dir(str(tiny_llama_dir), base / "p", "eagle3", num_mask_slots=K - 1)),
    }


def _run(target: str, head: str | None, parallel: bool, piece: int | None, monkeypatch, **kw):
    """(outputs, first proposal per prompt, head rows when it first drafted, prefill chunk sizes)."""
    spec = (
        None
        if head is None
        else {
            "method": "eagle3",
            "model": head,
            "num_speculative_tokens": K,
            "adaptive": False,
            "parallel_drafting": parallel,
        }
    )
    monkeypatch.setattr(EagleProposer, "step_graphs", "eager")
    llm = LLM(
        model=target,
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config=spec,
        enable_prefix_caching=False,
        **kw,
    )
    eng = llm.engine
    eng.scheduler.prefill_piece = piece
    chunks: list[int] = []
    real = eng.scheduler.schedule

    def spy():
        out = real()
        chunks.extend(
            s.num_new_tokens for s in out.scheduled if s.request.num_computed_tokens < s.request.num_prompt_tokens
        )
        return out

    monkeypatch.setattr(eng.scheduler, "schedule", spy)
    async_steps = []
    if eng.async_scheduling and spec is not None:
        # Overlapped steps run only where the controller chose k = 0: choose it while a prompt is
        # still in prefill, so the pieces run as asynchronous steps (engine/async_loop.py) and absorb there.
        eng.spec.last_k = 0
        choose = eng.spec.choose
        monkeypatch.setattr(
            eng.spec,
            "choose",
            lambda b: (
                0 if any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) else choose(b)
            ),
        )
        overlapped = eng.async_loop.overlapped
        monkeypatch.setattr(eng.async_loop, "overlapped", lambda: async_steps.append(1) or overlapped())
    first: list = []
    context: list[int] = []
    proposer = eng.spec.proposer if spec else None
    if proposer is not None:
        propose = proposer.propose

        def recording(inp):
            propose(inp)
            proposer.resolve_deferred()
            if not first:  # one request at a time: its first proposal follows its prompt
                first.append([list(r.spec_token_ids) for r in inp.requests])
                context.append(proposer.seqs[inp.requests[0].request_id].num_computed_tokens)

        proposer.propose = recording
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs, firsts, contexts = [], [], []
    for p in PROMPTS:
        first.clear()
        context.clear()
        outs.append(llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids)
        firsts.append(list(first))
        contexts.append(list(context))
    if eng.async_scheduling and spec is not None:
        assert len(async_steps) >= 2 * len(PROMPTS), async_steps  # the pieces ran overlapped
    eng.kv.check_integrity()
    assert eng.num_blocks_in_use() == 0
    if proposer is not None:
        assert proposer.kv.num_free_blocks() == proposer.kv.num_blocks
    return outs, firsts, contexts, chunks


@pytest.mark.parametrize("method", ["eagle3", "p-eagle"])
@pytest.mark.parametrize("split", ["pieces", "pieces-async", "chunks"])
def test_head_sees_every_piece(method, split, heads, tiny_llama_dir, monkeypatch) -> None:
    target = str(tiny_llama_dir)
    plain, _, _, _ = _run(target, None, False, None, monkeypatch)
    parallel = method == "p-eagle"
    whole, whole_first, whole_ctx, whole_chunks = _run(target, heads[method], parallel, None, monkeypatch)
    kw = {"chunks": {"max_num_batched_tokens": 16}, "pieces-async": {"async_scheduling": True}}.get(split, {})
    cut, cut_first, cut_ctx, cut_chunks = _run(
        target, heads[method], parallel, None if split == "chunks" else 16, monkeypatch, **kw
    )
    assert max(whole_chunks) == 50 and max(cut_chunks) == 16, (whole_chunks, cut_chunks)
    assert whole == plain and cut == plain
    # The head drafted first with the whole prompt in its context (every row but the last position's
    # next token, whose feature the step after the prompt brings), in both runs.
    assert cut_ctx == whole_ctx == [[len(p)] for p in PROMPTS]
    assert cut_first == whole_first


def test_absorb_takes_only_rows_not_yet_seen(heads, tiny_llama_dir, monkeypatch) -> None:
    """A second absorb of the same step adds nothing (seq.next_pos guards the head's context)."""
    calls: list[int] = []
    absorb = EagleProposer.absorb

    def twice(self, inp):
        before = [self.seqs[r.request_id].num_computed_tokens if r.request_id in self.seqs else 0 for r in inp.requests]
        absorb(self, inp)
        mid = [self.seqs[r.request_id].num_computed_tokens for r in inp.requests]
        absorb(self, inp)
        assert [self.seqs[r.request_id].num_computed_tokens for r in inp.requests] == mid
        calls.append(sum(m - b for m, b in zip(mid, before)))

    monkeypatch.setattr(EagleProposer, "absorb", twice)
    outs, _, ctx, _ = _run(str(tiny_llama_dir), heads["eagle3"], False, 16, monkeypatch)
    assert calls and all(c == 16 for c in calls), calls  # pieces of 16 rows before the last piece
    assert ctx == [[len(p)] for p in PROMPTS]
    plain, _, _, _ = _run(str(tiny_llama_dir), None, False, None, monkeypatch)
    assert outs == plain
