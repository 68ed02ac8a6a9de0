"""Structured output through LLM on a tiny random model, with and without n-gram speculation.

A random model rambles wherever the grammar lets it, so every schema bounds its strings, arrays
and numbers; most tests also set disable_any_whitespace (with any whitespace a random model may
pad between tokens for hundreds of tokens, which one test covers at a larger max_tokens).
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from specserve import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_model_dir

# adaptive=False: always draft, so every test really verifies drafts against the grammar.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
PROMPTS = ["Paris is", "def add(a, b):", "The quick brown", "numbers 0 1 2", "alpha beta"]
SCHEMAS = [
    {
        "type": "object",
        "properties": {  # nested objects
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                },
                "required": ["name", "id"],
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},  # arrays
        "minItems": 2,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {  # enums
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
    },
    {
        "type": "object",
        "properties": {  # bounded numbers
            "x": {"type": "number", "minimum": -2.5, "maximum": 3},
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["x", "n"],
    },
    {
        "type": "object",
        "properties": {  # optional fields
            "a": {"type": "string", "maxLength": 4},
            "b": {"type": "integer", "minimum": 0, "maximum": 9},
            "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
        "required": ["a"],
    },
]
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe so", 'say "hi"']


def _make(tiny_llama_dir, speculative_config):
    return LLM(
        model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, speculative_config=speculative_config
    )


@pytest.fixture(scope="module")
def llms(tiny_llama_dir):
    return {"plain": _make(tiny_llama_dir, None), "ngram": _make(tiny_llama_dir, NGRAM)}


def _json_params(schema, temperature, seed, any_whitespace=False, max_tokens=300, **kw):
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs={"json": schema, "disable_any_whitespace": not any_whitespace},
        **kw,
    )


def _check_json(outs, params):
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), p.structured_outputs["json"])


@pytest.mark.parametrize("mode", ["plain", "ngram"])
def test_json_schemas_with_sampling(llms, mode):
    llm = llms[mode]
    params = [_json_params(s, t, seed) for s in SCHEMAS for t, seed in ((0.7, 1), (1.0, 2))]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    _check_json(outs, params)
    # Every mask was filled ahead of its logits, off the critical path.
    assert llm.engine.structured.num_sync_fills == 0
    assert llm.engine.structured.num_requests == 0  # released at finish


@pytest.mark.parametrize("mode", ["plain", "ngram"])
def test_json_schema_with_any_whitespace(llms, mode):
    params = [_json_params(s, 1.0, 7, any_whitespace=True, max_tokens=480) for s in SCHEMAS[1:4]]
    _check_json(llms[mode].generate(PROMPTS[: len(params)], params), params)


def test_greedy_structured_output_is_identical_with_and_without_speculation(llms):
    params = [_json_params(s, 0.0, None) for s in SCHEMAS]
    params += [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"regex": REGEX}),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"choice": CHOICES}),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    plain, spec = (llms[m].generate(prompts, params) for m in ("plain", "ngram"))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in spec]
    _check_json(plain[: len(SCHEMAS)], params)
    metrics = {m.name: m.value for m in llms["ngram"].get_metrics()}
    assert metrics["specserve:spec_decode_num_accepted_tokens_total"] > 0
    assert llms["ngram"].engine.structured.num_drafts_cut > 0  # n-gram drafts that broke the grammar


@pytest.mark.parametrize("mode", ["plain", "ngram"])
def test_regex_choice_grammar_and_json_object(llms, mode):
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=60, structured_outputs={"regex": REGEX})
        for t, s in ((0.0, None), (0.8, 3), (1.0, 4))
    ]
    params += [
        SamplingParams(temperature=t, seed=s, max_tokens=20, structured_outputs={"choice": CHOICES})
        for t, s in ((0.0, None), (1.0, 5), (1.0, 6))
    ]
    params.append(
        SamplingParams(
            temperature=1.0,
            seed=8,
            max_tokens=40,
            structured_outputs={"grammar": 'root ::= "(" [0-9] [0-9]? ")" | "none"'},
        )
    )
    params.append(
        SamplingParams(
            temperature=0.0, max_tokens=200, structured_outputs={"json_object": True, "disable_any_whitespace": True}
        )
    )
    outs = llms[mode].generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:-1]), texts
    assert all(re.fullmatch(REGEX, t) for t in texts[:3]), texts
    assert all(t in CHOICES for t in texts[3:6]), texts
    assert re.fullmatch(r"\([0-9]{1,2}\)|none", texts[6]), texts
    if outs[-1].outputs[0].finish_reason == "stop":  # an open object may outrun max_tokens
        assert isinstance(json.loads(texts[-1]), dict)
    else:
        assert texts[-1].startswith("{")


def test_unstructured_requests_in_a_mixed_batch_are_untouched(llms):
    llm = llms["plain"]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    structured = [_json_params(SCHEMAS[0], 0.8, 11), _json_params(SCHEMAS[2], 0.0, None)]
    alone = llm.generate(PROMPTS[:2], free)
    mixed = llm.generate(PROMPTS[:4], [free, free] + structured)
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed[:2]]
    _check_json(mixed[2:], structured)


def test_grammar_end_ends_the_request_even_with_ignore_eos(llms):
    params = [
        SamplingParams(
            temperature=1.0, seed=9, n=2, max_tokens=100, ignore_eos=True, structured_outputs={"choice": ["yes", "no"]}
        ),
        _json_params(SCHEMAS[3], 0.0, None, ignore_eos=True),
    ]
    outs = llms["ngram"].generate(PROMPTS[:2], params)
    assert [c.text in ("yes", "no") for c in outs[0].outputs] == [True, True]
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    jsonschema.validate(json.loads(outs[1].outputs[0].text), SCHEMAS[3])


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"json": {"type": "foo"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "(abc"}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"json": SCHEMAS[0], "regex": "a"}, "structured_outputs"),
    ],
)
def test_invalid_specs_raise_before_any_work(llms, spec, field):
    llm = llms["plain"]
    good = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(PROMPTS[:2], [good, SamplingParams(max_tokens=4, structured_outputs=spec)])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.structured.num_requests == 0


def test_draft_model_speculation_keeps_sampled_drafts_exact(llms, tiny_llama_dir, tmp_path):
    """A draft model samples its drafts from draft_probs: an invalid one is kept (and always
    rejected) rather than dropped, and the outputs still follow the grammar; greedy stays exact."""
    draft = make_tiny_model_dir(tmp_path / "draft", arch="llama", seed=11, num_layers=1)  # same tokenizer
    llm = _make(
        tiny_llama_dir, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    )
    params = [_json_params(SCHEMAS[i], 1.0, 20 + i) for i in (0, 2, 4)]
    params += [_json_params(SCHEMAS[i], 0.0, None) for i in (1, 3)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params)
    _check_json(outs, params)
    greedy = llms["plain"].generate(prompts[3:], params[3:])
    assert [o.outputs[0].token_ids for o in outs[3:]] == [o.outputs[0].token_ids for o in greedy]
    assert llm.engine.stats.get("spec_decode_num_draft_tokens_total") > 0
