"""Nullable request fields, validation-error bodies and overload replies, over a real uvicorn server.

OpenAI and vLLM declare optional request fields nullable: `"n": null` means the same as leaving
`n` out. Errors name the offending field in `param` and always carry a code; an overload 503
tells the client when to retry.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from fastapi.exceptions import RequestValidationError

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.server.api import BackgroundServer
from specserve.server.cli_args import ServerConfig

MAX_QUEUED = 4
MAX_SEQS = 2  # a burst fills the running batch first; past it, requests wait
USER = [{"role": "user", "content": "Where is Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = EngineConfig.from_kwargs(
        model=str(tiny_llama_dir),
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        max_num_seqs=MAX_SEQS,
        max_num_queued_requests=MAX_QUEUED,
    )
    engine = AsyncEngine.from_config(config, progress=False)
    srv = BackgroundServer(engine, ServerConfig(port=0, log_interval=0, uvicorn_log_level="warning")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def _texts(resp: httpx.Response) -> list:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/json")  # "stream": null is not a stream
    body = resp.json()
    texts = [c.get("text", c.get("message")) for c in body["choices"]]
    return [texts, [c["finish_reason"] for c in body["choices"]], body["usage"]["completion_tokens"]]


COMPLETION_NULLS = [
    "presence_penalty",
    "frequency_penalty",
    "n",
    "stream",
    "echo",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logprobs",
    "best_of",
    "stream_options",
]
CHAT_NULLS = [
    "presence_penalty",
    "frequency_penalty",
    "n",
    "stream",
    "logprobs",
    "top_logprobs",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "add_generation_prompt",
    "max_completion_tokens",
]


@pytest.mark.parametrize("field", COMPLETION_NULLS)
def test_completion_null_field_means_default(http, model, field):
    base = {"model": model, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0.0}
    omitted = http.post("/v1/completions", json=base)
    nulled = http.post("/v1/completions", json={**base, field: None})
    assert _texts(nulled) == _texts(omitted)


@pytest.mark.parametrize("field", CHAT_NULLS)
def test_chat_null_field_means_default(http, model, field):
    base = {"model": model, "messages": USER, "max_tokens": 6, "temperature": 0.0}
    omitted = http.post("/v1/chat/completions", json=base)
    nulled = http.post("/v1/chat/completions", json={**base, field: None})
    assert _texts(nulled) == _texts(omitted)
    assert nulled.json()["choices"][0]["logprobs"] is None


def test_all_nulls_at_once_and_nested(http, model):
    base = {"model": model, "messages": USER, "max_tokens": 5, "temperature": 0.0}
    nulls = dict.fromkeys(
        CHAT_NULLS
        + [
            "seed",
            "stop",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "stop_token_ids",
            "user",
            "logit_bias",
            "response_format",
            "tools",
            "tool_choice",
            "chat_template_kwargs",
        ]
    )
    assert _texts(http.post("/v1/chat/completions", json={**base, **nulls})) == _texts(
        http.post("/v1/chat/completions", json=base)
    )
    stream = http.post("/v1/chat/completions", json={**base, "stream": True, "stream_options": {"include_usage": None}})
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    assert '"usage":{' not in stream.text  # include_usage null -> its default (false)
    tok = http.post("/tokenize", json={"prompt": "hello", "add_special_tokens": None, "return_token_strs": None})
    plain = http.post("/tokenize", json={"prompt": "hello"})
    assert tok.status_code == 200 and tok.json()["tokens"] == plain.json()["tokens"]


def test_openai_client_sends_nulls(server, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model=model, prompt="alpha beta", max_tokens=4, temperature=0.0)
    plain = client.completions.create(**kw)
    nulled = client.completions.create(
        **kw,
        presence_penalty=None,
        frequency_penalty=None,
        n=None,
        echo=None,
        extra_body={"min_tokens": None, "ignore_eos": None},
    )
    assert nulled.choices[0].text == plain.choices[0].text


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": None}),
        ("/v1/chat/completions", {"messages": None}),
        ("/v1/chat/completions", {"messages": [{"role": None, "content": "x"}]}),
    ],
)
def test_required_fields_stay_required(http, path, body):
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == next(iter(body)) and error["code"] == "invalid_value"


@pytest.mark.parametrize(
    "path,base", [("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": USER})]
)
@pytest.mark.parametrize("value", ["maybe", 5, [True]])
def test_bad_type_names_the_field(http, path, base, value):
    resp = http.post(path, json={**base, "stream": value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "stream" and error["code"] == "invalid_value"
    assert error["message"].startswith("stream: "), error


def test_nested_bad_type_names_the_top_level_field(http):
    resp = http.post("/v1/completions", json={"prompt": "a", "stream": True, "stream_options": {"include_usage": "x"}})
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "stream_options"
    assert error["message"].startswith("stream_options.include_usage: "), error


@pytest.mark.parametrize("top", [100, -1])
def test_top_logprobs_out_of_range_names_top_logprobs(http, top):
    resp = http.post("/v1/chat/completions", json={"messages": USER, "logprobs": True, "top_logprobs": top})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "top_logprobs" and error["code"] == "invalid_value"
    assert error["message"].startswith("top_logprobs "), error


@pytest.mark.parametrize(
    "path,body,param,code",
    [
        ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ("/v1/completions", {"prompt": "a", "n": 1, "best_of": 3}, "best_of", "unsupported"),
        (
            "/v1/completions",
            {"prompt": "a", "stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_value",
        ),
        ("/v1/completions", {"prompt": ["a"] * 65, "n": 2}, "n", "invalid_value"),
        ("/tokenize", {}, "prompt", "invalid_value"),
    ],
)
def test_every_400_has_a_code(http, path, body, param, code):
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_overload_503_has_retry_after(http, model):
    burst = MAX_SEQS + MAX_QUEUED
    fits = http.post("/v1/completions", json={"model": model, "prompt": ["p"] * burst, "max_tokens": 2})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == burst  # 2 run, 4 wait
    resp = http.post("/v1/completions", json={"model": model, "prompt": ["p"] * (burst + 1), "max_tokens": 2})
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    assert error["code"] == "overloaded" and error["type"] == "service_unavailable_error"
    assert "request(s)" in error["message"] and f"{MAX_QUEUED} requests" not in error["message"]
    ok = http.post("/v1/completions", json={"model": model, "prompt": "p", "max_tokens": 2})
    assert ok.status_code == 200 and "retry-after" not in ok.headers


def test_fastapi_validation_errors_use_the_same_body(server):
    """Routes validate bodies themselves, but FastAPI's own 422 path must give the same 400 body."""
    handler = server.server.config.app.exception_handlers[RequestValidationError]
    exc = RequestValidationError(
        [
            {
                "type": "bool_parsing",
                "loc": ("body", "stream"),
                "msg": "Input should be a valid boolean",
                "input": "maybe",
            }
        ]
    )
    resp = asyncio.run(handler(None, exc))
    error = json.loads(resp.body)["error"]
    assert resp.status_code == 400 and error["param"] == "stream" and error["code"] == "invalid_value"
    assert error["message"] == "stream: Input should be a valid boolean"
