"""`specserve advise`: sample a server's /metrics over a window and say where the bottleneck is (speculation,
KV pool, KV capacity, prefix reuse, latency). `advise()` is pure: snapshots in, advice with its numbers out."""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from specserve import envs
from specserve.bench.metrics_parse import Histogram, MetricsSnapshot, parse_metrics

LOW_CONCURRENCY = 8.0
HIGH_CONCURRENCY = 50.0
KV_FULL = 0.9
ACCEPT_MIN = 0.3  # a draft position is worth its verify cost while accepted this often
ACCEPT_RAISE = 0.6  # the last position accepted this often: drafting further would likely pay
PREFIX_LOW = 0.1
MIN_DRAFTS = 50  # fewer drafts than this: per-position acceptance is noise
MIN_REQUESTS = 10
MIN_ITL_SAMPLES = 100
CHEAP_TOKEN = 0.2  # an extra token in a step costs under this share of a step: verifying k is cheap
DEAR_TOKEN = 0.5
SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2, "info": 3}

Evidence = dict[str, float | int | str | None]


@dataclass(frozen=True)
class Advice:
    """One finding: what, the numbers behind it, what to change, and how much it matters."""

    title: str
    evidence: Evidence
    action: str
    severity: str  # high | medium | low | info


@dataclass
class WindowStats:
    """Counter deltas and gauge summaries of a window; one snapshot: totals, `seconds` None."""

    seconds: float | None
    running_avg: float = 0.0
    running_max: float = 0.0
    waiting_avg: float = 0.0
    waiting_max: float = 0.0
    kv_usage_avg: float = 0.0
    kv_usage_max: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    spec_configured: bool = False
    spec_info: dict[str, str] = field(default_factory=dict)  # spec_decode_config_info labels
    chosen_k: float | None = None
    chosen_k_samples: list[float] = field(default_factory=list)
    step_points: list[tuple[float, float, float]] = field(default_factory=list)  # (running, ITL s, count) a sample
    histograms: dict[str, Histogram] = field(default_factory=dict)
    cache_info: dict[str, str] = field(default_factory=dict)

    def rate(self, name: str) -> float | None:
        return self.counters.get(name, 0.0) / self.seconds if self.seconds else None


# Current names first, then older vLLM spellings.
GAUGES = {
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
}
COUNTERS = {
    "preemptions": ("num_preemptions_total",),
    "requests": ("request_success_total",),
    "generation_tokens": ("generation_tokens_total",),
    "prefix_queries": ("prefix_cache_queries_total", "gpu_prefix_cache_queries_total"),
    "prefix_hits": ("prefix_cache_hits_total", "gpu_prefix_cache_hits_total"),
    "drafts": ("spec_decode_num_drafts_total",),
    "draft_tokens": ("spec_decode_num_draft_tokens_total",),
    "accepted": ("spec_decode_num_accepted_tokens_total",),
    "offload_queries": ("kv_offload_queries_total",),
}
HISTOGRAMS = {
    "ttft": "time_to_first_token_seconds",
    "itl": "inter_token_latency_seconds",
    "e2e": "e2e_request_latency_seconds",
    "queue": "request_queue_time_seconds",
}
PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
CHOSEN = "spec_decode_chosen_num_tokens"  # the controller's k of its last step


def _first_name(snap: MetricsSnapshot, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if snap.has(n)), None)


def _delta(hist: Histogram | None, earlier: Histogram | None) -> Histogram | None:
    return hist.minus(earlier) if hist is not None and earlier is not None else hist


