"""Host work per draft forward (issue 5): build_host_batch's per-request loop, the draft model's
chained single-token steps (speculative/proposers/draft_model.py _ChainSteps) and Staging.put give the inputs the
generic path gives (CPU)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.runner import batch as batch_mod
from specserve.runner.batch import Staging, block_table_array, build_host_batch
from specserve.scheduler.request import PLACEHOLDER
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from specserve.speculative.proposers.draft_model import _ChainSteps

BS = 4  # block size: queries cross block boundaries often


@dataclass
class Seq:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    spec_tree_parents: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def reference_batch(sched: SchedulerOutput, block_ids_of, bs: int) -> dict[str, list]:
    """Token by token."""
    out = {k: [] for k in ("ids", "pos", "slots", "seq_lens", "cu", "logits", "rows")}
    out["cu"].append(0)
    start = 0
    for s in sched.scheduled:
        r, n = s.request, s.num_new_tokens
        blocks = block_ids_of(r.request_id)
        known = r.all_token_ids + r.spec_token_ids
        for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
            out["ids"].append(known[p])
            out["pos"].append(p)
            out["slots"].append(blocks[p // bs] * bs + p % bs)
        out["seq_lens"].append(r.num_computed_tokens + n)
        if s.samples:
            rows = s.num_spec_tokens + 1
            out["rows"].append((len(out["logits"]), rows))
            out["logits"].extend(range(start + n - rows, start + n))
        else:
            out["rows"].append(None)
        start += n
        out["cu"].append(start)
    return out


def random_schedule(rng: random.Random, num_seqs: int) -> tuple[SchedulerOutput, dict[str, list[int]]]:
    sched, blocks = SchedulerOutput(), {}
    for i in range(num_seqs):
        kind = rng.choice(["decode", "verify", "chunk", "long"])
        length = rng.randint(1, 60)
        tokens = [rng.randrange(1000) for _ in range(length)]
        if kind == "decode":
            seq, n, spec = Seq(f"r{i}", tokens, length - 1), 1, 0
        elif kind == "verify":
            spec = rng.randint(1, 5)
            seq, n = Seq(f"r{i}", tokens, length - 1, [rng.randrange(1000) for _ in range(spec)]), spec + 1
        else:  # a prefill chunk, sampling or not; "long" ones take the vectorized slots
            c = rng.randint(0, length - 1)
            n = rng.randint(1, length - c) if kind == "chunk" else length - c
            seq, spec = Seq(f"r{i}", tokens, c), 0
        sched.scheduled.append(ScheduledRequest(seq, n, spec))
        need = -(-(seq.num_computed_tokens + n) // BS)
        blocks[seq.request_id] = rng.sample(range(500), need + rng.randint(0, 2))
    return sched, blocks


@pytest.mark.parametrize("seed", range(40))
def test_build_host_batch_matches_token_by_token(seed: int) -> None:
    rng = random.Random(seed)
    sched, blocks = random_schedule(rng, rng.choice([1, 1, 2, 5, 9]))
    if seed % 4 == 0:  # long queries: every slot from the vectorized gather
        for s in sched.scheduled[:1]:
            s.request.all_token_ids += list(range(40))
            s.num_new_tokens, s.num_spec_tokens = s.request.num_tokens - s.request.num_computed_tokens, 0
            s.request.spec_token_ids = []
            blocks[s.request.request_id] = list(range(300, 300 + -(-s.request.num_tokens // BS)))
    host = build_host_batch(sched, blocks.get, BS)
    want = reference_batch(sched, blocks.get, BS)
    assert host.input_ids.tolist() == want["ids"] and host.positions.tolist() == want["pos"]
    assert host.slot_mapping.tolist() == want["slots"] and host.seq_lens.tolist() == want["seq_lens"]
    assert host.cu_query_lens.tolist() == want["cu"] and host.logits_indices.tolist() == want["logits"]
    assert host.logit_rows == want["rows"]
    assert host.query_lens == [s.num_new_tokens for s in sched.scheduled]
    lists = [blocks[s.request.request_id] for s in sched.scheduled]
    assert host.block_tables.tolist() == block_table_array(lists).tolist()
    for row, b in zip(host.block_tables.tolist(), lists):
        assert row[: len(b)] == b and not any(row[len(b) :])
    assert host.input_ids.dtype == np.int64 and host.block_tables.dtype == np.int32
    assert host.seq_lens.dtype == np.int32 and host.cu_query_lens.dtype == np.int32


def test_chain_step_batch_is_the_generic_one() -> None:
    """What _ChainSteps builds for step s equals build_host_batch over the same sequences with a
    placeholder at their end (the way the draft's forwards were built before)."""
    rng = random.Random(0)
    seqs, blocks = [], {}
    for i in range(5):
        length = rng.randint(3, 40)
        seqs.append(Seq(f"r{i}", [rng.randrange(1000) for _ in range(length)], length))
        blocks[f"r{i}"] = rng.sample(range(200), -(-(length + 3) // BS))
    chain = _ChainSteps(SimpleNamespace(block_size=BS), SimpleNamespace(block_ids=blocks.get))
    tables = block_table_array([blocks[s.request_id] for s in seqs])
    base = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
    for step in (1, 2, 3):
        host = chain.host_batch(base + (step - 1), tables)
        for s in seqs:
            s.all_token_ids.append(PLACEHOLDER)
        sched = SchedulerOutput([ScheduledRequest(s, 1, 0) for s in seqs], len(seqs))
        want = build_host_batch(sched, blocks.get, BS)
        for name in (
            "input_ids",
            "positions",
            "slot_mapping",
            "block_tables",
            "seq_lens",
            "cu_query_lens",
            "logits_indices",
        ):
            assert getattr(host, name).tolist() == getattr(want, name).tolist(), name
            assert getattr(host, name).dtype == getattr(want, name).dtype, name
        assert host.query_lens == want.query_lens and host.logit_rows == want.logit_rows
        for s in seqs:
            s.num_computed_tokens += 1


def test_staging_put_gives_the_array_and_reuses_its_views(monkeypatch) -> None:
    empty = torch.empty
    monkeypatch.setattr(batch_mod.torch, "empty", lambda *a, pin_memory=False, **kw: empty(*a, **kw))
    st = Staging(torch.device("cpu"))
    a = np.arange(5, dtype=np.int64)
    t1 = st.put("x", a)
    assert t1.tolist() == a.tolist()
    t2 = st.put("x", a + 10)
    assert t2 is t1 and t2.tolist() == (a + 10).tolist()  # same view, new contents
    tables = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert st.put("t", tables).tolist() == tables.tolist()
    big = np.arange(200, dtype=np.int64)  # grows the buffers
    assert st.put("x", big).tolist() == big.tolist()
    assert st.put("x", a).tolist() == a.tolist()
    as32 = np.arange(7, dtype=np.int32)  # another dtype: a new buffer
    got = st.put("x", as32)
    assert got.dtype == torch.int32 and got.tolist() == as32.tolist()


def assert_self_draft_is_plain(model_dir, prompts: list[list[int]], budgets: list[int], **spec_cfg) -> None:
    """A model drafting for itself (greedy, fixed k unless spec_cfg says otherwise): the output is plain
    decoding's and every draft is accepted (its KV positions and slots are right)."""
    plain = LLM(model=str(model_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    spec = LLM(
        model=str(model_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={"method": "draft_model", "model": str(model_dir), "adaptive": False, **spec_cfg},
    )
    outs = []
    for llm in (plain, spec):
        got = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in budgets],
        )
        outs.append([o.outputs[0].token_ids for o in got])
    assert outs[0] == outs[1]
    st = spec.engine.stats
    assert st.get("spec_decode_num_accepted_tokens_total") == st.get("spec_decode_num_draft_tokens_total") > 0


def test_self_draft_with_different_budgets_accepts_every_draft(tiny_llama_dir) -> None:
    """Requests of one batch with different remaining budgets draft different k: the chained steps
    drop requests as they reach their k. Drafting for itself, every draft matches the target (its
    KV positions and slots are right) and the output is plain decoding's."""
    prompts = [[5 + i for i in range(8 + 3 * r)] for r in range(4)]
    assert_self_draft_is_plain(tiny_llama_dir, prompts, [6, 9, 11, 14], num_speculative_tokens=4)


def test_catch_up_cap_pieces_long_catch_ups(tiny_llama_dir) -> None:
    """With catch-up graphs of up to 64 tokens for up to 32 sequences, a catch-up with one sequence over
    64 tokens and none over 256 is fed in pieces of 64 (each a graph replay); otherwise one forward."""
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3},
    )
    proposer = llm.engine.spec.proposer
    assert proposer.catch_up_cap([172]) is None  # no graphs (the CPU)
    proposer.runner.graphs = SimpleNamespace(
        catch_up_query_lens=(4, 16, 64), sizes_by_q={64: (1, 2, 4, 8, 16, 32)}, mixed_sizes={}
    )
    assert proposer.catch_up_cap([172]) == 64 and proposer.catch_up_cap([172, 1]) == 64
    assert proposer.catch_up_cap([40, 40]) is None  # each fits a graph as it is
    assert proposer.catch_up_cap([300]) is None  # eager: one forward beats 5 replays
    assert proposer.catch_up_cap([100, 1, 1]) == 64 and proposer.catch_up_cap([100] * 32) == 64
    assert proposer.catch_up_cap([100] * 33) is None  # no catch-up graph for 33 sequences
    # With mixed graphs (up to 256 tokens for up to 16 sequences here) a catch-up they hold goes whole.
    proposer.runner.graphs.mixed_sizes = {128: (1, 2, 4, 8, 16), 256: (1, 2, 4, 8, 16)}
    assert proposer.catch_up_cap([172, 1]) is None and proposer.catch_up_cap([172] + [2] * 15) is None
    assert proposer.catch_up_cap([172, 172]) == 64  # 344 tokens: more than the largest mixed graph
    assert proposer.catch_up_cap([100] * 2 + [1] * 15) == 64  # 17 sequences: more than its largest batch


def test_catch_ups_in_pieces_keep_every_draft_right(tiny_llama_dir, monkeypatch) -> None:
    """Catch-ups fed in pieces of 5 tokens (the cap forced; on a GPU it is the prefill graphs' 64): a
    model drafting for itself still has every draft accepted, and the output is plain decoding's. The
    table drafts only while at most 2 requests run, so the draft catches up on whole prompts."""
    from specserve.speculative.proposers.draft_model import DraftModelProposer

    monkeypatch.setattr(DraftModelProposer, "catch_up_cap", lambda self, unseen: 5)
    longest: list[int] = []
    real = DraftModelProposer._catch_up

    def spy(self, seqs):
        longest.append(max(s.num_tokens - s.num_computed_tokens for s in seqs))
        return real(self, seqs)

    monkeypatch.setattr(DraftModelProposer, "_catch_up", spy)
    prompts = [[5 + (7 * i + r) % 50 for i in range(9 + 4 * r)] for r in range(4)]
    assert_self_draft_is_plain(
        tiny_llama_dir,
        prompts,
        [6, 9, 13, 17],
        num_speculative_tokens=3,
        num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 64, 0]],
    )
    assert max(longest) > 10  # some catch-up took three pieces or more


