"""Speculative decoding behind the OpenAI server: real uvicorn on loopback, the official `openai`
client, stream=True. Greedy streams (text, token ids, finish reason, usage) of an n-gram server
and of a draft-model server equal a server without speculation, stop strings that fall inside
accepted drafts end the stream where the plain server ends it, and /metrics shows the drafts
(vLLM's four spec_decode families, consistent with each other under both name prefixes).

The draft-model server drafts with the target's own weights, so every draft is accepted and a
step appends k + 1 tokens: multi-token deltas and stops inside a step are certain, not luck."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.metrics.prometheus import PrometheusMetrics
from specserve.server.api import BackgroundServer
from specserve.server.cli_args import ServerConfig

K = 4
MAX_TOKENS = 24
# Repetitive prompts: the n-gram proposer finds their tail earlier in the context, so it drafts
# from the first decode step on (a prompt without repeats would leave the ngram server idle).
PROMPTS = [
    "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta",
    "0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
]
CHAT = [{"role": "user", "content": "Paris is the capital of France. Paris is the capital of France. Paris"}]
SPEC_FAMILIES = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos_total",
)


def _spec(method: str, model: str) -> dict[str, Any] | None:
    # adaptive off: on the CPU the controller may price drafting out and choose k = 0, which
    # would make these servers plain ones and the test vacuous.
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "adaptive": False,
        }
    if method == "draft_model":
        return {"method": "draft_model", "model": model, "num_speculative_tokens": K, "adaptive": False}
    return None


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path) -> Iterator[dict[str, BackgroundServer]]:
    """plain, ngram (`specserve:` metrics) and draft_model (`vllm:` metrics) servers, same weights."""
    started: dict[str, BackgroundServer] = {}
    prefixes = {"plain": "specserve", "ngram": "specserve", "draft_model": "vllm"}
    try:
        for name, prefix in prefixes.items():
            config = EngineConfig.from_kwargs(
                model=str(tiny_llama_dir),
                kv_cache_memory_bytes=4 << 20,
                max_model_len=256,
                speculative_config=_spec(name, str(tiny_llama_dir)),
            )
            engine = AsyncEngine.from_config(config, progress=False)
            settings = ServerConfig(port=0, log_interval=0, uvicorn_log_level="warning", metrics_prefix=prefix)
            started[name] = BackgroundServer(engine, settings).start()
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def _client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _stream_completion(srv: BackgroundServer, prompt: str, **extra: Any) -> dict[str, Any]:
    """One streamed greedy completion: text, token ids (logprobs as "token_id:N"), per-chunk
    token counts, finish and stop reason, usage."""
    client = _client(srv)
    chunks = list(
        client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, **extra.pop("extra_body", {})},
            **extra,
        )
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    tokens = [[int(t.removeprefix("token_id:")) for t in ch.logprobs.tokens] if ch.logprobs else [] for ch in choices]
    finished = [ch for ch in choices if ch.finish_reason is not None]
    assert len(finished) == 1 and finished[0] is choices[-1], "exactly one finish, on the last choice chunk"
    return {
        "text": "".join(ch.text for ch in choices),
        "token_ids": [t for ts in tokens for t in ts],
        "chunk_sizes": [len(ts) for ts in tokens],
        "finish": finished[0].finish_reason,
        "stop_reason": getattr(finished[0], "stop_reason", None),
        "completion_tokens": chunks[-1].usage.completion_tokens,
    }


def _stream_chat(srv: BackgroundServer) -> dict[str, Any]:
    client = _client(srv)
    chunks = list(
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=CHAT,
            max_completion_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": True},
        )
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    tokens = [
        int(t.token.removeprefix("token_id:"))
        for ch in choices
        if ch.logprobs and ch.logprobs.content
        for t in ch.logprobs.content
    ]
    return {
        "text": "".join(ch.delta.content or "" for ch in choices),
        "token_ids": tokens,
        "finish": [ch.finish_reason for ch in choices if ch.finish_reason][-1],
        "completion_tokens": chunks[-1].usage.completion_tokens,
    }


def _samples(text: str, prefix: str) -> dict[str, dict[str, float]]:
    """spec_decode_* samples (without the prefix) -> {position label or "": value}."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removeprefix(prefix + ":")
            # prometheus_client names the counter family without _total; the sample keeps it
            if name != s.name and name.startswith("spec_decode_") and name.endswith("_total"):
                out[name][s.labels.get("position", "")] = s.value
    return dict(out)


def _check_spec_metrics(spec: dict[str, dict[str, float]]) -> tuple[float, float, float]:
    """The four families are exported and consistent; returns (drafts, draft tokens, accepted)."""
    assert set(SPEC_FAMILIES) <= set(spec), sorted(spec)
    drafts = spec["spec_decode_num_drafts_total"][""]
    draft_tokens = spec["spec_decode_num_draft_tokens_total"][""]
    accepted = spec["spec_decode_num_accepted_tokens_total"][""]
    per_pos = spec["spec_decode_num_accepted_tokens_per_pos_total"]
    assert sorted(per_pos) == [str(p) for p in range(K)], per_pos  # every position, labeled
    assert drafts > 0 and 0 <= accepted <= draft_tokens <= K * drafts
    # a draft accepted up to position p counts once at each of 0..p: the positions add up
    assert sum(per_pos.values()) == accepted
    assert all(per_pos[str(p)] >= per_pos[str(p + 1)] for p in range(K - 1))
    return drafts, draft_tokens, accepted


