"""Server throughput and latency at fixed client concurrency (default 1, 8, 32).

Closed loop: C clients each send streaming completions back to back (fixed prompt and output
lengths, ignore_eos so every request makes the same work) until each level has sent --requests.
Reports output tokens/s, requests/s, p50/p99 TTFT and p50/p99 inter-token latency per level.

    python bench/server_load.py --model /path/to/model-dir          # starts its own server
    python bench/server_load.py --base-url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import Result, percentile, random_prompt, start_server, stream_completion


async def run_level(base_url: str, model: str, concurrency: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [random_prompt(rng, args.prompt_words) for _ in range(args.requests)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits,
                                 headers=headers) as client:
        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                body = {"model": model, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0.0,
                        "ignore_eos": True, "stream_options": {"include_usage": True}}
                try:
                    results.append(await stream_completion(client, body))
                except httpx.HTTPError as e:
                    results.append(Result("good", False, f"{type(e).__name__}: {e}"))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    ms = lambda v: None if v is None else round(v * 1000, 1)
    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
            "seconds": round(elapsed, 2), "output_tokens_per_s": round(sum(r.tokens for r in ok) / elapsed, 1),
            "requests_per_s": round(len(ok) / elapsed, 2),
            "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
            "itl_p50_ms": ms(percentile(itls, 50)), "itl_p99_ms": ms(percentile(itls, 99))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="start own server with this model (catalog name or dir)")
    p.add_argument("--base-url", help="use a running server instead")
    p.add_argument("--server-arg", action="append", default=[], help="extra `serve` flag (repeatable)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=64, help="requests per level")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if bool(args.model) == bool(args.base_url):
        p.error("give exactly one of --model or --base-url")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc, base_url = start_server(args) if args.model else (None, args.base_url.rstrip("/"))
    rows = []
    try:
        model = httpx.get(base_url + "/v1/models", timeout=10,
                          headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
                          ).json()["data"][0]["id"]
        asyncio.run(run_level(base_url, model, 1, argparse.Namespace(**{**vars(args), "requests": 2})))  # warm-up
        for level in (int(c) for c in args.concurrency.split(",")):
            rows.append(asyncio.run(run_level(base_url, model, level, args)))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    header = f"{'conc':>5} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'err':>4}"
    print(header)
    for r in rows:
        print(f"{r['concurrency']:>5} {r['output_tokens_per_s']:>9} {r['requests_per_s']:>7} {r['ttft_p50_ms']!s:>9} "
              f"{r['ttft_p99_ms']!s:>8} {r['itl_p50_ms']!s:>8} {r['itl_p99_ms']!s:>8} {r['errors']:>4}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
