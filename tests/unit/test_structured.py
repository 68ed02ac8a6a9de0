"""Structured output without a model: spec parsing, OpenAI mapping, the grammar LRU, bitmask
application, draft cutting, k+1 masks, and random walks that must yield schema-valid JSON."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from specserve.sample.grammar_cache import GrammarCache, StructuredSpec, parse_structured_outputs
from specserve.sample.structured import (
    StructuredOutputs,
    apply_token_bitmask,
    structured_from_openai,
    validate_structured_outputs,
)
from specserve.sampling_params import SamplingParams
from specserve.scheduler.request import Request
from tests.helpers.tiny_models import make_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2},
        "nick": {"type": "string", "minLength": 1, "maxLength": 4},
    },
    "required": ["name", "age", "tags"],
}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def token_bytes(tok) -> list[bytes]:
    return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)).decoded_vocab


@pytest.fixture()
def so(tok):
    return StructuredOutputs(tok, len(tok), [tok.eos_token_id])


def _req(rid: str, params: SamplingParams, eos: int) -> Request:
    return Request(rid, [5, 6, 7], params, 256, (eos,))


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


# -- spec parsing and the OpenAI mapping ---------------------------------------------------------
def test_parse_kinds_and_canonical_form():
    assert parse_structured_outputs(None) is None
    spec = parse_structured_outputs({"json": json.dumps(SCHEMA)})
    assert spec == parse_structured_outputs({"json": SCHEMA, "regex": None, "json_object": False})
    assert spec.kind == "json" and spec.any_whitespace
    assert not parse_structured_outputs({"json": SCHEMA, "disable_any_whitespace": True}).any_whitespace
    # Key order is generation order: two orders are two grammars.
    swapped = {"type": "object", "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    assert parse_structured_outputs({"json": swapped}) != parse_structured_outputs(
        {"json": {"type": "object", "properties": SCHEMA["properties"]}}
    )
    assert parse_structured_outputs({"choice": ["a", "b"]}) == StructuredSpec("choice", '["a", "b"]')
    assert parse_structured_outputs({"json_object": True}).kind == "json_object"


@pytest.mark.parametrize(
    "bad, words",
    [
        ({}, "exactly one"),
        ({"json": SCHEMA, "regex": "a+"}, "exactly one"),
        ({"jsonn": SCHEMA}, "unknown keys"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema object"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": "yes"}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be True"),
        ({"structural_tag": "{}"}, "structured_outputs.structural_tag is not supported"),
        ({"json": {"type": "foo"}}, "structured_outputs.json: invalid JSON schema: Unsupported type"),
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "structured_outputs.json"),
        ({"regex": "(abc"}, "structured_outputs.regex: invalid regex"),
        ({"regex": "(?=x)a"}, "structured_outputs.regex: invalid regex"),
        ({"grammar": "root ::= foo"}, "structured_outputs.grammar: invalid EBNF grammar"),
        ("json", "structured_outputs must be a dict"),
    ],
)
def test_invalid_specs_name_the_field(bad, words):
    with pytest.raises(ValueError, match="structured_outputs") as e:
        validate_structured_outputs(bad)
    assert words in str(e.value)
    assert "/project/" not in str(e.value)  # xgrammar's source location is stripped


def test_structured_from_openai_maps_every_source():
    assert structured_from_openai(None, None) is None
    assert structured_from_openai({"type": "text"}, {}) is None
    assert structured_from_openai({"type": "json_object"}, None) == {"json_object": True}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    assert structured_from_openai(rf, None) == {"json": SCHEMA}
    assert structured_from_openai(None, {"structured_outputs": {"regex": "a+"}}) == {"regex": "a+"}
    assert structured_from_openai(None, {"guided_json": SCHEMA}) == {"json": SCHEMA}
    assert structured_from_openai(None, {"guided_regex": "[0-9]+"}) == {"regex": "[0-9]+"}
    assert structured_from_openai(None, {"guided_choice": ["x", "y"]}) == {"choice": ["x", "y"]}
    assert structured_from_openai(None, {"guided_grammar": 'root ::= "a"'}) == {"grammar": 'root ::= "a"'}
    # Unrelated extra fields and a text response_format leave the output free.
    assert structured_from_openai({"type": "text"}, {"top_k": 5, "guided_decoding_backend": "xgrammar"}) is None


@pytest.mark.parametrize(
    "rf, extra, words",
    [
        ({"type": "json_schema"}, None, "response_format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, None, "response_format.json_schema.schema is required"),
        ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, None, "response_format.json_schema.name"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
            None,
            "response_format.json_schema.schema: invalid JSON schema",
        ),
        ({"type": "yaml"}, None, "response_format.type must be"),
        ({"type": "structural_tag"}, None, "response_format.type must be"),
        ("json", None, "response_format must be an object"),
        ({"type": "json_object"}, {"guided_regex": "a"}, "only one of"),
        (None, {"guided_json": SCHEMA, "guided_choice": ["a"]}, "only one of"),
        (None, {"structured_outputs": "json"}, "structured_outputs must be an object"),
        (None, {"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex: invalid regex"),
        (None, {"guided_regex": "(a"}, "guided_regex: invalid regex"),
        (None, {"guided_json": "{bad"}, "guided_json is not valid JSON"),
        (None, {"guided_choice": []}, "guided_choice must be a non-empty list"),
        (None, {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern is not supported"),
    ],
)
def test_structured_from_openai_rejects_bad_input(rf, extra, words):
    with pytest.raises(ValueError) as e:
        structured_from_openai(rf, extra)
    assert words in str(e.value)


# -- the compiled-grammar LRU --------------------------------------------------------------------
def test_grammar_cache_is_an_lru(tok):
    cache = GrammarCache(tok, len(tok), [tok.eos_token_id], max_entries=2)
    a, b, c = (parse_structured_outputs({"regex": r}) for r in ("a+", "b+", "c+"))
    first = cache.get(a)
    assert cache.get(a) is first and (cache.hits, cache.misses) == (1, 1)
    cache.get(b)
    cache.get(a)  # a is now the most recent; b is evicted by c
    cache.get(c)
    assert a in cache and c in cache and b not in cache and len(cache) == 2
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        cache.get(parse_structured_outputs({"regex": "a{2,1}"}))
    assert len(cache) == 2


def test_compile_needs_a_tokenizer():
    so = StructuredOutputs(None, 100, [0])
    assert so.compile(SamplingParams()) is None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        so.compile(SamplingParams(structured_outputs={"regex": "a"}))


# -- masks ---------------------------------------------------------------------------------------
def test_apply_token_bitmask_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 77, [0, 2, 3]
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), 3), dtype=torch.int32, generator=gen)
    out = apply_token_bitmask(logits, bitmask, rows)
    expected = logits.clone()
    for i, row in enumerate(rows):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    assert torch.equal(out, expected)
    assert not torch.isinf(logits).any()  # a copy: the runner's logits are not touched


@pytest.mark.parametrize("field", ["name", "free"])
def test_json_strings_exclude_control_characters_and_surrogates(so, tok, token_bytes, field):
    """xgrammar <= 0.2.9 lets raw control characters into strings with maxLength, and UTF-16
    surrogates (not UTF-8) into every string: both make invalid JSON."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "free": {"type": "string"}}}
    req = _req("r", SamplingParams(structured_outputs={"json": schema}), tok.eos_token_id)
    so.add(req, so.compile(req.params))
    assert not so.advance(req, tok.encode('{"' + field + '": "a'))
    allowed = _allowed(so._masks_for(so._states["r"], ()).bitmask[0], len(tok))
    control = {t for t in range(len(tok)) if any(b < 32 for b in token_bytes[t])}
    assert control and not control & allowed
    lead = next(t for t in range(len(tok)) if token_bytes[t] == b"\xed")
    assert lead in allowed and not so.advance(req, [lead])  # U+D000..U+D7FF start with ED 80..9F
    allowed = _allowed(so._masks_for(so._states["r"], ()).bitmask[0], len(tok))
    assert not any(0xA0 <= token_bytes[t][0] <= 0xBF for t in allowed if token_bytes[t])


