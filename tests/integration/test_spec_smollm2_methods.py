"""Speculative decoding on the real SmolLM2-135M-Instruct: every method (ngram, EAGLE-1, EAGLE-3,
P-EAGLE) gives exactly the plain engine's greedy tokens for a batch of prompts of very different
lengths (raw text and chat-template prompts) with preemption forced by a small KV pool, and with
prefix caching on, when a request reuses another's cached prefix.

The tiny random models of test_spec_decode.py have a vocabulary of a few hundred tokens and
near-uniform logits; a real model has peaked logits, a 49k vocabulary and a real chat template, so
the lossless property is checked on it too. The EAGLE heads are random (no trained head for
SmolLM2 ships): they draft nonsense that verification must reject, which is the case that tests
losslessness; the ngram drafter on repetitive prompts covers the accepting side.

Needs the model in the cache: `specserve models install smollm2-135m-instruct` (CI runs it first).
A missing model is a failure, not a skip: a skipped lossless test looks like a pass.
"""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.model.catalog import install_command, model_path
from tests.helpers.eagle_heads import make_random_head_dir

MODEL = "smollm2-135m-instruct"
K = 3
# Small enough that the whole file stays well under a minute on two CPU cores (the random heads
# make every step verify K + 1 positions for one token), long enough for many draft/verify steps.
MAX_TOKENS = 24
BLOCK = 16  # the engine's default block_size, which every LLM below uses
MAX_MODEL_LEN = 8 * BLOCK
# The engine refuses a pool that cannot hold one max_model_len sequence (validate.check_kv_capacity),
# so the smallest legal pool is max_model_len's 8 blocks: each prompt below fits alone (the longest,
# ~66 tokens + 24 out + K lookahead, needs 6 blocks), the batch (~16 blocks) does not.
PREEMPT_BLOCKS = MAX_MODEL_LEN // BLOCK
ROOMY_BYTES = 64 << 20  # ~90 SmolLM2 blocks in float32: no preemption, no prefix-cache eviction
METHODS = ["ngram", "eagle", "eagle3", "p-eagle"]
COUNTERS = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    "num_preemptions_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
)

# Four prompts from ~5 to ~66 tokens; the colour list repeats so n-gram drafts get accepted.
RAW_PROMPTS = [
    "The capital of France is",
    "red, green, blue, red, green, blue, red, green, blue, red, green, blue, red, green,",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {
            "role": "system",
            "content": "You are a careful assistant. Answer in one short paragraph, and list the "
            "steps you take before giving the final answer to the user. Keep the words plain "
            "and short.",
        },
        {"role": "user", "content": "Explain how a bicycle gear works, in simple words for a child."},
    ],
]
# The prefix-caching test: a shared system text of more than three 16-token blocks, so a later
# request can reuse three full blocks of an earlier one; the questions differ after it.
SYSTEM = (
    "You are SmolLM, a helpful assistant for a public library. You answer questions about opening "
    "hours, borrowing rules, late fees and events. Keep every answer short, friendly and factual, "
    "and say so plainly when you do not know something."
)
QUESTIONS = ["When does the library open on Saturday?", "How many books can I borrow at once?"]


