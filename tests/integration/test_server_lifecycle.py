"""Server lifecycle: SIGTERM with requests in flight (a real `specserve serve` process) and the
engine loop dying under a live stream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestSpec
from specserve.sampling_params import SamplingParams
from specserve.server.api import BackgroundServer
from specserve.server.cli_args import ServerConfig
from tests.helpers.server_proc import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_with_requests_in_flight_exits_cleanly(tiny_llama_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stderr_path = tmp_path / "stderr.txt"
    cmd = [
        sys.executable,
        "-m",
        "specserve.server.cli",
        "serve",
        str(tiny_llama_dir),
        "--port",
        str(port),
        "--kv-cache-memory-bytes",
        "4M",
        "--graceful-shutdown-timeout",
        "2",
        "--log-interval",
        "1",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_healthy(url, proc)
        started = threading.Barrier(5, timeout=60)
        outcomes: list[str] = []

        def stream(i: int) -> None:
            body = {"prompt": f"story {i}", "max_tokens": 400, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                    lines = resp.iter_lines()
                    next(line for line in lines if line.startswith("data: "))
                    started.wait()
                    last = [line for line in lines if line][-1:] or [""]
                    outcomes.append("done" if last[0] == "data: [DONE]" else "cut")
            except httpx.HTTPError:
                outcomes.append("cut")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait()  # every request is generating
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr_text = stderr_path.read_text()
    assert rc == 0, stderr_text[-3000:]
    assert "Traceback" not in stderr_text, stderr_text[-3000:]
    assert len(outcomes) == 4


@pytest.fixture
def doomed_server(tiny_llama_dir):
    config = EngineConfig.from_kwargs(model=str(tiny_llama_dir), kv_cache_memory_bytes=4 << 20)
    engine = AsyncEngine.from_config(config, progress=False)
    settings = ServerConfig(port=0, log_interval=0, uvicorn_log_level="critical")
    srv = BackgroundServer(engine, settings).start()
    yield srv, engine
    srv.stop()


def test_engine_death_fails_streams_and_health(doomed_server):
    srv, engine = doomed_server
    body = {"prompt": "doomed", "max_tokens": 300, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))

        def boom() -> list:
            raise RuntimeError("simulated device failure")

        engine._engine.step = boom  # the engine thread calls it on its next step
        rest = [line for line in lines if line.startswith("data: ")]
    errors = [json.loads(line[6:]) for line in rest if line.startswith('data: {"error"')]
    assert errors and errors[0]["error"]["code"] == "engine_unavailable"
    assert rest[-1] == "data: [DONE]"
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and "simulated device failure" in health.json()["error"]["message"]
    again = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert again.status_code == 503 and again.json()["error"]["type"] == "service_unavailable_error"


def test_async_engine_admits_all_or_none_and_streams(tiny_llama_dir):
    engine = AsyncEngine.from_config(
        EngineConfig.from_kwargs(model=str(tiny_llama_dir), kv_cache_memory_bytes=4 << 20), progress=False
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=3)

    async def scenario() -> None:
        batch = [RequestSpec("ok", "hello", greedy), RequestSpec("bad", {"prompt_token_ids": [10**9]}, greedy)]
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await engine.add_requests(batch)
        outputs = [out async for out in engine.generate("hello", greedy, "single")]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
        assert all(not o.finished for o in outputs[:-1])
        await engine.shutdown(timeout=2.0)
        with pytest.raises(EngineDeadError):
            await engine.add_requests([RequestSpec("late", "hello", greedy)])

    asyncio.run(scenario())
    assert not engine.is_running
    assert not engine._engine.has_unfinished_requests()  # "ok" was rolled back, never ran
