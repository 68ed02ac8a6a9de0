"""OpenAI API over a real uvicorn server (loopback, free port) with the official `openai` client.

One server for the module: a tiny random Llama, an API key, a small body limit.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.server.api import BackgroundServer
from specserve.server.cli_args import ServerConfig

API_KEY = "sk-test"
MAX_MODEL_LEN = 128
BODY_LIMIT = 32 * 1024
GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}  # random weights: fixed lengths make usage checks exact


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = EngineConfig.from_kwargs(
        model=str(tiny_llama_dir), kv_cache_memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN
    )
    engine = AsyncEngine.from_config(config, progress=False)
    settings = ServerConfig(
        port=0, api_key=API_KEY, log_interval=0, max_request_body_bytes=BODY_LIMIT, uvicorn_log_level="warning"
    )
    srv = BackgroundServer(engine, settings).start()
    yield srv
    srv.stop()
    assert not engine.is_running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_completion_stream_equals_non_stream(client, http, model):
    kw = dict(model=model, prompt="The quick brown fox", max_tokens=12, extra_body=NO_EOS, **GREEDY)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    num_prompt = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["count"]
    assert full.usage.prompt_tokens == num_prompt and full.usage.completion_tokens == 12
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == num_prompt
    assert chunks[-1].choices == []


def test_chat_stream_equals_non_stream(client, model):
    kw = dict(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}],
        max_completion_tokens=10,
        extra_body=NO_EOS,
        **GREEDY,
    )
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert full.usage.completion_tokens == 10 == chunks[-1].usage.completion_tokens
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0
    assert full.choices[0].finish_reason == "length"


def test_n_and_batch_prompts(client, model):
    out = client.completions.create(
        model=model, prompt=["alpha beta", "gamma delta"], n=2, max_tokens=4, seed=7, temperature=1.0, extra_body=NO_EOS
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=5, stream=True, extra_body=NO_EOS
        )
    )
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length"}


def test_token_prompt_equals_text_prompt(client, http, model):
    ids = http.post("/tokenize", json={"prompt": "def add(a, b):"}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "def add(a, b):"


def test_stop_string_and_echo(client, model):
    base = (
        client.completions.create(model=model, prompt="numbers 0 1 2", max_tokens=16, extra_body=NO_EOS, **GREEDY)
        .choices[0]
        .text
    )
    stop = base[4:7]
    assert stop
    cut = client.completions.create(
        model=model, prompt="numbers 0 1 2", max_tokens=16, stop=[stop], extra_body=NO_EOS, **GREEDY
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.index(stop)]
    echoed = client.completions.create(model=model, prompt="numbers 0 1 2", max_tokens=3, echo=True, **GREEDY)
    assert echoed.choices[0].text.startswith("numbers 0 1 2")


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt="alpha", max_tokens=3, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(len(t) >= 2 for t in lp.top_logprobs)
    assert len(lp.text_offset) == 3 and lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.logprob >= t.top_logprobs[1].logprob for t in content)


def test_models_health_version_metrics(server, http, model):
    assert httpx.get(server.url + "/health").status_code == 200  # open without the key
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert http.get("/version").json()["version"]
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN


def _long_prompt(n_words: int) -> str:
    return " ".join(["alpha beta gamma"] * n_words)


BAD_REQUESTS = [
    # (name, path, body or raw bytes, status, param)
    ("malformed json", "/v1/completions", b"{not json", 400, None),
    ("body not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("zero max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("top_p over 1", "/v1/completions", {"prompt": "a", "top_p": 2}, 400, "top_p"),
    ("n zero", "/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("user without content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("prompt over context", "/v1/completions", {"prompt": _long_prompt(200), "max_tokens": 1}, 400, "prompt"),
    (
        "prompt + max_tokens over context",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
    ),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "a", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("too many logprobs", "/v1/completions", {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("body over the limit", "/v1/completions", {"prompt": "x" * (BODY_LIMIT + 10)}, 413, None),
    ("unknown route", "/v1/nothing", {"prompt": "a"}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(http, model, name, path, body, status, param):
    good = {"model": model, "prompt": "Paris is", "max_tokens": 5, **GREEDY}
    before = http.post("/v1/completions", json=good).json()["choices"][0]["text"]
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in resp.text
    if param is not None:
        assert error["param"] == param, error
    after = http.post("/v1/completions", json=good)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before


def test_api_key_required(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=client.models.list().data[0].id, prompt="a", temperature=-3)