def _walk_text(token_bytes: list[bytes], token_ids: list[int]) -> str:
    return b"".join(token_bytes[t] for t in token_ids[:-1]).decode("utf-8")  # strict: no U+FFFD


@pytest.mark.parametrize("any_whitespace", [True, False])
def test_random_walks_through_apply_yield_valid_json(so, tok, token_bytes, any_whitespace):
    """Uniform sampling from masked logits, as the engine does it, always ends in valid JSON."""
    spec = {"json": SCHEMA, "disable_any_whitespace": not any_whitespace}
    reqs = [_req(f"w{i}", SamplingParams(structured_outputs=spec), tok.eos_token_id) for i in range(12)]
    plain = _req("plain", SamplingParams(), tok.eos_token_id)
    grammar = so.compile(reqs[0].params)
    for r in reqs:
        so.add(r, grammar)
    gen = torch.Generator().manual_seed(1)
    live = list(reqs)
    for _ in range(400):
        if not live:
            break
        batch = live + [plain]
        logits = so.apply(torch.zeros(len(batch), len(tok)), batch, [0] * len(batch))
        assert torch.isfinite(logits[-1]).all()  # the unstructured row is untouched
        noise = torch.empty_like(logits).exponential_(generator=gen)
        tokens = (logits.softmax(-1) / noise).argmax(-1).tolist()
        for r, t in zip(list(live), tokens):
            r.append_output_tokens([t])
            if so.advance(r, [t]):
                live.remove(r)
                so.release(r)
        so.prepare(live)
    assert not live
    for r in reqs:
        assert r.output_token_ids[-1] == tok.eos_token_id
        jsonschema.validate(json.loads(_walk_text(token_bytes, r.output_token_ids)), SCHEMA)
    assert so.num_sync_fills == 0  # every mask was filled ahead, in the worker