def window_stats(snapshots: list[MetricsSnapshot]) -> WindowStats:
    """Summarise a window of snapshots (oldest first)."""
    if not snapshots:
        raise ValueError("advise needs at least one metrics snapshot")
    first, last = snapshots[0], snapshots[-1]
    single = len(snapshots) == 1
    stats = WindowStats(seconds=None if single else max(last.timestamp - first.timestamp, 1e-9))
    for key, names in GAUGES.items():
        name = _first_name(last, names)
        # Per engine: the busiest series (one per replica behind a front door), not their sum.
        values = [max((v for _, v in s.samples.get(name, [])), default=0.0) for s in snapshots] if name else [0.0]
        setattr(stats, f"{key}_avg", sum(values) / len(values))
        setattr(stats, f"{key}_max", max(values))
    for key, names in COUNTERS.items():
        name = _first_name(last, names)
        if name:
            stats.counters[key] = last.value(name) - (0.0 if single else first.value(name))
    before = {} if single else first.by_label(PER_POS, "position")
    for pos, value in last.by_label(PER_POS, "position").items():
        stats.accepted_per_pos[int(pos)] = value - before.get(pos, 0.0)
    if last.has(CHOSEN):
        stats.chosen_k_samples = [s.value(CHOSEN) for s in snapshots]
        stats.chosen_k = stats.chosen_k_samples[-1]
    stats.spec_info = last.labels_of("spec_decode_config_info")
    stats.spec_configured = bool(stats.spec_info) or last.value(COUNTERS["drafts"][0]) > 0 or last.value(CHOSEN) > 0
    running = _first_name(last, GAUGES["running"]) or GAUGES["running"][0]
    for a, b in itertools.pairwise(snapshots):  # ITL per interval, against the load at its end
        d = _delta(b.histogram(HISTOGRAMS["itl"]), a.histogram(HISTOGRAMS["itl"]))
        if d is not None and d.count > 0:
            stats.step_points.append((b.value(running), d.sum / d.count, d.count))
    for key, name in HISTOGRAMS.items():
        d = _delta(last.histogram(name), None if single else first.histogram(name))
        if d is not None:
            stats.histograms[key] = d
    stats.cache_info = last.labels_of("cache_config_info")
    return stats


def regime(stats: WindowStats) -> str:
    """idle | low | medium | high, by requests in the running batch (and any queue)."""
    if stats.running_max == 0 and stats.waiting_max == 0 and stats.counters.get("generation_tokens", 0) == 0:
        return "idle"
    if stats.running_avg >= HIGH_CONCURRENCY:
        return "high"
    if stats.running_avg < LOW_CONCURRENCY and stats.waiting_max == 0:
        return "low"
    return "medium"


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _ms(hist: Histogram | None, q: float) -> float | None:
    value = hist.quantile(q) if hist is not None else None
    return None if value is None else round(value * 1e3, 2)


def _load_evidence(s: WindowStats) -> Evidence:
    names = [f"{k}_{a}" for k in ("running", "waiting", "kv_usage") for a in ("avg", "max")]
    return {n: _r(getattr(s, n), 3 if n.startswith("kv") else 2) for n in names}


def step_cost(s: WindowStats) -> tuple[float, float] | None:
    """(ms of a one-request step, ms per further request): least squares of interval ITL against
    running requests; None unless the window saw batch sizes at least one request apart."""
    pts = [(x, y, w) for x, y, w in s.step_points if x >= 0.5]
    if len(pts) < 2 or max(x for x, _, _ in pts) - min(x for x, _, _ in pts) < 1.0:
        return None
    total = sum(w for _, _, w in pts)
    mx, my = sum(x * w for x, _, w in pts) / total, sum(y * w for _, y, w in pts) / total
    slope = sum(w * (x - mx) * (y - my) for x, y, w in pts) / sum(w * (x - mx) ** 2 for x, _, w in pts)
    return (my + slope * (1.0 - mx)) * 1e3, slope * 1e3


_SPEC_CONFIGS = (
    'Copying outputs (code edits, RAG): \'{"method": "ngram", "num_speculative_tokens": 4}\'; else an EAGLE head '
    '(\'{"method": "eagle3", "model": HEAD}\', see `specserve train-draft`) or a small same-family draft '
    '(\'{"method": "draft_model", "model": DRAFT}\'). Compare them with `specserve bench`.'
)


