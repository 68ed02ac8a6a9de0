"""bench/controller_sweep.py's engines and one measured point (the policies: sweep_policy.py).

Imported for its side effect too: the engine's StepTokenStats is replaced by one that records
every (request, time, new tokens) a step reports, the token timestamps run_point measures from.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import os
import random
import shutil
import subprocess
import time
from collections import Counter
from typing import Any

import torch

import specserve.engine.engine as engine_module
from specserve import LLM, SamplingParams
from specserve.engine.output_processor import StepTokenStats

SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total")

# -- token timestamps: every (request, time, new tokens) the engine's step reports ------------------
_EVENTS: list[tuple[str, float, int]] = []


class _RecordingTokenStats(StepTokenStats):
    def add(self, req, num_new: int, now: float) -> None:
        _EVENTS.append((req.request_id, now, num_new))
        super().add(req, num_new, now)


engine_module.StepTokenStats = _RecordingTokenStats  # what Engine._update instantiates


# -- engines and policies -------------------------------------------------------------------------
def kv_bytes_for(model: str, load_format: str, device: torch.device, dtype: str, tokens: int) -> int:
    """A KV pool for `tokens` tokens (both engines live at once, so neither takes the GPU's share)."""
    from specserve.config import ModelConfig
    from specserve.model.arch import ModelArch
    from specserve.model.loader import _Source, resolve_dtype

    arch = ModelArch.from_hf_config(_Source.open(ModelConfig(model=model, load_format=load_format)).hf_config)
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * resolve_dtype(dtype, device).itemsize
    return int(per_token * tokens * 1.25) + (64 << 20)


def spec_config(mode: dict[str, Any], args: argparse.Namespace, k: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"method": mode["method"], "num_speculative_tokens": k}
    if mode["method"] == "ngram":
        cfg.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    else:
        cfg["model"] = mode["draft"]
    return cfg


def build(mode: dict[str, Any], args: argparse.Namespace, spec: dict[str, Any] | None, max_seqs: int,
          max_len: int, kv_bytes: int | None) -> LLM:
    kw: dict[str, Any] = {"load_format": mode["load_format"], "dtype": args.dtype, "device": args.device,
                          "max_model_len": max_len, "max_num_seqs": max_seqs, "seed": args.seed,
                          "enable_prefix_caching": False, "speculative_config": spec}
    if kv_bytes:
        kw["kv_cache_memory_bytes"] = kv_bytes
    return LLM(model=mode["model"], progress=False, **kw)


def capture_all_verify_graphs(llm: LLM, max_k: int) -> tuple[int, ...]:
    """Capture decode + verify graphs for query lengths 1..K+1 on the shared engine; returns what the
    engine itself had captured (the adaptive policy's set)."""
    runner = llm.engine.runner
    if runner.graphs is None:
        return ()
    old = runner.graphs
    own = tuple(old.verify_query_lens)
    kept = (old.prefill_query_lens, old.catch_up_query_lens, old.mixed_token_lens)
    runner.graphs = None  # free the engine's own graphs before capturing the larger set
    del old
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_graphs(llm.engine.scheduler.max_num_seqs, llm.engine.max_model_len, tuple(range(1, max_k + 2)),
                          *kept)
    return own


def spec_counters(llm: LLM) -> dict[str, float]:
    return {k: float(llm.engine.stats.get(k)) for k in SPEC_COUNTERS}


def count_graph_replays(llm: LLM, max_q: int) -> Counter:
    """Wrap graph_for to count the steps that replayed a graph as they were ("graph") or padded per
    sequence to a captured length ("padded": n-gram drafts of several lengths), and those that ran
    eagerly: one query length with no graph ("eager"), several ("ragged"), or a prompt chunk; "mixed":
    ragged steps that replayed a mixed graph (runner/cuda_graph.py MIXED_TOKEN_LENS)."""
    counts: Counter = Counter()
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return counts
    inner = type(graphs).graph_for.__get__(graphs)

    def counting(batch):
        found = inner(batch)
        q = batch.uniform_query_len()
        if found is not None and len(found[1]) > 2:
            counts["mixed"] += 1
        elif found is not None:
            counts["graph" if found[0] is batch else "padded"] += 1
        elif max(batch.cu_query_lens[1:] - batch.cu_query_lens[:-1]) > max_q:
            counts["prefill"] += 1
        else:
            counts["eager" if q is not None else "ragged"] += 1
        return found

    graphs.graph_for = counting
    return counts


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    t = torch.tensor(values, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"mean": float(t.mean()), "p50": q[0], "p90": q[1], "p99": q[2]}


class GcPauses:
    """Python's garbage-collection pauses while it is entered, per generation: a full collection of a
    process holding several engines walks every object they hold (the pair sweep's 128 / 256 points
    had one slow part in three with nothing drafted: is it this?)."""

    def __init__(self) -> None:
        self.ms = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._t = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.ms[info["generation"]] += (time.perf_counter() - self._t) * 1e3
            self.count[info["generation"]] += 1

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, list]:
        return {"count": list(self.count), "ms": [round(x, 2) for x in self.ms]}