def test_drafts_are_cut_and_k_plus_1_masks_match_stepwise(so, tok):
    req = _req("d", SamplingParams(structured_outputs={"regex": "ab(c|d)e"}), tok.eos_token_id)
    so.add(req, so.compile(req.params))
    a, b, c, d, e, x = (tok.convert_tokens_to_ids(ch) for ch in "abcdex")
    req.spec_token_ids = [a, b, x, c]  # x is invalid: one-hot drafts stop before it
    so.prepare([req])
    assert req.spec_token_ids == [a, b]
    masks = so._masks_for(so._states["d"], (a, b))
    assert masks.bitmask.shape[0] == 3
    ref = xgr.GrammarMatcher(so.cache.get(parse_structured_outputs({"regex": "ab(c|d)e"})))
    for j, tok_id in enumerate([a, b, None]):
        row = torch.zeros(1, so.num_words, dtype=torch.int32)
        ref.fill_next_token_bitmask(row)
        assert torch.equal(row[0], masks.bitmask[j])
        if tok_id is not None:
            ref.accept_token(tok_id)
    allowed = _allowed(masks.bitmask[2], len(tok))
    assert {c, d} <= allowed and {tok.decode([t]) for t in allowed} <= {"c", "d", "ce", "de"}
    # The matcher was rolled back: it still expects the first token.
    assert not so.advance(req, [a, b, d, e])
    assert so.advance(req, [tok.eos_token_id])  # terminated: the request must end


