"""Helpers for tests that run a real server on loopback: a free port, and waiting for /health."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    """Until GET url/health answers 200; fails at once if the server process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited during startup"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")
