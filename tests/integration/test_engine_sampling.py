"""Engine-level sampling: seeds, n, stop strings/tokens, min_tokens, logprobs, detokenization."""

from __future__ import annotations

import math

from specserve import SamplingParams
from specserve.engine.detokenizer import IncrementalDetokenizer


def _gen(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    a = _gen(tiny_llm, "The quick brown", temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)
    b = _gen(tiny_llm, "The quick brown", temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    mixed = tiny_llm.generate(
        ["Paris is", "The quick brown", "def add"],
        [
            SamplingParams(temperature=0.7, max_tokens=16),
            SamplingParams(temperature=1.0, seed=123, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=16),
        ],
    )
    assert mixed[1].outputs[0].token_ids == a.outputs[0].token_ids
    c = _gen(tiny_llm, "The quick brown", temperature=1.0, seed=124, max_tokens=16, ignore_eos=True)
    assert c.outputs[0].token_ids != a.outputs[0].token_ids


def test_n_returns_distinct_seeded_samples(tiny_llm):
    out = _gen(tiny_llm, "alpha beta", n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in out.outputs)


def test_top_k_one_is_greedy(tiny_llm):
    g = _gen(tiny_llm, "numbers 0 1", temperature=0.0, max_tokens=10, ignore_eos=True)
    k1 = _gen(tiny_llm, "numbers 0 1", temperature=1.5, top_k=1, seed=9, max_tokens=10, ignore_eos=True)
    assert g.outputs[0].token_ids == k1.outputs[0].token_ids


def test_stop_token_ids_and_max_tokens(tiny_llm):
    g = _gen(tiny_llm, "numbers 0 1", temperature=0.0, max_tokens=10, ignore_eos=True).outputs[0]
    stop_tok = g.token_ids[4]
    first = g.token_ids.index(stop_tok)
    out = _gen(
        tiny_llm, "numbers 0 1", temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_tok]
    ).outputs[0]
    assert out.token_ids == g.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_stop_string_cuts_text(tiny_llm):
    g = _gen(tiny_llm, "The quick", temperature=0.0, max_tokens=24, ignore_eos=True).outputs[0]
    assert len(g.text) > 6
    stop = g.text[3:6]
    out = _gen(tiny_llm, "The quick", temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == g.text[: g.text.index(stop)]
    inc = _gen(
        tiny_llm,
        "The quick",
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    ).outputs[0]
    assert inc.text == g.text[: g.text.index(stop) + len(stop)]


def test_min_tokens_blocks_eos(tiny_llm):
    eos = tiny_llm.get_tokenizer().eos_token_id
    out = _gen(tiny_llm, "The", temperature=1.0, seed=1, max_tokens=20, min_tokens=20).outputs[0]
    assert len(out.token_ids) == 20 and eos not in out.token_ids


def test_logprobs_match_log_softmax(tiny_llm):
    out = _gen(tiny_llm, "alpha", temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True).outputs[0]
    assert len(out.logprobs) == 4
    for tok, step in zip(out.token_ids, out.logprobs):
        assert tok in step and step[tok].rank == 1  # greedy picks the most likely token
        assert len(step) == 3
        assert all(lp.logprob <= 0 for lp in step.values())
    assert math.isclose(
        out.cumulative_logprob, sum(s[t].logprob for t, s in zip(out.token_ids, out.logprobs)), rel_tol=1e-5
    )


def test_incremental_detokenizer_never_emits_broken_utf8(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    text = "café naïve 東京 🙂 done"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], [], False, True)
    seen = []
    for t in ids:
        d.add_tokens([t])
        seen.append(d.text)
        assert "\ufffd" not in d.text
    assert d.text == text
    assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))  # only ever appended


def test_streaming_holdback_of_stop_prefix(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    d = IncrementalDetokenizer(tok, [], ["STOPX"], False, True)
    d.add_tokens(tok.encode("hello ST"))
    assert d.visible_text(finished=False) == "hell"  # 4 chars held back: might begin "STOPX"
    assert d.visible_text(finished=True) == "hello ST"
