"""Structured output through the official `openai` client on a live server (loopback)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytest.importorskip("xgrammar", reason="xgrammar is a declared dependency; CI installs it")

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.async_engine import AsyncEngine  # noqa: E402
from specserve.server.api import BackgroundServer  # noqa: E402
from specserve.server.cli_args import ServerConfig  # noqa: E402

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    cfg = EngineConfig.from_kwargs(
        model=str(tiny_llama_dir),
        kv_cache_memory_bytes=4 << 20,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "adaptive": False,
        },
    )
    engine = AsyncEngine.from_config(cfg, progress=False)
    srv = BackgroundServer(engine, ServerConfig(port=0, log_interval=0)).start()
    yield srv
    srv.stop()
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("seed", [1, 2])
def test_chat_json_schema_validates(client, schema, seed):
    model = client.models.list().data[0].id
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me JSON."}],
        response_format=rf,
        temperature=0.8,
        seed=seed,
        max_tokens=120,
    )
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_completion_regex_and_choice(client):
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model,
        prompt="Date:",
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}},
    )
    assert __import__("re").fullmatch(r"20[0-9]{2}-[01][0-9]", out.choices[0].text)
    out = client.completions.create(
        model=model,
        prompt="Pick:",
        max_tokens=10,
        temperature=1.0,
        seed=4,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    assert out.choices[0].text in ("yes", "no", "maybe")


def test_invalid_schema_is_400_and_server_keeps_working(client):
    model = client.models.list().data[0].id
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], response_format=bad, max_tokens=5
        )
    assert "response_format" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    ok = client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
