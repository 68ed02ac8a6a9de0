"""vLLM's `continue_final_message` on /v1/chat/completions: the last assistant message stays open and
the model continues it (the same greedy tokens as a completion of that rendered prompt); it needs
add_generation_prompt false and a final assistant message, else 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.server.api import BackgroundServer
from specserve.server.cli_args import ServerConfig

MESSAGES = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "numbers 0 1"}]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    engine = AsyncEngine.from_config(
        EngineConfig.from_kwargs(model=str(tiny_llama_dir), kv_cache_memory_bytes=4 << 20, max_model_len=256),
        progress=False,
    )
    srv = BackgroundServer(engine, ServerConfig(port=0, log_interval=0, uvicorn_log_level="warning")).start()
    yield srv.url, engine
    srv.stop()


def test_continue_final_message(served) -> None:
    url, engine = served
    greedy = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False, **greedy},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    text = engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.rstrip().endswith("numbers 0 1")  # the assistant turn is left open
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    want = httpx.post(url + "/v1/completions", json={"prompt": ids, **greedy}, timeout=60).json()
    assert r.json()["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    closed = httpx.post(
        url + "/v1/chat/completions", json={"messages": MESSAGES, "add_generation_prompt": False, **greedy}, timeout=60
    ).json()
    assert r.json()["usage"]["prompt_tokens"] < closed["usage"]["prompt_tokens"]  # no end-of-turn tokens


@pytest.mark.parametrize(
    "body",
    [
        {"continue_final_message": True},  # add_generation_prompt defaults to true
        {"continue_final_message": True, "add_generation_prompt": False, "messages": MESSAGES[:1]},
    ],
)
def test_continue_final_message_misuse(served, body) -> None:
    url, _ = served
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