def _speculation_off(s: WindowStats) -> Advice:
    cost = step_cost(s)
    ev: Evidence = {
        **_load_evidence(s),
        "itl_p50_ms": _ms(s.histograms.get("itl"), 0.5),
        "generation_tokens_per_s": _r(s.rate("generation_tokens"), 1),
        "step_ms_1_request": _r(cost[0], 2) if cost else None,
        "step_ms_per_extra_request": _r(cost[1], 2) if cost else None,
    }
    if cost is None:
        why = "One batch size seen, so a step's cost per token is unknown: sample during `specserve bench "
        title = "Low concurrency: speculation may pay (its cost is unmeasured here)"
        return Advice(title, ev, why + "--max-concurrency 1,4`. " + _SPEC_CONFIGS, "low")
    share = max(cost[1], 0.0) / max(cost[0], 1e-9)
    title, severity = "Low concurrency: decode is latency-bound, turn speculation on", "low"
    if share >= DEAR_TOKEN:
        title, severity = "Low concurrency: speculation is unlikely to pay here", "info"
    elif share < CHEAP_TOKEN:
        severity = "medium"
    action = (
        f"Measured: each extra token in a step costs {share:.0%} of a one-request step ({cost[1]:.1f} of "
        f"{cost[0]:.1f} ms), so verifying k drafts costs about 1 + {share:.2f}k steps. "
    )
    return Advice(title, ev, action + _SPEC_CONFIGS, severity)


def _speculation_k(s: WindowStats) -> Advice | None:
    drafts = s.counters.get("drafts", 0.0)
    if drafts <= 0:
        return None
    k_conf = int(s.spec_info["num_speculative_tokens"]) if "num_speculative_tokens" in s.spec_info else None
    adaptive = s.spec_info.get("adaptive") == "True"
    k_now = k_conf or max(len(s.accepted_per_pos), 1)  # without the info metric: the positions seen
    drafted = s.counters.get("draft_tokens", 0.0) / drafts
    per_pos = [s.accepted_per_pos.get(i, 0.0) / drafts for i in range(k_now)]
    k_best = sum(1 for a in per_pos if a >= ACCEPT_MIN)
    chosen = s.chosen_k_samples
    ev: Evidence = {
        "drafts": int(drafts),
        "num_speculative_tokens": k_conf,
        "adaptive": str(adaptive),
        "mean_drafted_per_draft": _r(drafted, 2),
        "chosen_k_last": s.chosen_k,
        "chosen_k_mean": _r(sum(chosen) / len(chosen), 2) if chosen else None,
        "mean_acceptance_length": _r(1.0 + s.counters.get("accepted", 0.0) / drafts),
        **{f"acceptance_pos_{i}": _r(a) for i, a in enumerate(per_pos)},
    }
    if drafts < MIN_DRAFTS:
        return Advice("Too few drafts to size k", ev, f"Only {int(drafts)} drafts: sample longer.", "info")
    note = ""
    if drafted < k_now - 0.5:
        note = f" {drafted:.1f} of k={k_now} tokens drafted per draft: late positions' rates are lower bounds."
    if per_pos[0] < ACCEPT_MIN:
        action = f"Position 0 is accepted in under {ACCEPT_MIN:.0%} of drafts: try another method or turn it off."
        return Advice("Speculation rarely pays: drafts are mostly rejected", ev, action, "high")
    if k_best < k_now and not note:
        title = f"Draft fewer tokens: num_speculative_tokens {k_now} -> {k_best}"
        action = f'Positions {k_best}.. are accepted under {ACCEPT_MIN:.0%}: set "num_speculative_tokens": {k_best}.'
        return Advice(title, ev, action, "medium")
    if per_pos[k_now - 1] >= ACCEPT_RAISE:
        title = f"Draft more tokens: num_speculative_tokens {k_now} -> {k_now + 2}"
        action = f"The last position is accepted {per_pos[k_now - 1]:.0%} of the time; try {k_now + 2} with bench."
        return Advice(title, ev, action, "low")
    what = "the controller picks 0..k per step" if adaptive else "acceptance falls below break-even after k"
    return Advice(f"Speculation is well sized (k={k_now})", ev, f"Keep k: {what}.{note}", "info")


def _speculation(s: WindowStats, where: str) -> list[Advice]:
    out = [_speculation_off(s)] if where == "low" and not s.spec_configured else []
    out += [a for a in (_speculation_k(s),) if a is not None]
    if where == "high" and s.counters.get("drafts", 0.0) > 0:
        ev: Evidence = {
            "running_avg": _r(s.running_avg, 2),
            "chosen_k_last": s.chosen_k,
            "drafts": int(s.counters["drafts"]),
        }
        action = "Large batches are compute-bound: lower num_speculative_tokens or let the controller drop to 0."
        out.append(Advice("High concurrency: speculation competes with batching", ev, action, "medium"))
    return out


