"""`specserve bench` and `specserve advise` against a live OpenAI-compatible server on loopback.

Most tests use a small FastAPI stub that streams `max_tokens` tokens (two per chunk every third
chunk, as speculative decoding would) with a small delay, so their numbers are exact. The last
test runs both tools against a real specserve server (tiny random Llama, n-gram speculation).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specserve.bench import add_advise_args, add_bench_args, advise_main, bench_main
from specserve.bench.advise import window_stats
from specserve.bench.datasets import random_requests
from specserve.bench.metrics_parse import parse_metrics
from specserve.bench.report import sweep_series
from tests.helpers.server_proc import free_port

MODEL = "stub-model"
DELAY_S = 0.002
STATE: dict[str, Any] = {"requests": 0, "tokens": 0, "prompts": []}


def chunk_sizes(n: int) -> list[int]:
    """Tokens per streamed chunk: every third chunk carries two."""
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(min(2 if len(sizes) % 3 == 2 else 1, n - sum(sizes)))
    return sizes


def make_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    @app.post("/tokenize")
    async def tokenize(req: Request) -> dict[str, Any]:
        words = (await req.json())["prompt"].split()
        return {"count": len(words), "tokens": list(range(len(words))), "max_model_len": 8192}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            "# TYPE specserve:num_requests_running gauge\nspecserve:num_requests_running 1\n"
            "# TYPE specserve:num_requests_waiting gauge\nspecserve:num_requests_waiting 0\n"
            f"# TYPE specserve:generation_tokens_total counter\nspecserve:generation_tokens_total {STATE['tokens']}\n"
            f"# TYPE specserve:request_success_total counter\nspecserve:request_success_total {STATE['requests']}\n"
        )

    async def stream(body: dict[str, Any], chat: bool) -> Any:
        if body.get("model") != MODEL:
            return JSONResponse(
                {
                    "error": {
                        "message": f"model {body.get('model')} not found",
                        "type": "NotFound",
                        "param": "model",
                        "code": 404,
                    }
                },
                status_code=404,
            )
        n = int(body["max_tokens"])
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        STATE["prompts"].append(prompt)
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": len(prompt.split()) + n}

        def event(choice: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> str:
            obj = {
                "id": "x",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "model": MODEL,
                "choices": [choice] if choice else [],
                **(extra or {}),
            }
            return f"data: {json.dumps(obj)}\n\n"

        async def gen() -> Any:
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})
            for size in chunk_sizes(n):
                await asyncio.sleep(DELAY_S)
                text = " tok" * size
                yield event({"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text})
            yield event(
                {"index": 0, "delta": {}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": "", "finish_reason": "length"}
            )
            if body.get("stream_options", {}).get("include_usage"):
                yield event(None, {"usage": usage})
            STATE["requests"] += 1
            STATE["tokens"] += n
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request) -> Any:
        return await stream(await req.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request) -> Any:
        return await stream(await req.json(), chat=True)

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    config = uvicorn.Config(make_app(), host="127.0.0.1", port=free_port(), log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{config.port}"
    srv.should_exit = True
    thread.join(timeout=10)


def bench_args(base_url: str, out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(["--base-url", base_url, "--result-dir", str(out), "--disable-tqdm", *extra])


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def assert_aggregates_match_records(run: dict[str, Any]) -> None:
    """Aggregates equal numpy statistics of the raw per-request records stored beside them."""
    ok = [r for r in run["requests"] if r["success"]]
    agg = run["aggregates"]
    samples = {
        "ttft": [r["ttft_s"] * 1e3 for r in ok],
        "e2el": [r["e2el_s"] * 1e3 for r in ok],
        "tpot": [r["tpot_s"] * 1e3 for r in ok if r["tpot_s"] is not None],
        "itl": [x * 1e3 for r in ok for x in r["itl_s"]],
    }
    for key, values in samples.items():
        assert values, key
        assert agg[f"mean_{key}_ms"] == pytest.approx(np.mean(values))
        for stat, pct in (("median", 50), ("p90", 90), ("p99", 99)):
            assert agg[f"{stat}_{key}_ms"] == pytest.approx(np.percentile(values, pct)), (stat, key)
    assert agg["total_output_tokens"] == sum(r["output_tokens"] for r in ok)
    assert agg["output_throughput"] == pytest.approx(agg["total_output_tokens"] / agg["duration"])
    assert agg["request_throughput"] == pytest.approx(len(ok) / agg["duration"])


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_random_completions(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_args(
        server,
        tmp_path,
        "--num-prompts",
        "12",
        "--random-input-len",
        "40",
        "--random-output-len",
        "16",
        "--max-concurrency",
        "4",
        "--result-filename",
        "run.json",
        "--goodput",
        "ttft:60000",
    )
    assert bench_main(args) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Median TTFT (ms):" in printed and "P99 ITL (ms):" in printed
    result = load(tmp_path / "run.json")
    assert result["config"]["model"] == MODEL and result["config"]["ignore_eos"] is True
    assert result["config"]["prompt_token_count"] == "server /tokenize"
    (run,) = result["runs"]
    assert run["max_concurrency"] == 4 and len(run["requests"]) == 12
    assert run["aggregates"]["completed"] == 12 and run["aggregates"]["failed"] == 0
    assert 1 <= run["aggregates"]["max_concurrent_requests"] <= 4
    for rec in run["requests"]:
        assert rec["success"] and rec["output_tokens"] == 16 and rec["output_tokens_from_usage"]
        assert rec["prompt_len"] == 40 and rec["prompt_tokens"] == 40
        assert len(rec["itl_s"]) == len(chunk_sizes(16)) - 1  # ITL is per chunk, not per token
        assert rec["tpot_s"] == pytest.approx((rec["e2el_s"] - rec["ttft_s"]) / 15)
    assert run["aggregates"]["request_goodput"] == pytest.approx(run["aggregates"]["request_throughput"])
    assert_aggregates_match_records(run)
    assert is_png(tmp_path / "run.png")


def test_bench_chat_sweep(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_args(
        server,
        tmp_path,
        "--endpoint",
        "/v1/chat/completions",
        "--num-prompts",
        "8",
        "--random-input-len",
        "20",
        "--random-output-len",
        "8",
        "--request-rate",
        "500",
        "--max-concurrency",
        "1,4",
        "--result-filename",
        "sweep.json",
        "--goodput",
        "e2el:0.001",
    )
    assert bench_main(args) == 0
    assert "Concurrency sweep" in capsys.readouterr().out
    result = load(tmp_path / "sweep.json")
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 4]
    for run in result["runs"]:
        assert run["aggregates"]["completed"] == 8 and run["aggregates"]["total_output_tokens"] == 64
        assert run["aggregates"]["request_goodput"] == 0.0  # nobody meets a 1 us E2EL SLO
        assert_aggregates_match_records(run)
    assert result["runs"][0]["aggregates"]["max_concurrent_requests"] == 1
    series = sweep_series(result["runs"])
    assert series["max_concurrency"] == [1.0, 4.0] and len(series["p99_ttft_ms"]) == 2
    assert is_png(tmp_path / "sweep.png")
    assert not (tmp_path / "sweep_1.png").exists()  # one plot for the whole sweep


def test_bench_humaneval_and_jsonl(server: str, tmp_path: Path) -> None:
    args = bench_args(
        server,
        tmp_path,
        "--dataset-name",
        "humaneval",
        "--num-prompts",
        "5",
        "--output-len",
        "6",
        "--result-filename",
        "he.json",
    )
    assert bench_main(args) == 0
    (run,) = load(tmp_path / "he.json")["runs"]
    assert load(tmp_path / "he.json")["config"]["ignore_eos"] is False
    assert all(r["success"] and r["output_tokens"] == 6 for r in run["requests"])
    assert all(r["prompt_tokens"] == r["prompt_len"] > 5 for r in run["requests"])
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "one two three", "output_len": 3}\n\n{"text": "four five"}\n')
    args = bench_args(
        server,
        tmp_path,
        "--dataset-name",
        "jsonl",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "4",
        "--output-len",
        "5",
        "--result-filename",
        "jl.json",
    )
    assert bench_main(args) == 0
    (run,) = load(tmp_path / "jl.json")["runs"]
    assert sorted(r["output_tokens"] for r in run["requests"]) == [3, 3, 5, 5]


def test_bench_setup_errors(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(bench_args(server, tmp_path, "--model", "nope", "--num-prompts", "2")) == 1
    assert "initial test request failed: HTTP 404" in capsys.readouterr().out
    assert bench_main(bench_args(server, tmp_path, "--goodput", "latency:5", "--num-prompts", "2")) == 1
    assert bench_main(bench_args(server, tmp_path, "--max-concurrency", "0", "--num-prompts", "2")) == 1
    assert bench_main(bench_args(f"http://127.0.0.1:{free_port()}", tmp_path, "--num-prompts", "2")) == 1
    assert not list(tmp_path.glob("*.json"))


def test_bench_max_duration_bounds_the_run(server: str, tmp_path: Path) -> None:
    # ~3 s of Poisson arrivals cut at 1 s: the first requests complete (a 4-token answer takes well
    # under a second even on a loaded 2-core machine; 0.2 s did not always), the rest are never sent.
    args = bench_args(
        server,
        tmp_path,
        "--num-prompts",
        "30",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--request-rate",
        "10",
        "--max-duration",
        "1.0",
        "--result-filename",
        "short.json",
    )
    assert bench_main(args) == 1  # some requests were never sent
    (run,) = load(tmp_path / "short.json")["runs"]
    assert run["aggregates"]["completed"] >= 1 and run["aggregates"]["failed"] >= 1
    assert run["aggregates"]["duration"] < 3.0
    assert all(r["error"].startswith(("not sent", "timed out")) for r in run["requests"] if not r["success"])


def test_random_prompt_lengths_calibrate_to_a_tokenizer() -> None:
    def chars(text: str) -> int:  # a tokenizer unlike one token per word
        return len(text) // 3

    reqs = random_requests(20, 64, 8, 0.25, seed=3, counter=chars)
    assert all(abs(r.prompt_len - chars(r.prompt)) == 0 for r in reqs)
    assert all(48 - 2 <= r.prompt_len <= 80 + 2 for r in reqs) and len({r.prompt_len for r in reqs}) > 3
    assert all(6 <= r.expected_output_len <= 10 for r in reqs)
    rough = random_requests(5, 30, 8, 0.0, seed=3)
    assert [r.prompt_len for r in rough] == [30] * 5 and rough[0].prompt != rough[1].prompt


def test_advise_live_json(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_advise_args(parser)
    capsys.readouterr()
    assert advise_main(parser.parse_args(["--base-url", server, "--window", "0.3", "--interval", "0.1", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["regime"] == "low" and out["samples"] >= 3 and out["window_s"] >= 0.3
    assert any("speculation" in a["title"] for a in out["advice"])
    assert advise_main(parser.parse_args(["--base-url", server, "--window", "0"])) == 0
    assert "low concurrency" in capsys.readouterr().out


# -- against a real specserve server --------------------------------------------------------------
@pytest.fixture(scope="module")
def specserve_server(tiny_llama_dir: Path) -> Iterator[str]:
    from specserve.config import EngineConfig
    from specserve.engine.async_engine import AsyncEngine
    from specserve.server.api import BackgroundServer
    from specserve.server.cli_args import ServerConfig

    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "adaptive": False,
    }
    config = EngineConfig.from_kwargs(
        model=str(tiny_llama_dir), kv_cache_memory_bytes=4 << 20, max_model_len=256, speculative_config=spec
    )
    engine = AsyncEngine.from_config(config, progress=False)
    srv = BackgroundServer(engine, ServerConfig(port=0, log_interval=0, uvicorn_log_level="warning")).start()
    yield srv.url
    srv.stop()


def test_bench_and_advise_against_a_real_specserve_server(
    specserve_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = bench_args(
        specserve_server,
        tmp_path,
        "--num-prompts",
        "8",
        "--random-input-len",
        "24",
        "--random-output-len",
        "12",
        "--max-concurrency",
        "1,4",
        "--result-filename",
        "real.json",
    )
    assert bench_main(args) == 0
    result = load(tmp_path / "real.json")
    assert result["config"]["prompt_token_count"] == "server /tokenize" and result["config"]["ignore_eos"] is True
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 4]
    for run in result["runs"]:
        agg = run["aggregates"]
        assert agg["completed"] == 8 and agg["failed"] == 0 and agg["total_output_tokens"] == 8 * 12
        for rec in run["requests"]:
            assert rec["success"] and rec["output_tokens_from_usage"] and rec["output_tokens"] == 12
            assert rec["prompt_tokens"] == rec["prompt_len"]  # the dataset counted with the server's tokenizer
            assert rec["ttft_s"] <= rec["e2el_s"] and all(x >= 0 for x in rec["itl_s"])
        assert_aggregates_match_records(run)
    assert result["runs"][0]["aggregates"]["max_concurrent_requests"] == 1
    assert is_png(tmp_path / "real.png")

    metrics_page = parse_metrics(httpx.get(specserve_server + "/metrics").text, 0.0)
    stats = window_stats([metrics_page])
    assert stats.counters["requests"] >= 17  # 2 runs of 8 and the probe request
    parser = argparse.ArgumentParser()
    add_advise_args(parser)
    capsys.readouterr()
    assert advise_main(parser.parse_args(["--base-url", specserve_server, "--window", "0", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["regime"] == "low" and out["samples"] == 1 and out["window_s"] is None
    spec_advice = [a for a in out["advice"] if "drafts" in a["evidence"]]
    assert spec_advice and spec_advice[0]["evidence"]["drafts"] == int(stats.counters["drafts"]) > 0
    assert spec_advice[0]["evidence"]["num_speculative_tokens"] == 3  # the configured k, from spec_decode_config_info
