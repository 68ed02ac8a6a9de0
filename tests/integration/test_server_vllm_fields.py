"""vLLM request fields the server honours instead of accepting and ignoring: truncate_prompt_tokens,
a per-request chat_template, return_tokens_as_token_ids, add_special_tokens, chat echo; and the ones
it refuses with a 400 naming them (tool_calls in messages, non-text content parts, malformed batch
prompts). Served on loopback from a tiny model whose tokenizer adds a BOS token, as Llama's does."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.server.api import BackgroundServer
from specserve.server.cli_args import ServerConfig

MAX_MODEL_LEN = 128
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 4}
CHAT = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "numbers 0 1"}]
TOKEN_ID = re.compile(r"^token_id:(\d+)$")


@pytest.fixture(scope="module")
def bos_model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model, its tokenizer adding BOS (<|endoftext|>) to text like Llama's does."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-llama-bos") / "model"
    shutil.copytree(tiny_llama_dir, path)
    tok = AutoTokenizer.from_pretrained(path)
    bos = tok.bos_token
    tok._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.bos_token_id)]
    )
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(bos_model_dir):
    engine = AsyncEngine.from_config(
        EngineConfig.from_kwargs(model=str(bos_model_dir), kv_cache_memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN),
        progress=False,
    )
    srv = BackgroundServer(
        engine, ServerConfig(port=0, log_interval=0, uvicorn_log_level="warning", trust_request_chat_template=True)
    ).start()
    yield srv.url, engine.tokenizer
    srv.stop()


def _post(url: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    return [json.loads(ln) for ln in lines]


def _tokenize(url: str, **body) -> list[int]:
    return _post(url, "/tokenize", body)["tokens"]


def test_tokenizer_adds_bos(served) -> None:
    url, tok = served
    with_bos, without = _tokenize(url, prompt=TEXT), _tokenize(url, prompt=TEXT, add_special_tokens=False)
    assert with_bos == [tok.bos_token_id] + without


# -------------------------------------------------------------------- truncate_prompt_tokens
@pytest.mark.parametrize("as_ids", [False, True])
def test_truncate_prompt_tokens_completion(served, as_ids) -> None:
    url, _ = served
    ids = _tokenize(url, prompt=TEXT)
    prompt = ids if as_ids else TEXT
    got = _post(url, "/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": 5, **GREEDY})
    want = _post(url, "/v1/completions", {"prompt": ids[-5:], **GREEDY})
    full = _post(url, "/v1/completions", {"prompt": prompt, **GREEDY})
    assert got["usage"]["prompt_tokens"] == 5 and full["usage"]["prompt_tokens"] == len(ids) > 5
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    # echo shows the kept tokens, as the model saw them
    echoed = _post(url, "/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": 5, "echo": True, **GREEDY})
    assert echoed["choices"][0]["text"] == served[1].decode(ids[-5:]) + want["choices"][0]["text"]


def test_truncate_prompt_tokens_batch_and_minus_one(served) -> None:
    url, _ = served
    ids = _tokenize(url, prompt=TEXT)
    got = _post(url, "/v1/completions", {"prompt": [TEXT, "Paris"], "truncate_prompt_tokens": 3, **GREEDY})
    assert got["usage"]["prompt_tokens"] == 3 + min(3, len(_tokenize(url, prompt="Paris")))
    # -1: the model's max length, i.e. no truncation of a prompt that fits
    got = _post(url, "/v1/completions", {"prompt": TEXT, "truncate_prompt_tokens": -1, **GREEDY})
    assert got["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("k", [0, -2, MAX_MODEL_LEN + 1])
def test_truncate_prompt_tokens_out_of_range(served, k) -> None:
    url, _ = served
    for path, body in (("/v1/completions", {"prompt": TEXT}), ("/v1/chat/completions", {"messages": CHAT[:1]})):
        err = _post(url, path, {**body, "truncate_prompt_tokens": k, **GREEDY}, status=400)["error"]
        assert err["param"] == "truncate_prompt_tokens", err


def test_truncate_prompt_tokens_chat(served) -> None:
    url, _ = served
    rendered = _tokenize(url, messages=CHAT[:1])
    assert len(rendered) > 4
    got = _post(url, "/v1/chat/completions", {"messages": CHAT[:1], "truncate_prompt_tokens": 4, **GREEDY})
    want = _post(url, "/v1/completions", {"prompt": rendered[-4:], **GREEDY})
    assert got["usage"]["prompt_tokens"] == 4
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    chunks = _stream(
        url,
        "/v1/chat/completions",
        {"messages": CHAT[:1], "truncate_prompt_tokens": 4, "stream_options": {"include_usage": True}, **GREEDY},
    )
    assert chunks[-1]["usage"]["prompt_tokens"] == 4


# -------------------------------------------------------------------- chat_template
def test_request_chat_template(served) -> None:
    url, _ = served
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    got = _post(
        url,
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template": template, "add_generation_prompt": False, **GREEDY},
    )
    default = _post(url, "/v1/chat/completions", {"messages": CHAT, "add_generation_prompt": False, **GREEDY})
    plain = _tokenize(url, prompt="count\nnumbers 0 1\n", add_special_tokens=False)
    assert got["usage"]["prompt_tokens"] == len(plain) != default["usage"]["prompt_tokens"]
    want = _post(url, "/v1/completions", {"prompt": plain, **GREEDY})
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["text"]


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m['content'] }", "{{ raise_exception('no') }}"])
def test_bad_chat_template(served, template) -> None:
    url, _ = served
    err = _post(url, "/v1/chat/completions", {"messages": CHAT, "chat_template": template, **GREEDY}, status=400)[
        "error"
    ]
    assert err["param"] == "chat_template" and "chat_template" in err["message"], err


# -------------------------------------------------------------------- return_tokens_as_token_ids
def _ids(tokens: list[str]) -> list[int]:
    matches = [TOKEN_ID.match(t) for t in tokens]
    assert all(matches), tokens
    return [int(m.group(1)) for m in matches]


def test_return_tokens_as_token_ids_completion(served) -> None:
    url, tok = served
    ids = _tokenize(url, prompt=TEXT)
    body = {"prompt": ids, "logprobs": 2, "echo": True, **GREEDY}
    choice = _post(url, "/v1/completions", {**body, "return_tokens_as_token_ids": True})["choices"][0]
    lp = choice["logprobs"]
    got_ids = _ids(lp["tokens"])
    assert got_ids[: len(ids)] == ids
    assert tok.decode(got_ids) == choice["text"]
    assert all(_ids(list(top)) for top in lp["top_logprobs"] if top)
    plain = _post(url, "/v1/completions", body)["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == plain["token_logprobs"]
    assert lp["text_offset"] == plain["text_offset"]  # offsets still index the text
    chunks = _stream(url, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    streamed = [
        t
        for ch in chunks
        if ch["choices"] and ch["choices"][0]["logprobs"]
        for t in ch["choices"][0]["logprobs"]["tokens"]
    ]
    assert _ids(streamed) == got_ids


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_chat(served, stream) -> None:
    url, tok = served
    body = {"messages": CHAT[:1], "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True, **GREEDY}
    if stream:
        chunks = _stream(url, "/v1/chat/completions", body)
        content = [e for ch in chunks for c in ch["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
        text = "".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"])
    else:
        choice = _post(url, "/v1/chat/completions", body)["choices"][0]
        content, text = choice["logprobs"]["content"], choice["message"]["content"]
    assert len(content) == GREEDY["max_tokens"]
    assert tok.decode(_ids([e["token"] for e in content])) == text
    assert all(len(e["top_logprobs"]) == 2 and _ids([t["token"] for t in e["top_logprobs"]]) for e in content)
    if not stream:  # bytes and logprobs are still those of the token's text
        body.pop("return_tokens_as_token_ids")
        plain = _post(url, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
        assert [(e["bytes"], e["logprob"]) for e in content] == [(e["bytes"], e["logprob"]) for e in plain]
        assert [[t["bytes"] for t in e["top_logprobs"]] for e in content] == [
            [t["bytes"] for t in e["top_logprobs"]] for e in plain
        ]


# -------------------------------------------------------------------- add_special_tokens
def test_add_special_tokens_completion(served) -> None:
    url, tok = served
    without = _tokenize(url, prompt=TEXT, add_special_tokens=False)
    plain = _post(url, "/v1/completions", {"prompt": TEXT, "add_special_tokens": False, **GREEDY})
    default = _post(url, "/v1/completions", {"prompt": TEXT, **GREEDY})
    assert plain["usage"]["prompt_tokens"] == len(without)
    assert default["usage"]["prompt_tokens"] == len(without) + 1  # BOS
    want = _post(url, "/v1/completions", {"prompt": without, **GREEDY})
    assert plain["choices"][0]["text"] == want["choices"][0]["text"]
    echoed = _post(url, "/v1/completions", {"prompt": TEXT, "add_special_tokens": False, "echo": True, **GREEDY})
    assert echoed["choices"][0]["text"] == TEXT + want["choices"][0]["text"]


def test_add_special_tokens_chat(served) -> None:
    url, _ = served
    default = _post(url, "/v1/chat/completions", {"messages": CHAT[:1], **GREEDY})  # vLLM: false for chat
    added = _post(url, "/v1/chat/completions", {"messages": CHAT[:1], "add_special_tokens": True, **GREEDY})
    assert default["usage"]["prompt_tokens"] == len(_tokenize(url, messages=CHAT[:1]))
    assert added["usage"]["prompt_tokens"] == default["usage"]["prompt_tokens"] + 1


# -------------------------------------------------------------------- chat echo
def test_chat_echo(served) -> None:
    url, _ = served
    body = {"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True, **GREEDY}
    plain = _post(url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = _post(url, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "numbers 0 1" + plain
    chunks = _stream(url, "/v1/chat/completions", {**body, "echo": True})
    deltas = [c["delta"] for ch in chunks for c in ch["choices"]]
    assert deltas[0] == {"role": "assistant", "content": "numbers 0 1"}
    assert "".join(d.get("content") or "" for d in deltas) == echoed
    # the last message is the user's: nothing to echo
    last_user = _post(url, "/v1/chat/completions", {"messages": CHAT[:1], "echo": True, **GREEDY})
    assert (
        last_user["choices"][0]["message"]["content"]
        == _post(url, "/v1/chat/completions", {"messages": CHAT[:1], **GREEDY})["choices"][0]["message"]["content"]
    )


# -------------------------------------------------------------------- refused with a clear 400
def test_tool_calls_in_messages_refused(served) -> None:
    url, _ = served
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    for path in ("/v1/chat/completions", "/tokenize"):
        err = _post(url, path, {"messages": messages, "max_tokens": 2}, status=400)["error"]
        assert err["param"] == "messages" and err["code"] == "unsupported" and "tool_calls" in err["message"], err
    legacy = [messages[0], {"role": "assistant", "content": None, "function_call": call["function"]}, CHAT[0]]
    err = _post(url, "/v1/chat/completions", {"messages": legacy, "max_tokens": 2}, status=400)["error"]
    assert err["code"] == "unsupported" and "function_call" in err["message"], err
    # an empty tool_calls list is no call
    messages[1] = {"role": "assistant", "content": "ok", "tool_calls": []}
    _post(url, "/v1/chat/completions", {"messages": messages[:2] + [CHAT[0]], "max_tokens": 2})


def test_non_text_content_part_refused(served) -> None:
    url, _ = served
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    err = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}, status=400)["error"]
    assert err["message"] == "messages.0.content: only text content parts are supported", err
    assert err["code"] == "unsupported" and err["param"] == "messages"
    ok = _post(
        url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": messages[0]["content"][:1]}], "max_tokens": 2},
    )
    assert ok["choices"][0]["message"]["content"] is not None


def test_mixed_batch_prompt_message(served) -> None:
    url, _ = served
    err = _post(url, "/v1/completions", {"prompt": ["hello", [1, 2, 3]], "max_tokens": 2}, status=400)["error"]
    assert err["param"] == "prompt"
    assert err["message"] == (
        "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists"
    ), err


def test_request_chat_template_needs_the_trust_flag(tiny_llama_dir) -> None:
    """vLLM's --trust-request-chat-template: without it a request's template is refused, not run."""
    engine = AsyncEngine.from_config(
        EngineConfig.from_kwargs(model=str(tiny_llama_dir), kv_cache_memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN),
        progress=False,
    )
    srv = BackgroundServer(engine, ServerConfig(port=0, log_interval=0, uvicorn_log_level="warning")).start()
    try:
        err = _post(
            srv.url,
            "/v1/chat/completions",
            {"messages": CHAT, "chat_template": "{{ messages[0].content }}", **GREEDY},
            status=400,
        )["error"]
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
        _post(srv.url, "/v1/chat/completions", {"messages": CHAT, **GREEDY})  # the model's own template still runs
    finally:
        srv.stop()