def _thin(s: WindowStats) -> list[Advice]:
    itl = s.histograms.get("itl")
    lacks = {
        "one snapshot: totals since the server started, not this load": s.seconds is None,
        f"under {MIN_REQUESTS} requests finished": s.counters.get("requests", 0.0) < MIN_REQUESTS,
        f"under {MIN_ITL_SAMPLES} inter-token latencies": itl is None or itl.count < MIN_ITL_SAMPLES,
    }
    reasons = [r for r, lacking in lacks.items() if lacking]
    if not reasons:
        return []
    ev: Evidence = {"requests": int(s.counters.get("requests", 0)), "itl_samples": int(itl.count) if itl else 0}
    action = "The window had " + "; ".join(reasons) + ". Sample longer (--window) under representative load."
    return [Advice("Thin evidence: treat this advice as a first look", ev, action, "info")]


def _kv_pool(s: WindowStats) -> list[Advice]:
    preempt = s.counters.get("preemptions", 0.0)
    util = s.cache_info.get("gpu_memory_utilization")
    ev: Evidence = {
        **_load_evidence(s),
        "preemptions": int(preempt),
        "preemptions_per_s": _r(s.rate("preemptions")),
        "queue_time_p99_ms": _ms(s.histograms.get("queue"), 0.99),
        "gpu_memory_utilization": util,
        "num_gpu_blocks": s.cache_info.get("num_gpu_blocks"),
    }
    if s.kv_usage_max >= KV_FULL or preempt > 0:
        target = f"{min(float(util) + 0.05, 0.95):.2f}" if util else "0.92-0.95"
        action = f"The block pool runs full{' and requests are preempted' if preempt else ''}: "
        action += f"--gpu-memory-utilization {target}, a lower --max-model-len, or --kv-cache-dtype fp8 (half the "
        action += "bytes per token)."
        sev = "high" if s.waiting_max > 0 or preempt > 0 else "medium"
        return [Advice("KV cache pool is the bottleneck", ev, action, sev)]
    if s.waiting_max > 0:
        title = "Requests wait while KV blocks are free: the scheduler limits the batch"
        return [Advice(title, ev, "Raise --max-num-seqs (and --max-num-batched-tokens for long prompts).", "medium")]
    return []


def _high_capacity(s: WindowStats, where: str) -> list[Advice]:
    if where != "high":
        return []
    out: list[Advice] = []
    full = s.kv_usage_max >= KV_FULL
    dtype = s.cache_info.get("cache_dtype", s.cache_info.get("kv_cache_dtype", "auto"))
    ev: Evidence = {**_load_evidence(s), "cache_dtype": dtype, "ttft_p99_ms": _ms(s.histograms.get("ttft"), 0.99)}
    if dtype != "nvfp4":
        nxt = "nvfp4" if dtype.startswith("fp8") else "fp8"
        action = f"--kv-cache-dtype {nxt} fits about 2x the tokens in the same pool, so more sequences run per step."
        out.append(Advice(f"High concurrency: store the KV cache as {nxt}", ev, action, "high" if full else "medium"))
    if full and s.counters.get("offload_queries", 0.0) == 0:
        action = "Keep evicted shared prefixes in host memory: --kv-offload-cpu-bytes (e.g. 32e9)."
        out.append(Advice("Add a CPU offload tier for evicted prefix blocks", ev, action, "medium"))
    if s.waiting_max > 0 and full:
        action = "The pool is full and requests queue: add replicas (prefix-aware routing) or tensor parallelism."
        out.append(Advice("Scale out: one replica is saturated", ev, action, "high"))
    return out


def _prefix(s: WindowStats) -> list[Advice]:
    queries = s.counters.get("prefix_queries", 0.0)
    hit = s.counters.get("prefix_hits", 0.0) / queries if queries > 0 else None
    enabled = s.cache_info.get("enable_prefix_caching", "True")
    ev: Evidence = {
        "prefix_hit_rate": _r(hit),
        "prefix_queried_tokens": int(queries),
        "prefix_hit_tokens": int(s.counters.get("prefix_hits", 0.0)),
        "enable_prefix_caching": enabled,
    }
    if enabled.lower() == "false":
        action = "Turn it on (--enable-prefix-caching): shared prompts and chat history are then prefilled once."
        return [Advice("Prefix caching is off", ev, action, "low")]
    if hit is None or hit >= PREFIX_LOW or queries < 1000:
        return []
    action = "If requests share prefixes across replicas, use prefix-cache-aware routing; an offload tier keeps "
    action += "evicted prefixes."
    return [Advice("Prefix cache hit rate is low", ev, action, "low")]