@pytest.fixture(scope="module")
def plain() -> LLM:
    """The reference: no speculation, no prefix caching, a pool that never preempts."""
    if model_path(MODEL) is None:
        pytest.fail(f"{MODEL} is not installed; run: {install_command(MODEL)}")
    return LLM(
        model=MODEL,
        progress=False,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=ROOMY_BYTES,
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    tok = plain.get_tokenizer()
    out = [list(tok.encode(p, add_special_tokens=False)) for p in RAW_PROMPTS]
    out += [plain.apply_chat_template(c) for c in CHATS]
    lengths = sorted(len(p) for p in out)
    # Guards the premise (a tokenizer or template change could make the lengths alike): short and
    # long prompts share the batch, and the longest still fits the pool alone.
    assert lengths[0] <= 8 and lengths[-1] >= 60 and len(set(lengths)) == len(lengths), lengths
    assert lengths[-1] + MAX_TOKENS + K + 1 <= MAX_MODEL_LEN
    return out


@pytest.fixture(scope="module")
def reference(plain: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return _generate(plain, prompts)


@pytest.fixture(scope="module")
def heads(plain: LLM, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Random-init heads in the on-disk format speculative_config.model takes (config.json +
    model.safetensors). Depends on `plain` so that a missing model fails there first."""
    base = tmp_path_factory.mktemp("smollm2-heads")
    return {
        "eagle": str(make_random_head_dir(MODEL, base / "eagle", "eagle")),
        "eagle3": str(make_random_head_dir(MODEL, base / "eagle3", "eagle3")),
        # P-EAGLE drafts K tokens in one forward: K - 1 mask slots after the last real position.
        "p-eagle": str(make_random_head_dir(MODEL, base / "p-eagle", "eagle3", num_mask_slots=K - 1)),
    }


def _spec_config(method: str, heads: dict[str, str]) -> dict:
    cfg = {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "eagle": {"method": "eagle", "model": heads["eagle"]},
        "eagle3": {"method": "eagle3", "model": heads["eagle3"]},
        "p-eagle": {"method": "eagle3", "model": heads["p-eagle"], "parallel_drafting": True},
    }[method]
    # adaptive off: the controller must not stop drafting once it sees random heads never accept.
    return {**cfg, "num_speculative_tokens": K, "adaptive": False}


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _counters(llm: LLM) -> dict[str, float]:
    return {name: llm.engine.stats.get(name) for name in COUNTERS}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in COUNTERS}


def _check_freed(llm: LLM) -> None:
    """Every block back in the pool, target's and drafter's, once all requests are done:
    preemption and prefix hits must not leak blocks (a leak would show as later preemptions)."""
    llm.engine.kv.check_integrity()
    assert llm.engine.num_blocks_in_use() == 0
    proposer = llm.engine.spec.proposer
    if hasattr(proposer, "kv"):  # EAGLE heads keep a paged KV of their own
        assert proposer.kv.num_free_blocks() == proposer.kv.num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_plain_with_preemption(
    method: str, plain: LLM, prompts: list[list[int]], reference: list[list[int]], heads: dict[str, str]
) -> None:
    bytes_per_block = plain.engine.runner.spec.bytes_per_block  # the target's KV layout on this device
    llm = LLM(
        model=MODEL,
        progress=False,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=PREEMPT_BLOCKS * bytes_per_block,
        speculative_config=_spec_config(method, heads),
    )
    assert llm.engine.kv.num_blocks == PREEMPT_BLOCKS
    got = _generate(llm, prompts)
    c = _counters(llm)
    for i, (g, r) in enumerate(zip(got, reference)):
        assert g == r, f"{method}: prompt {i} ({len(prompts[i])} tokens) differs from plain decoding; {c}"
    assert c["num_preemptions_total"] > 0, c  # else the small pool no longer forces what it is for
    assert c["spec_decode_num_drafts_total"] > 0 and c["spec_decode_num_draft_tokens_total"] > 0, c
    assert c["spec_decode_num_accepted_tokens_total"] <= c["spec_decode_num_draft_tokens_total"]
    if method == "ngram":  # the repeated colour list: the prompt's own n-grams predict the model
        assert c["spec_decode_num_accepted_tokens_total"] > 0, c
    _check_freed(llm)


@pytest.fixture(scope="module")
def prefix_prompts(plain: LLM) -> list[list[int]]:
    """Two requests sharing the chat template's system turn, then the first again (a hit on all of
    its full blocks: the EAGLE head then sees features for the uncached tail only)."""
    first, second = (
        plain.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    )
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 3 * BLOCK, shared  # three full blocks in common
    assert max(len(first), len(second)) + MAX_TOKENS + K + 1 <= MAX_MODEL_LEN
    return [first, second, first]


@pytest.fixture(scope="module")
def prefix_reference(plain: LLM, prefix_prompts: list[list[int]]) -> list[list[int]]:
    return _generate(plain, prefix_prompts[:2])  # the third request repeats the first


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_equals_plain_with_prefix_cache_hits(
    method: str, prefix_prompts: list[list[int]], prefix_reference: list[list[int]], heads: dict[str, str]
) -> None:
    llm = LLM(
        model=MODEL,
        progress=False,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=ROOMY_BYTES,
        enable_prefix_caching=True,
        speculative_config=_spec_config(method, heads),
    )
    expected = [prefix_reference[0], prefix_reference[1], prefix_reference[0]]
    before = _counters(llm)
    assert before["prefix_cache_hits_total"] == 0, before  # a fresh engine: nothing cached yet
    # One request at a time: each finishes (its blocks stay cached, the pool is roomy) before the next.
    for i, (prompt, want) in enumerate(zip(prefix_prompts, expected)):
        got = _generate(llm, [prompt])[0]
        after = _counters(llm)
        d = _delta(after, before)
        before = after
        assert got == want, f"{method}: request {i} differs from plain decoding (prefix caching off); {d}"
        assert d["spec_decode_num_drafts_total"] > 0, (i, d)
        if i == 0:
            assert d["prefix_cache_hits_total"] == 0, d
        elif i == 1:  # the shared system turn: at least its three full blocks come from the cache
            assert d["prefix_cache_hits_total"] >= 3 * BLOCK, d
        else:  # the first prompt again: every full block of it (the last token is always computed)
            assert d["prefix_cache_hits_total"] >= (len(prompt) - 1) // BLOCK * BLOCK, d
    assert after["num_preemptions_total"] == 0, after  # the hits, not preemption, are under test here
    _check_freed(llm)
