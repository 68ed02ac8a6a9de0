"""`specserve bench`: a serving benchmark against any OpenAI-compatible server (`vllm bench serve`).

Per streamed request: TTFT to the first text chunk; ITL between text chunks (per chunk, as vLLM);
E2EL to the stream's end; TPOT = (E2EL - TTFT) / (output_tokens - 1). Token counts from usage."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx
from tqdm.asyncio import tqdm

from specserve import envs
from specserve.bench import datasets, report

add_bench_args = report.add_bench_args
__all__ = ["RequestRecord", "RunConfig", "add_bench_args", "bench_main", "run_benchmark"]


@dataclass
class RequestRecord:
    """Raw measurements of one request; times in seconds, `start_s` from the run's start."""

    index: int
    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    prompt_tokens: int | None = None  # usage.prompt_tokens, when the server sends usage
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    start_s: float = 0.0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len


@dataclass(frozen=True)
class RunConfig:
    """What one benchmark run sends: where, which model, how fast, and with what sampling."""

    endpoint: str
    model: str
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    request_timeout_s: float = 600.0
    max_duration_s: float | None = None
    seed: int = 0
    disable_tqdm: bool = False


def build_payload(cfg: RunConfig, req: datasets.SampleRequest) -> dict[str, Any]:
    chat = {"messages": [{"role": "user", "content": req.prompt}]}
    body: dict[str, Any] = chat if cfg.endpoint.rstrip("/").endswith("chat/completions") else {"prompt": req.prompt}
    body |= {"model": cfg.model, "max_tokens": req.expected_output_len, "temperature": cfg.temperature}
    extra = {"ignore_eos": True} if cfg.ignore_eos else {}  # a vLLM extension: only sent when asked for
    return {**body, "stream": True, "stream_options": {"include_usage": True}, **extra}