def _accepted(srv: BackgroundServer) -> tuple[float, float]:
    """(draft tokens, accepted tokens) so far, read in-process: a request's share is a difference."""
    stats = srv.engine.stats
    return (stats.get("spec_decode_num_draft_tokens_total"), stats.get("spec_decode_num_accepted_tokens_total"))


def _check_drafted(srv: BackgroundServer, before: tuple[float, float], method: str) -> None:
    """The request really went through verified drafts (else the comparison proves nothing)."""
    drafted, accepted = (b - a for a, b in zip(before, _accepted(srv)))
    assert accepted > 0 and accepted <= drafted
    if method == "draft_model":  # the target drafting for itself: every draft token accepted
        assert accepted == drafted


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_streamed_completions_equal_plain(servers, method) -> None:
    for i, prompt in enumerate(PROMPTS):
        # one prompt may end at EOS like an ordinary request; the others run the full length
        extra = {"ignore_eos": i != 0}
        want = _stream_completion(servers["plain"], prompt, extra_body=extra)
        before = _accepted(servers[method])
        got = _stream_completion(servers[method], prompt, extra_body=extra)
        _check_drafted(servers[method], before, method)
        assert want["completion_tokens"] == len(want["token_ids"]) > 0
        for key in ("text", "token_ids", "finish", "completion_tokens"):
            assert got[key] == want[key], (method, prompt, key)
        # Chunk sizes are not compared: the stream may coalesce outputs of steps it was slow to
        # send, plain or not. Accepted drafts do arrive as several tokens in one chunk:
        assert max(got["chunk_sizes"]) > 1, got["chunk_sizes"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_streamed_chat_equals_plain(servers, method) -> None:
    want = _stream_chat(servers["plain"])
    before = _accepted(servers[method])
    got = _stream_chat(servers[method])
    _check_drafted(servers[method], before, method)
    assert want["completion_tokens"] == len(want["token_ids"]) > 0
    assert got == want


def _stop_strings(text: str) -> list[str]:
    """Short printable pieces of `text` from along its length (random weights emit control
    characters and broken UTF-8; a stop string made of those tests the detokenizer instead)."""
    out: list[str] = []
    for a in range(0, len(text) - 4, 3):
        piece = text[a : a + 2 + a % 3]
        if piece.strip() and piece.isprintable() and "\ufffd" not in piece and piece not in out:
            out.append(piece)
    return out[:6]


def test_stream_stop_string_inside_accepted_drafts(servers) -> None:
    plain, spec = servers["plain"], servers["draft_model"]
    prompt = PROMPTS[0]
    text = _stream_completion(plain, prompt, extra_body={"ignore_eos": True})["text"]
    stops = _stop_strings(text)
    assert len(stops) >= 3, text
    # Self-drafting: prefill emits 1 token, then each step k + 1 = 5, so step boundaries are at
    # lengths 1, 6, 11, ...; a stop completed anywhere else is trimmed inside accepted drafts.
    inside = 0
    for stop in stops:
        for include in (False, True):
            extra = {"ignore_eos": True, "include_stop_str_in_output": include}
            want = _stream_completion(plain, prompt, stop=[stop], extra_body=extra)
            got = _stream_completion(spec, prompt, stop=[stop], extra_body=extra)
            assert (want["finish"], want["stop_reason"]) == ("stop", stop)
            for key in ("text", "token_ids", "finish", "stop_reason", "completion_tokens"):
                assert got[key] == want[key], (stop, include, key)
            assert got["text"].endswith(stop) if include else stop not in got["text"]
            inside += len(got["token_ids"]) % (K + 1) != 1
    assert inside > 0


def test_metrics_show_the_drafts(servers) -> None:
    # Drive both servers (the test may run alone) so the counters are nonzero.
    for method in ("ngram", "draft_model"):
        _stream_completion(servers[method], PROMPTS[0], extra_body={"ignore_eos": True})
    ngram_text = httpx.get(servers["ngram"].url + "/metrics", timeout=30).text
    _check_spec_metrics(_samples(ngram_text, "specserve"))
    assert "vllm:" not in ngram_text  # one prefix per server, the configured one
    # The other prefix renders the same numbers for the same engine (dashboards built for vLLM).
    ngram_stats = servers["ngram"].engine.stats
    for prefix in ("specserve", "vllm"):
        rendered = _samples(PrometheusMetrics(ngram_stats, prefix).render().decode(), prefix)
        assert rendered == _samples(ngram_text, "specserve")

    draft_text = httpx.get(servers["draft_model"].url + "/metrics", timeout=30).text
    assert "specserve:" not in draft_text
    _, draft_tokens, accepted = _check_spec_metrics(_samples(draft_text, "vllm"))
    assert accepted == draft_tokens  # the target drafting for itself: every draft token accepted
    # the plain server exports the families at zero (no per-position series without positions)
    plain = _samples(httpx.get(servers["plain"].url + "/metrics", timeout=30).text, "specserve")
    assert plain["spec_decode_num_drafts_total"] == {"": 0.0}
    assert "spec_decode_num_accepted_tokens_per_pos_total" not in plain