def test_sampled_drafts_keep_the_first_rejected_token(so, tok):
    """Dropping a sampled draft because it is invalid would bias verification; it is kept (and is
    always rejected, its target prob being 0), the drafts after it are dropped."""
    req = _req("p", SamplingParams(structured_outputs={"regex": "abc"}), tok.eos_token_id)
    so.add(req, so.compile(req.params))
    a, b, c, x = (tok.convert_tokens_to_ids(ch) for ch in "abcx")
    req.spec_token_ids = [a, x, c, c]
    req.spec_draft_probs = torch.full((4, len(tok)), 1.0 / len(tok))
    so.prepare([req])
    assert req.spec_token_ids == [a, x] and req.spec_draft_probs.shape[0] == 2
    # Drafts after a stop token are dropped whatever their kind.
    req.spec_token_ids, req.spec_draft_probs = [a, b, c, tok.eos_token_id, a], None
    so.prepare([req])
    assert req.spec_token_ids == [a, b, c, tok.eos_token_id]


def test_apply_masks_each_position_in_a_mixed_batch(so, tok):
    choice = _req("c", SamplingParams(structured_outputs={"choice": ["yes", "no"]}), tok.eos_token_id)
    plain = _req("plain", SamplingParams(), tok.eos_token_id)
    so.add(choice, so.compile(choice.params))
    choice.spec_token_ids = [tok.convert_tokens_to_ids("y")]
    so.prepare([choice])
    out = so.apply(torch.zeros(1 + 2, len(tok)), [plain, choice], [0, 1])  # plain: 1 row; choice: 2

    def allowed(row: int) -> set[str]:
        return {tok.decode([t]) for t in torch.isfinite(out[row]).nonzero().flatten().tolist()}

    assert torch.isfinite(out[0]).all()
    assert {"y", "n"} <= allowed(1) <= {"y", "ye", "yes", "n", "no"}
    assert "e" in allowed(2) and allowed(2) <= {"e", "es"}
    # The scheduler may verify fewer drafts than were prepared: a prefix of the masks serves.
    assert torch.equal(so.apply(torch.zeros(1, len(tok)), [choice], [0])[0], out[1])
    assert so.num_sync_fills == 0


def test_rejected_token_ends_the_request(so, tok):
    req = _req("r", SamplingParams(structured_outputs={"regex": "[0-9]+"}), tok.eos_token_id)
    so.add(req, so.compile(req.params))
    assert so.advance(req, tok.encode("x"))  # masks prevent this; if it happens, the request ends


def test_walks_cover_every_kind(so, tok, token_bytes):
    """Random walks over the allowed tokens end in a match for regex, choice, EBNF and json_object."""
    rng = random.Random(0)
    cases = [
        ({"regex": r"[a-c]{2,4}-[0-9]{1,2}"}, lambda s: re.fullmatch(r"[a-c]{2,4}-[0-9]{1,2}", s)),
        ({"choice": ["yes", "no", 'say "hi"']}, lambda s: s in ("yes", "no", 'say "hi"')),
        ({"grammar": 'root ::= "(" [0-9]+ ")" | "none"'}, lambda s: re.fullmatch(r"\([0-9]+\)|none", s)),
        ({"json_object": True, "disable_any_whitespace": True}, lambda s: isinstance(json.loads(s), dict)),
    ]
    for i, (spec, check) in enumerate(cases):
        req = _req(f"k{i}", SamplingParams(structured_outputs=spec), tok.eos_token_id)
        so.add(req, so.compile(req.params))
        for _ in range(300):
            logits = so.apply(torch.zeros(1, len(tok)), [req], [0])
            allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
            # Prefer the stop token half the time so open grammars (json_object) end quickly.
            t = tok.eos_token_id if tok.eos_token_id in allowed and rng.random() < 0.5 else rng.choice(allowed)
            req.append_output_tokens([t])
            if so.advance(req, [t]):
                break
            so.prepare([req])
        assert req.output_token_ids[-1] == tok.eos_token_id, spec
        assert check(_walk_text(token_bytes, req.output_token_ids)), spec
