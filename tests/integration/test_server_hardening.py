"""Inputs that must not stall or crash the server, and how it takes its API key, over a real server on
loopback (a tiny random Llama) with the official `openai` client where it fits.

The server's key comes from SPECSERVE_API_KEY, read by `serve`'s own flag handling.
"""

from __future__ import annotations

import argparse
import itertools
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.server import cli_args
from specserve.server.api import BackgroundServer
from tests.helpers.server_proc import free_port

ENV_KEY = "sk-from-env"
MAX_MODEL_LEN = 512
HUGE_PROMPT = "x " * 1_000_000  # 2 MB: seconds of tokenization, far more than 512 tokens can spell


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_args.add_server_args(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_API_KEY", ENV_KEY)
        settings = cli_args.server_config(
            _serve_args(["--port", "0", "--log-interval", "0", "--uvicorn-log-level", "warning"])
        )
    config = EngineConfig.from_kwargs(
        model=str(tiny_llama_dir), kv_cache_memory_bytes=8 << 20, max_model_len=MAX_MODEL_LEN
    )
    srv = BackgroundServer(AsyncEngine.from_config(config, progress=False), settings).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ENV_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=ENV_KEY, max_retries=0, timeout=60)


def test_api_key_from_env_and_file(server, client, tmp_path, monkeypatch):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert client.models.list().data[0].id
    monkeypatch.setenv("SPECSERVE_API_KEY", ENV_KEY)
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    assert cli_args.server_config(_serve_args(["--api-key-file", str(key_file)])).api_key == "sk-from-file"
    assert cli_args.server_config(_serve_args(["--api-key", "sk-flag"])).api_key == "sk-flag"
    assert "sk-from-env" not in repr(cli_args.server_config(_serve_args([])))
    monkeypatch.delenv("SPECSERVE_API_KEY")
    assert cli_args.server_config(_serve_args([])).api_key is None


def test_post_needs_json_content_type(http):
    body = b'{"prompt": "a", "max_tokens": 1}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": ctype} if ctype else {}  # raw content: httpx adds no content-type
        resp = http.post("/v1/completions", content=body, headers=headers)
        assert resp.status_code == 415, (ctype, resp.text)
        assert resp.json()["error"]["code"] == "unsupported_media_type"
    ok = http.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}'),
        ("/tokenize", b'{"prompt": "a\\ud800b"}'),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
        ("/v1/completions", b'{"prompt": "a", "response_format": ' + b'{"a": ' * 200 + b"1" + b"}" * 201),
    ],
)
def test_bad_unicode_and_deep_json_are_400(http, path, body):
    resp = http.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def _timed_get(http: httpx.Client, path: str) -> float:
    start = time.perf_counter()
    assert http.get(path).status_code == 200
    return time.perf_counter() - start


def test_huge_prompt_is_rejected_without_stalling(http):
    """/health latency while huge prompts are rejected vs idle, and the ITL of a running stream."""
    idle = statistics.median(_timed_get(http, "/health") for _ in range(10))
    arrivals: list[float] = []
    done: list[bool] = []

    def stream() -> None:
        body = {"prompt": "alpha beta", "max_tokens": 480, "ignore_eos": True, "temperature": 0.0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    arrivals.append(time.perf_counter())
                    done.extend([True] if line == "data: [DONE]" else [])

    streamer = threading.Thread(target=stream)
    streamer.start()
    while len(arrivals) < 20:
        time.sleep(0.005)
    statuses: list[int] = []
    window: list[float] = []

    def huge() -> None:
        window.append(time.perf_counter())
        for _ in range(3):
            statuses.append(http.post("/v1/completions", json={"prompt": HUGE_PROMPT, "max_tokens": 1}).status_code)
        window.append(time.perf_counter())

    sender = threading.Thread(target=huge)
    sender.start()
    during = []
    while sender.is_alive():
        during.append(_timed_get(http, "/health"))
    sender.join()
    streamer.join()
    assert statuses == [400, 400, 400]
    assert len(arrivals) > 20 and done == [True]  # chunks may carry several tokens when the client lags
    worst = max(during)  # before tokenizing moved off the loop: seconds per huge request
    assert worst < max(50 * idle, 1.0), (worst, idle)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    in_window = [b - a for a, b in itertools.pairwise(arrivals) if window[0] <= b and a <= window[1]]
    assert max(in_window, default=0.0) < max(20 * statistics.median(gaps), 1.0), (in_window, gaps)


def test_model_by_id(client, server):
    model = client.models.list().data[0].id
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_logprob_bytes_of_partial_characters(client):
    """Tokens that hold part of a UTF-8 character (most of the tiny byte-level vocabulary) give their bytes."""
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "é😀"}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=20,
    )
    replacement = list("\ufffd".encode())
    partial = [t for c in out.choices[0].logprobs.content for t in [c, *c.top_logprobs] if "\ufffd" in t.token]
    assert partial, "expected some tokens that decode to U+FFFD"
    for t in partial:
        assert t.bytes != replacement and len(t.bytes) >= 1, t
        assert max(t.bytes) >= 0x80  # a lead or continuation byte, not text


def test_port_in_use_is_reported_before_the_model_loads(tmp_path):
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "specserve.server.cli", "serve", str(tmp_path / "no-model"), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert proc.returncode == 2, proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr and "no-model" not in proc.stderr, proc.stderr
    assert time.monotonic() - start < 60