def round_order(policies: list[str], run: int) -> list[str]:
    """The order the policies run their parts in round `run` of a point: the rows of a Williams design
    (a Latin square balanced for what runs just before). Over len(policies) rounds each policy runs once
    in each position; with an even number of policies each one follows every other once, with an odd
    number it follows two others (every other twice over twice the rounds, the rows then mirrored). So
    slow spells on the machine, or heat left by the heaviest policy, do not fall on one policy always."""
    n = len(policies)
    if n == 0:
        return []
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    r = run % (2 * n if n % 2 else n)
    row = [(x + r) % n for x in first]
    return [policies[i] for i in (row[::-1] if r >= n else row)]


def step_profile(step_ms: list[tuple[float, int, int]], slowest: int = 3, full: int | None = None) -> dict[str, Any]:
    """A run's engine.step() wall times: median, total, and the slowest few as [ms, step index,
    requests running], so a run that stalled shows whether one step took the time or all ran slower.
    With `full` (the point's concurrency), also the median and count of the steps that ran `full`
    requests: parts whose full-batch steps differ ran the same kind of step slower (the machine), where
    parts that differ only in their medians ran a different mix of steps (the schedule)."""
    times = sorted(t for t, _, _ in step_ms)
    top = sorted(step_ms, reverse=True)[:slowest]
    prof: dict[str, Any] = {"p50": round(times[len(times) // 2], 3) if times else None, "total": round(sum(times), 1),
                            "slowest": [[round(t, 2), i, n] for t, i, n in top]}
    if full is not None:
        at_full = sorted(t for t, _, n in step_ms if n >= full)
        prof["full_p50"] = round(at_full[len(at_full) // 2], 3) if at_full else None
        prof["full_steps"] = len(at_full)
    return prof


_GPU_QUERY = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")


def machine_state(cpu_s: float) -> dict[str, Any]:
    """What the machine was doing at the end of a run, to tell a slow run's cause: the process's CPU
    seconds over the run (every thread), the 1-minute load average, and the GPU's clocks, temperature and
    power from nvidia-smi where there is one (~tens of ms, outside the timed run). On the H200 the pair's
    parts without speculation ran 17-31k tokens/s at 256 requests (twenty-seventh session). In the
    twenty-eighth, the SM clock read 1,980 MHz after every part, CPU seconds equalled wall seconds, and the
    slow parts' full-batch steps took 1.4-1.8x as long at 20-40% lower power: the GPU waited on the host."""
    state: dict[str, Any] = {"cpu_s": round(cpu_s, 3), "load1": round(os.getloadavg()[0], 2)}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            line = subprocess.run([smi, f"--query-gpu={','.join(_GPU_QUERY)}", "--format=csv,noheader,nounits",
                                   "--id=0"], capture_output=True, text=True, timeout=5).stdout.strip()
            values = [v.strip() for v in line.split(",")]
            if len(values) == len(_GPU_QUERY):
                state["gpu"] = dict(zip(("sm_mhz", "mem_mhz", "temp_c", "power_w"), values))
        except (OSError, subprocess.SubprocessError):
            pass
    return state


def slow_runs(runs: list[dict[str, Any]], factor: float = 1.15) -> list[str]:
    """A line for each run of a point that took factor x its median run or more: where its time went
    (its step-time median and slowest steps against a typical run's), so a stall is told from a choice."""
    if len(runs) < 3:
        return []
    median = sorted(r["seconds"] for r in runs)[len(runs) // 2]
    typical = min(runs, key=lambda r: abs(r["seconds"] - median))
    lines = []
    for i, r in enumerate(runs):
        prof, base = r.get("steps_ms") or {}, typical.get("steps_ms") or {}
        if r["seconds"] >= factor * median and prof:
            full = (f"; full-batch step p50 {prof['full_p50']} ms (typical {base.get('full_p50')})"
                    if prof.get("full_p50") is not None else "")
            lines.append(f"slow run {i}: {r['seconds']:.3f} s (median {median:.3f}); step p50 {prof['p50']} ms "
                         f"(typical {base.get('p50')}), slowest [ms, step, running] {prof['slowest']} "
                         f"(typical {base.get('slowest')}){full}")
    return lines


def output_lengths(output_len: int, spread: float, num_requests: int, seed: int) -> list[int]:
    """Each request's output tokens: `output_len`, or with `spread` s > 0 drawn uniformly from
    [output_len (1 - s), output_len (1 + s)] (mean output_len), the same for every policy and part (request
    i's length depends on the seed and i alone: the parts of a point run the same requests).

    Why spread: a server's requests end when their answers do, and with one length for all the c requests
    a part starts together also end together (no speculation: in the same step). On the H200 pair
    (twenty-seventh session) a spread of 0.5 did not make the parts of a point any steadier: without
    speculation, parts of identical work ran at 17-31k tokens/s at 256 requests with one length, 26-38k
    with the spread (128: 23-28k and 27-34k). It did change which fixed k is best at 1 request (k = 8
    with one length of 256, k = 12 with 128-384, whose steps got 11.7 tokens of 13 on average)."""
    if spread <= 0.0:
        return [output_len] * num_requests
    if not 0.0 < spread < 1.0:
        raise ValueError(f"output_len_spread must be in [0, 1), got {spread}")
    rng = random.Random(f"output-lengths-{seed}-{output_len}-{spread}")
    lo, hi = max(1, round(output_len * (1.0 - spread))), round(output_len * (1.0 + spread))
    return [rng.randint(lo, hi) for _ in range(num_requests)]


def run_point(llm: LLM, prompts: list[list[int]], c: int, num_requests: int, output_len: int,
              args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """num_requests requests, c in flight; throughput and per-request latencies."""
    engine = llm.engine
    lengths = output_lengths(output_len, args.output_len_spread, num_requests, args.seed)
    queue = [(f"{tag}-{i}", prompts[i % len(prompts)],
              SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=not args.respect_eos))
             for i, n in enumerate(lengths)]
    arrival: dict[str, float] = {}
    finished: dict[str, float] = {}
    before = spec_counters(llm) if engine.spec is not None else None
    _EVENTS.clear()
    steps = 0
    start = time.perf_counter()

    def submit() -> None:
        rid, ids, params = queue.pop(0)
        arrival[rid] = time.monotonic()
        engine.add_request(rid, {"prompt_token_ids": ids}, params, arrival_time=arrival[rid])

    while queue and len(arrival) - len(finished) < c:
        submit()
    step_ms: list[tuple[float, int, int]] = []  # (wall ms of engine.step(), step index, requests running)
    cpu0 = time.process_time()
    with GcPauses() as pauses:
        while len(finished) < num_requests:
            t0 = time.perf_counter()
            outs = engine.step()
            step_ms.append(((time.perf_counter() - t0) * 1e3, steps, len(engine.scheduler.running)))
            steps += 1
            now = time.monotonic()
            for out in outs:
                if out.finished and out.request_id not in finished:
                    finished[out.request_id] = now
                    if queue:
                        submit()
    seconds = time.perf_counter() - start
    machine = machine_state(time.process_time() - cpu0)
    chunks: dict[str, list[tuple[float, int]]] = {}
    for rid, t, n in _EVENTS:
        chunks.setdefault(rid, []).append((t, n))
    records, itls = [], []
    for rid, t0 in arrival.items():
        ev = chunks.get(rid, [])
        n = sum(k for _, k in ev)
        if not ev:
            continue
        first, last = ev[0][0], ev[-1][0]
        tpot = (last - first) / (n - 1) if n > 1 else None
        records.append((first - t0, tpot, last - t0, n))
        itls += [b[0] - a[0] for a, b in itertools.pairwise(ev)]
    tokens = sum(r[3] for r in records)
    run_seconds, run_tokens = seconds, tokens
    window = steady_window(arrival, finished, _EVENTS, c) if args.window == "steady" else None
    done = num_requests
    if window is not None:
        seconds, tokens, done = window
    ms = 1000.0
    row: dict[str, Any] = {
        "num_requests": num_requests, "output_len": output_len, "seconds": seconds, "steps": steps,
        "output_tokens": tokens, "tokens_per_s": tokens / seconds, "requests_per_s": done / seconds,
        "window": "steady" if window is not None else "run", "run_seconds": run_seconds,
        "run_output_tokens": run_tokens,
        "latency_ms": {"ttft": percentiles([r[0] * ms for r in records]),
                       "tpot": percentiles([r[1] * ms for r in records if r[1] is not None]),
                       "itl": percentiles([x * ms for x in itls]),
                       "e2el": percentiles([r[2] * ms for r in records])},
        "requests": [[round(r[0] * ms, 3), None if r[1] is None else round(r[1] * ms, 4), round(r[2] * ms, 3), r[3]]
                     for r in records],
        "_itls_ms": [x * ms for x in itls],  # for merge_points; dropped before the row is saved
        "gc": pauses.summary(),
        "steps_ms": step_profile(step_ms, full=c),
        "machine": machine,
    }
    if before is not None:
        drafts, drafted, accepted = (spec_counters(llm)[k] - before[k] for k in SPEC_COUNTERS)
        row["_spec"] = (drafts, drafted, accepted)
        row["acceptance_rate"] = accepted / drafted if drafted else None
        row["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return row


def warm_up(engines: dict[str, LLM], policies: list[Any], prompts: list[list[int]], width: int,
            args: argparse.Namespace) -> None:
    """JIT and graphs on every path (prefill at full width, decode, verify eager and replayed), so no
    policy's first point pays them, and the adaptive controllers past their first measurements.
    policies: sweep_policy.Policy objects, installed on engines["spec"] in turn."""
    wide = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(width)]
    few = wide[:2]
    params = SamplingParams(temperature=0.0, max_tokens=min(16, args.output_len), ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    if "off" in engines:
        engines["off"].generate(wide, short)
        engines["off"].generate(few, params)
    for i, policy in enumerate(policies):
        policy.install(engines["spec"])
        if i == 0:
            engines["spec"].generate(wide, short)
        engines["spec"].generate(few, params)
        policy.clear()


def point_warm_up(llm: LLM, prompts: list[list[int]], c: int, tokens: int, args: argparse.Namespace) -> None:
    """c requests of `tokens` output tokens at the point's concurrency, unmeasured, before every policy's
    point alike: the point then measures the steady state at this load (an adaptive controller has met
    this batch size, as a server's has long after its load changed), not the first steps after a jump."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=not args.respect_eos)
    llm.generate([{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(c)], params)


def steady_window(arrival: dict[str, float], finished: dict[str, float], events: list[tuple[str, float, int]],
                  c: int) -> tuple[float, int, int] | None:
    """(seconds, output tokens, requests finished) of a closed-loop run while c requests were in flight:
    from the first submission to the last, after which the queue is empty and the run drains (None when
    nothing was ever replaced: at most c requests). In the drain fewer requests run, and how long it lasts
    depends on the policy: under speculation requests advance at different paces, so the last of them
    runs alone at the end, which a server with a steady load never sees (nineteenth session: with one
    wave of c requests per part, the drain took ~25% of the adaptive policy's time at concurrency 16)."""
    if len(arrival) <= c:
        return None
    t0, t1 = min(arrival.values()), max(arrival.values())
    if t1 <= t0:
        return None
    tokens = sum(n for _, t, n in events if t <= t1)
    return t1 - t0, tokens, sum(1 for t in finished.values() if t <= t1)


def merge_points(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One point from run_point rows of the same policy and concurrency, run apart (interleaved with
    the other policies' runs): throughput over their summed time, latency percentiles over all their
    requests and token gaps, acceptance over all their drafts. Drops the rows' raw lists."""
    reqs = [r for row in rows for r in row["requests"]]
    itls = [x for row in rows for x in row.pop("_itls_ms", [])]
    seconds = sum(row["seconds"] for row in rows)
    tokens = sum(row["output_tokens"] for row in rows)
    num_requests = sum(row["num_requests"] for row in rows)
    merged: dict[str, Any] = {
        "num_requests": num_requests, "output_len": rows[0]["output_len"], "seconds": seconds,
        "run_seconds": sum(row.get("run_seconds", row["seconds"]) for row in rows),
        "window": rows[0].get("window", "run"),
        "steps": sum(row["steps"] for row in rows), "output_tokens": tokens, "tokens_per_s": tokens / seconds,
        "requests_per_s": sum(row.get("requests_per_s", row["num_requests"] / row["seconds"]) * row["seconds"]
                              for row in rows) / seconds,
        "latency_ms": {"ttft": percentiles([r[0] for r in reqs]),
                       "tpot": percentiles([r[1] for r in reqs if r[1] is not None]),
                       "itl": percentiles(itls), "e2el": percentiles([r[2] for r in reqs])},
        "requests": reqs,
    }
    if len(rows) > 1:
        merged["runs"] = [{"seconds": row["seconds"], "tokens_per_s": row["tokens_per_s"],
                           "run_seconds": row.get("run_seconds"), "gc": row.get("gc"),
                           "steps_ms": row.get("steps_ms"), "machine": row.get("machine")} for row in rows]
    else:
        for key in ("gc", "steps_ms", "machine"):
            if key in rows[0]:
                merged[key] = rows[0][key]
    spec = [row.pop("_spec") for row in rows if "_spec" in row]
    if spec:
        drafts, drafted, accepted = (sum(x[i] for x in spec) for i in range(3))
        merged["acceptance_rate"] = accepted / drafted if drafted else None
        merged["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return merged
