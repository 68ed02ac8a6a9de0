"""`specserve serve --data-parallel-size 2 --data-parallel-backend ray`: a real process that starts
its own Ray, serves through the front door, and leaves no Ray process behind after SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs the specserve[ray] extra")

from specserve.bench.metrics_parse import parse_metrics
from tests.helpers.ray_procs import ray_processes
from tests.helpers.server_proc import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_serve_with_two_ray_replicas_then_sigterm(tiny_llama_dir, tmp_path):
    port, ray_tmp = free_port(), tempfile.mkdtemp(prefix="rt", dir="/tmp")
    url = f"http://127.0.0.1:{port}"
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
        "--data-parallel-size",
        "2",
        "--data-parallel-backend",
        "ray",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp}
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, timeout=240)
        bodies = [{"prompt": f"the quick brown fox {i}", "max_tokens": 4, "temperature": 0.0} for i in range(8)]
        replies = [httpx.post(url + "/v1/completions", json=b, timeout=60) for b in bodies]
        assert [r.status_code for r in replies] == [200] * 8
        chat = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
        )
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
        bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the replica's own check
        snap = parse_metrics(httpx.get(url + "/metrics", timeout=30).text, time.time())
        assert set(snap.by_label("num_requests_running", "replica")) == {"0", "1"}
        assert snap.value("request_success_total") == 9
        assert ray_processes(ray_tmp)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30
    while ray_processes(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_processes(ray_tmp) == [], (tmp_path / "out.txt").read_text()[-3000:]
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-parallel-size", "2"], "--data-parallel-backend ray"),
        (["--ray-address", "auto"], "--data-parallel-backend ray"),
        (["--data-parallel-size", "0"], "data_parallel_size must be >= 1"),
    ],
)
def test_data_parallel_flags_without_a_backend_are_refused(flags, message, capsys):
    from specserve.server.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err