def _latency(s: WindowStats) -> list[Advice]:
    h = s.histograms
    if not any(x.count > 0 for x in h.values()):
        return []
    ev: Evidence = {
        f"{k}_p{q:.0f}_ms": _ms(h.get(k), q / 100) for k in ("ttft", "itl", "e2e", "queue") for q in (50, 99)
    }
    ev["requests_per_s"] = _r(s.rate("requests"), 2)
    action = "Compare with your SLOs; queue time close to TTFT means requests wait for a batch slot."
    return [Advice("Latency percentiles (server histograms)", ev, action, "info")]


def advise(snapshots: list[MetricsSnapshot]) -> list[Advice]:
    """Advice from a window of /metrics snapshots (oldest first), most severe first."""
    s = window_stats(snapshots)
    where = regime(s)
    if where == "idle":
        action = "Nothing ran while sampling: send traffic (e.g. `specserve bench`) or widen --window."
        return [Advice("No load in the window", _load_evidence(s), action, "info")]
    found = _speculation(s, where) + _kv_pool(s) + _high_capacity(s, where) + _prefix(s) + _latency(s) + _thin(s)
    return sorted(found, key=lambda a: SEVERITY_ORDER.get(a.severity, 9))


def add_advise_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    parser.add_argument("--window", type=float, default=30.0, help="seconds to sample (0: one snapshot; default: 30)")
    parser.add_argument("--interval", type=float, default=None, help="seconds between samples (default: window / 10)")
    parser.add_argument("--api-key", default=None, help="Bearer key to send (default: $SPECSERVE_API_KEY)")
    parser.add_argument("--json", action="store_true", help="print the advice as JSON")


def default_interval(window_s: float, interval_s: float | None) -> float:
    """--interval, or window / 10 within [0.5, 5] s."""
    return interval_s if interval_s is not None else min(5.0, max(0.5, window_s / 10))


def sample(base_url: str, window_s: float, interval_s: float, headers: dict[str, str]) -> list[MetricsSnapshot]:
    """Scrape /metrics every `interval_s` until the last scrape is `window_s` after the first."""
    if interval_s <= 0:
        raise ValueError("--interval must be > 0")
    snaps: list[MetricsSnapshot] = []
    with httpx.Client(base_url=base_url, headers=headers, timeout=30.0) as client:
        while True:
            resp = client.get("/metrics")
            resp.raise_for_status()
            now = time.monotonic()
            snaps.append(parse_metrics(resp.text, now))
            left = window_s - (now - snaps[0].timestamp)
            if left <= 0:
                return snaps
            time.sleep(min(interval_s, left))


def advise_main(args: argparse.Namespace) -> int:
    """Run `specserve advise`; 1 when /metrics could not be read."""
    api_key = args.api_key or envs.api_key()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        snaps = sample(args.base_url, args.window, default_interval(args.window, args.interval), headers)
    except (httpx.HTTPError, ValueError) as e:
        print(f"specserve advise: cannot read {args.base_url}/metrics: {e}")
        return 1
    found, stats = advise(snaps), window_stats(snaps)
    if args.json:
        out = {"regime": regime(stats), "window_s": stats.seconds, "samples": len(snaps)}
        print(json.dumps({**out, "advice": [asdict(a) for a in found]}, indent=1))
        return 0
    span = f"{stats.seconds:.1f} s, {len(snaps)} samples" if stats.seconds else "totals since start"
    print(
        f"specserve advise {args.base_url} ({span}): {regime(stats)} concurrency, running "
        f"{stats.running_avg:.1f} avg, waiting {stats.waiting_max:.0f} max, KV usage {stats.kv_usage_max:.0%} max"
    )
    for a in found:
        print(f"\n[{a.severity.upper()}] {a.title}")
        print("  evidence: " + ", ".join(f"{k}={v}" for k, v in a.evidence.items() if v is not None))
        print(f"  action:   {a.action}")
    return 0