async def _stream(client: httpx.AsyncClient, cfg: RunConfig, rec: RequestRecord, req: datasets.SampleRequest) -> None:
    start = last = time.perf_counter()
    parts: list[str] = []
    async with client.stream("POST", cfg.endpoint, json=build_payload(cfg, req)) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            rec.error = f"HTTP {resp.status_code}: {body[:500]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                rec.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                return
            choice = (chunk.get("choices") or [{}])[0]
            delta = choice.get("delta") or {}  # chat
            text = choice.get("text") or (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            if text:
                rec.itl_s.append(now - last) if parts else setattr(rec, "ttft_s", now - start)
                last = now
                parts.append(text)
            usage = chunk.get("usage") or {}
            if usage.get("completion_tokens") is not None:
                rec.output_tokens, rec.output_tokens_from_usage = int(usage["completion_tokens"]), True
            if usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(usage["prompt_tokens"])
    rec.e2el_s = time.perf_counter() - start
    if not parts:  # no text at all (e.g. immediate EOS): the first byte of the answer is its end
        rec.ttft_s = rec.e2el_s
    if not rec.output_tokens_from_usage:
        rec.output_tokens = len(parts)
    rec.success = True


async def send_request(
    client: httpx.AsyncClient, cfg: RunConfig, index: int, req: datasets.SampleRequest, t0: float, timeout_s: float
) -> RequestRecord:
    """Send one streaming request and measure it; never raises for HTTP or protocol failures."""
    rec = RequestRecord(index, req.prompt_len, req.expected_output_len, start_s=time.perf_counter() - t0)
    if timeout_s <= 0:
        rec.error = "not sent: --max-duration reached"
        return rec
    try:
        await asyncio.wait_for(_stream(client, cfg, rec, req), timeout=timeout_s)
    except asyncio.TimeoutError:
        rec.success, rec.error = False, f"timed out after {timeout_s:.1f} s"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        rec.success, rec.error = False, f"{type(e).__name__}: {e}"
    return rec


async def run_benchmark(
    base_url: str, headers: dict[str, str], cfg: RunConfig, requests: list[datasets.SampleRequest]
) -> tuple[list[RequestRecord], float]:
    """Send `requests` with Poisson arrivals at `cfg.request_rate` (all at once when inf), at most
    `cfg.max_concurrency` in flight. Returns the records in request order and the duration (s)."""
    limit = cfg.max_concurrency or max(len(requests), 1)
    sem, rng = asyncio.Semaphore(limit), random.Random(cfg.seed)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(cfg.request_timeout_s)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as client:
        pbar = tqdm(total=len(requests), disable=cfg.disable_tqdm, desc=f"concurrency {cfg.max_concurrency}")
        t0 = time.perf_counter()
        deadline = t0 + cfg.max_duration_s if cfg.max_duration_s else float("inf")

        async def one(i: int, req: datasets.SampleRequest) -> RequestRecord:
            async with sem:
                budget = min(cfg.request_timeout_s, deadline - time.perf_counter())
                rec = await send_request(client, cfg, i, req, t0, budget)
            pbar.update(1)
            return rec

        tasks: list[asyncio.Task[RequestRecord]] = []
        for i, req in enumerate(requests):
            if i > 0 and cfg.request_rate != float("inf"):
                await asyncio.sleep(min(rng.expovariate(cfg.request_rate), max(deadline - time.perf_counter(), 0)))
            tasks.append(asyncio.create_task(one(i, req)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        pbar.close()
    return records, duration


def resolve_model(base_url: str, headers: dict[str, str]) -> str:
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    resp.raise_for_status()
    if not (models := resp.json().get("data")):
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def load_requests(
    args: argparse.Namespace, counter: datasets.TokenCounter | None, num_prompts: int, seed: int
) -> list[datasets.SampleRequest]:
    """`num_prompts` requests of the dataset drawn with `seed`; prompt lengths by `counter`, else estimated."""
    if num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    out_len = args.output_len or 128
    if args.dataset_name == "random":
        return datasets.random_requests(
            num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, seed, counter
        )
    if args.dataset_name == "humaneval":
        return datasets.humaneval_requests(num_prompts, out_len, seed, counter, args.dataset_path)
    if not args.dataset_path:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    return datasets.jsonl_requests(args.dataset_path, num_prompts, out_len, seed, counter)


def estimate(probe_s: float, num_prompts: int, sweep: list[int | None], request_rate: float) -> str:
    """The run's duration from the probe's: between perfect batching and none."""

    def _duration(s: float) -> str:
        return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"

    low = sum(max(num_prompts * probe_s / (c or num_prompts), num_prompts / request_rate) for c in sweep)
    high = len(sweep) * max(num_prompts * probe_s, num_prompts / request_rate)
    hint = " (--num-prompts or --max-duration shorten it)" if high > 600 else ""
    return (
        f"Estimate: the probe request took {probe_s:.2f} s; {len(sweep)} run(s) of {num_prompts} requests "
        f"take {_duration(low)} to {_duration(high)}{hint}."
    )


def bench_main(args: argparse.Namespace) -> int:
    """Run `specserve bench`; 0 when every request succeeded. Each concurrency point draws fresh
    prompts (seed + 1 + point); prompts a finite dataset repeats are counted (`repeated_prompts`)."""
    api_key = args.api_key or envs.api_key()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        slos = report.parse_goodput(args.goodput)
        sweep = report.parse_concurrency(args.max_concurrency)
        model = args.model or resolve_model(args.base_url, headers)
        counter = datasets.make_token_counter(args.base_url, model, headers)
        token_count = "server /tokenize" if counter else "estimate (1 token per word)"
        try:
            probe_req = load_requests(args, counter, 1, args.seed)
            points = [load_requests(args, counter, args.num_prompts, args.seed + 1 + i) for i in range(len(sweep))]
        finally:
            if counter is not None:
                counter.close()
    except (ValueError, OSError, httpx.HTTPError) as e:
        print(f"specserve bench: {e}")
        return 1
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name == "random"
    base = RunConfig(args.endpoint, model, args.request_rate, None, args.temperature, ignore_eos, args.request_timeout)
    base = replace(base, max_duration_s=args.max_duration, seed=args.seed, disable_tqdm=args.disable_tqdm)
    probe, _ = asyncio.run(run_benchmark(args.base_url, headers, replace(base, disable_tqdm=True), probe_req))
    if not probe[0].success:
        print(f"specserve bench: the initial test request failed: {probe[0].error}")
        return 1
    print(estimate(probe[0].e2el_s, args.num_prompts, sweep, args.request_rate), flush=True)
    result: dict[str, Any] = {"config": report.config_json(args, model, ignore_eos, token_count), "runs": []}
    seen = {probe_req[0].prompt}
    for concurrency, requests in zip(sweep, points):
        cfg = replace(base, max_concurrency=concurrency)
        repeated = sum(r.prompt in seen for r in requests)
        seen.update(r.prompt for r in requests)
        print(f"Benchmark: {len(requests)} requests, rate {args.request_rate}, max concurrency {concurrency}")
        if repeated:  # a finite dataset ran out of fresh prompts
            print(f"Note: {repeated} of these prompts were sent earlier in this run: the prefix cache may be warm.")
        records, duration = asyncio.run(run_benchmark(args.base_url, headers, cfg, requests))
        agg = report.compute_aggregates(records, duration, slos)
        print(report.format_table(agg, concurrency))
        run = {"max_concurrency": concurrency, "repeated_prompts": repeated, "aggregates": agg}
        result["runs"].append({**run, "requests": [{**asdict(r), "tpot_s": r.tpot_s} for r in records]})
    if len(sweep) > 1:
        print(report.format_sweep(result["runs"]))
    report.write_outputs(args, result)
    return 0 if all(r["aggregates"]["failed"] == 0 for r in result["runs"]) else 1