def test_a_catch_up_goes_in_forwards_beyond_the_scheduler_budget(tiny_llama_dir, monkeypatch) -> None:
    """A catch-up whose unseen tokens exceed the scheduler's token budget (32 here)
    runs in forwards of up to CATCH_UP_BATCHED_TOKENS, not of the budget: a drafting start at high load
    feeds every request's context, and each eager forward costs its launches. Drafting for itself, every
    draft is still accepted and the output is plain decoding's (the table drafts only at <= 2 requests,
    so the draft catches up on the two left once the third finishes)."""
    from specserve.speculative.proposers import draft_model
    from specserve.speculative.proposers.draft_model import DraftModelProposer

    sizes: list[int] = []
    real = DraftModelProposer._catch_up

    def spy(self, seqs):
        runner_execute = self.runner.execute

        def execute(sched, *a, **kw):
            sizes.append(sched.num_batched_tokens or sum(x.num_new_tokens for x in sched.scheduled))
            return runner_execute(sched, *a, **kw)

        self.runner.execute = execute
        try:
            return real(self, seqs)
        finally:
            del self.runner.execute

    monkeypatch.setattr(DraftModelProposer, "_catch_up", spy)
    prompts = [[5 + (3 * i + r) % 50 for i in range(40 + 5 * r)] for r in range(3)]
    plain = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=32)
    spec = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        max_num_batched_tokens=32,
        speculative_config={
            "method": "draft_model",
            "model": str(tiny_llama_dir),
            "adaptive": False,
            "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 0]],
        },
    )
    assert spec.engine.spec.proposer.max_batched == draft_model.CATCH_UP_BATCHED_TOKENS
    outs = []
    for llm in (plain, spec):
        got = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 24, 6)],
        )
        outs.append([o.outputs[0].token_ids for o in got])
    assert outs[0] == outs[1]
    assert max(sizes) > 32  # a context of 45-70 tokens in one forward, beyond the budget of 32
    st = spec.engine.stats
    assert st.get("spec_decode_num_accepted_tokens_total") == st.get("spec_decode_num_draft_tokens_total") > 0
