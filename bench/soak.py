"""Soak test of a specserve server: mixed traffic, then check that nothing leaked.

N requests at concurrency C with random prompt and output lengths; a fraction of the clients
disconnect mid-stream, a fraction send bad requests. At the end it records errors on good
requests, KV blocks still held once the server is idle (from /metrics), the server's RSS at start
and end, and p50/p99 latency. Loopback only, bounded by --deadline.

    python bench/soak.py --model /path/to/model-dir --requests 300 --concurrency 24   # own server
    python bench/soak.py --base-url http://127.0.0.1:8000 --server-pid 1234          # running one

Exit status 0 when every good request succeeded, every bad one got its 4xx with the OpenAI
error body, no KV block is held at the end and the server stayed healthy; 1 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
WORDS = ["alpha", "beta", "gamma", "delta", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Paris", "capital", "France", "speculative", "decoding", "drafts", "tokens", "target", "verifies", "numbers", "one", "two", "three"]


@dataclass
class Result:
    kind: str  # good | disconnect | bad
    ok: bool
    error: str | None = None
    latency: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    tokens: int = 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def random_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def stream_completion(client: httpx.AsyncClient, body: dict, leave_after: int | None = None) -> Result:
    """One streaming completion with timings; `leave_after` chunks -> disconnect (ok if it got them)."""
    kind = "good" if leave_after is None else "disconnect"
    start = time.perf_counter()
    last, ttft, itls, tokens, chunks = start, None, [], 0, 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            return Result(kind, False, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Result(kind, False, f"stream error: {chunk['error'].get('message')}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    itls.append(now - last)
                last = now
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return Result(kind, True, latency=time.perf_counter() - start, ttft=ttft)
        else:
            return Result(kind, False, "stream ended without [DONE]")
    latency = time.perf_counter() - start
    if leave_after is None and tokens != body["max_tokens"]:
        return Result(kind, False, f"got {tokens} tokens, wanted {body['max_tokens']}", latency)
    return Result(kind, True, None, latency, ttft, itls, tokens)


def bad_requests(model: str) -> list[tuple[dict | bytes, int]]:
    """(body, expected status) pairs the server must refuse without harm."""
    return [(b"{broken", 400), ({"model": model, "prompt": "x", "temperature": -1}, 400),
            ({"model": "no-such-model", "prompt": "x"}, 404), ({"model": model, "prompt": ""}, 400),
            ({"model": model, "prompt": "x", "max_tokens": 10 ** 7}, 400),
            ({"model": model, "prompt": [10 ** 9]}, 400), ({"model": model, "prompt": "x", "n": 0}, 400)]


async def send_bad(client: httpx.AsyncClient, body: dict | bytes, status: int) -> Result:
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    resp = await client.post("/v1/completions", **kw)
    try:
        error = resp.json()["error"]
        shaped = {"message", "type", "param", "code"} <= set(error)
    except (ValueError, KeyError, TypeError):
        shaped = False
    if resp.status_code != status or not shaped:
        return Result("bad", False, f"bad request answered {resp.status_code} (wanted {status}): {resp.text[:200]}")
    return Result("bad", True)


async def run_traffic(args: argparse.Namespace, base_url: str, model: str) -> list[Result]:
    rng = random.Random(args.seed)
    bad = bad_requests(model)
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)

    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits,
                                 headers=_auth(args)) as client:
        async def one(i: int) -> Result:
            roll = rng.random()
            body = {"model": model, "prompt": random_prompt(rng, rng.randint(1, args.max_prompt_words)),
                    "max_tokens": rng.randint(1, args.max_output_tokens), "temperature": rng.choice([0.0, 0.8]),
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            async with sem:
                try:
                    if roll < args.bad_frac:
                        return await send_bad(client, *bad[i % len(bad)])
                    if roll < args.bad_frac + args.disconnect_frac:
                        return await stream_completion(client, {**body, "max_tokens": args.max_output_tokens},
                                                       leave_after=rng.randint(1, 4))
                    return await stream_completion(client, body)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                    return Result("good", False, f"{type(e).__name__}: {e}")

        return await asyncio.gather(*(one(i) for i in range(args.requests)))


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def read_metrics(base_url: str) -> dict[str, float | dict]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float | dict] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.split(":", 1)[-1]
            if name == "cache_config_info":
                out[name] = dict(s.labels)
            elif not s.labels:
                out[name] = s.value
    return out


def wait_idle(base_url: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(base_url)
        if (m.get("num_requests_running", 0) == 0 and m.get("num_requests_waiting", 0) == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specserve.server.cli", "serve", args.model, "--port", str(port),
           "--log-interval", "0", "--uvicorn-log-level", "warning", *args.server_arg]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"server did not start: {' '.join(cmd)}")


def summarize(results: list[Result], start: dict, end: dict, rss: tuple, elapsed: float, healthy: bool) -> dict:
    good = [r for r in results if r.kind == "good"]
    info = end.get("cache_config_info") or {}
    num_blocks = int(info.get("num_gpu_blocks", 0) or 0)
    blocks_held = round(float(end.get("kv_cache_usage_perc", 0.0)) * num_blocks)
    latencies = [r.latency for r in good if r.ok]
    ttfts = [r.ttft for r in good if r.ok and r.ttft is not None]
    errors = [r.error for r in results if not r.ok]
    return {
        "requests": len(results), "seconds": round(elapsed, 2),
        "good": len(good), "good_errors": sum(not r.ok for r in good),
        "disconnects": sum(r.kind == "disconnect" for r in results),
        "bad": sum(r.kind == "bad" for r in results), "bad_misanswered": sum(r.kind == "bad" and not r.ok for r in results),
        "generated_tokens": sum(r.tokens for r in good),
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "ttft_p99_s": percentile(ttfts, 99),
        "running_at_end": end.get("num_requests_running"), "waiting_at_end": end.get("num_requests_waiting"),
        "kv_usage_at_end": end.get("kv_cache_usage_perc"), "kv_blocks_held_at_end": blocks_held,
        "kv_blocks_total": num_blocks, "rss_start_mb": _mb(rss[0]), "rss_end_mb": _mb(rss[1]),
        "healthy_at_end": healthy, "first_errors": errors[:5],
    }


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2 ** 20, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="start own server with this model (catalog name or dir)")
    p.add_argument("--base-url", help="use a running server instead")
    p.add_argument("--server-pid", type=int, default=None, help="running server's pid, for RSS")
    p.add_argument("--server-arg", action="append", default=[], help="extra `serve` flag (repeatable)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--max-prompt-words", type=int, default=60)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--disconnect-frac", type=float, default=0.15)
    p.add_argument("--bad-frac", type=float, default=0.1)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--deadline", type=float, default=1800.0, help="give up on the traffic after this many s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    if bool(args.model) == bool(args.base_url):
        p.error("give exactly one of --model or --base-url")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc, base_url = start_server(args) if args.model else (None, args.base_url.rstrip("/"))
    pid = proc.pid if proc else args.server_pid
    try:
        model = httpx.get(base_url + "/v1/models", headers=_auth(args), timeout=10).json()["data"][0]["id"]
        rss_start, metrics_start = rss_bytes(pid), read_metrics(base_url)
        t0 = time.perf_counter()
        results = asyncio.run(asyncio.wait_for(run_traffic(args, base_url, model), args.deadline))
        elapsed = time.perf_counter() - t0
        metrics_end = wait_idle(base_url, timeout=30)
        healthy = httpx.get(base_url + "/health", timeout=10).status_code == 200
        summary = summarize(results, metrics_start, metrics_end, (rss_start, rss_bytes(pid)), elapsed, healthy)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if proc is not None:
        summary["server_exit_code"] = proc.returncode
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    ok = (summary["good_errors"] == 0 and summary["bad_misanswered"] == 0 and summary["kv_blocks_held_at_end"] == 0
          and summary["healthy_at_end"] and summary.get("server_exit_code", 0) == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
