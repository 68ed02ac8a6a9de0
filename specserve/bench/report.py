"""`specserve bench`'s flags, a run's aggregates (vLLM's result keys), its text tables, plot (matplotlib
imported on use) and files. A result is {"config", "runs": [{"max_concurrency", "aggregates", "requests"}]}."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from specserve.bench.serving import RequestRecord

METRICS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)
PERCENTILES = (("mean", None), ("median", 50.0), ("p90", 90.0), ("p99", 99.0))
LINE_STATS = (("median", "p50", "-"), ("p90", "p90", "--"), ("p99", "p99", ":"))

Run = dict[str, Any]


GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """vLLM's `--goodput ttft:500 tpot:50 e2el:2000` (milliseconds) -> {"ttft": 500.0, ...}."""
    if not items:
        return None
    slos: dict[str, float] = {}
    for item in items:
        key, _, value = item.partition(":")
        ms = -1.0
        with contextlib.suppress(ValueError):
            ms = float(value)
        if key not in GOODPUT_KEYS or not ms >= 0:  # `not >=`: NaN too
            raise ValueError(f"--goodput: '{item}' is not KEY:MS with KEY in {', '.join(GOODPUT_KEYS)} and MS >= 0")
        slos[key] = ms
    return slos


def parse_concurrency(text: str | None) -> list[int | None]:
    """`--max-concurrency`: one value or a comma list to sweep; None means unbounded."""
    if text is None or not text.strip():
        return [None]
    try:
        nums = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--max-concurrency: '{text}' is not an integer or a comma list of them") from None
    if min(nums) < 1:
        raise ValueError("--max-concurrency values must be >= 1")
    return [*nums]


def latency_samples_ms(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Per successful request (ITL: per chunk) samples of each latency aggregate, in ms."""
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft_s * 1e3 for r in ok],
        "tpot": [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None],
        "itl": [x * 1e3 for r in ok for x in r.itl_s],
        "e2el": [r.e2el_s * 1e3 for r in ok],
    }


def _peak_concurrency(records: list[RequestRecord]) -> int:
    events = sorted(e for r in records if r.e2el_s > 0 for e in ((r.start_s, 1), (r.start_s + r.e2el_s, -1)))
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return peak


def compute_aggregates(
    records: list[RequestRecord], duration_s: float, slos: dict[str, float] | None = None
) -> dict[str, float | int | None]:
    """vLLM's result keys: throughputs per second of `duration_s`; latencies in ms (np.percentile)."""
    ok = [r for r in records if r.success]
    dur = max(duration_s, 1e-9)
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    got = [{"ttft": r.ttft_s * 1e3, "tpot": (r.tpot_s or 0.0) * 1e3, "e2el": r.e2el_s * 1e3} for r in ok]
    agg: dict[str, float | int | None] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "request_goodput": sum(all(ms[k] <= v for k, v in slos.items()) for ms in got) / dur if slos else None,
        "max_concurrent_requests": _peak_concurrency(records),
    }
    for key, values in latency_samples_ms(records).items():
        arr = np.asarray(values, dtype=np.float64)
        for stat, pct in PERCENTILES:
            value = (float(arr.mean()) if pct is None else float(np.percentile(arr, pct))) if arr.size else 0.0
            agg[f"{stat}_{key}_ms"] = value
    return agg


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `specserve bench` (named as `vllm bench serve`'s); every help ends with its default."""

    def a(*flags: str, **kw: Any) -> None:
        text = kw.get("help", "")
        kw["help"] = text if "default" in text else f"{text} (default: %(default)s)".strip()
        parser.add_argument(*flags, **kw)

    a("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    a("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    a("--model", default=None, help="model name to send (default: the first of /v1/models)")
    a("--dataset-name", choices=("random", "humaneval", "jsonl"), default="random")
    a("--dataset-path", default=None, help='jsonl: the file (one {"prompt", "output_len"?} a line)')
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]")
    a("--output-len", type=int, default=None, help="max tokens for humaneval/jsonl (default: 128)")
    a("--num-prompts", type=int, default=1000, help="requests per concurrency point, each point fresh prompts")
    a("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals; inf: all at once")
    a("--max-concurrency", default=None, help="in-flight limit: one value, or a comma list to sweep")
    a("--result-dir", default="bench_results")
    a("--result-filename", default=None, help="JSON name (default from endpoint, model, time)")
    a("--seed", type=int, default=0)
    eos_help = "send ignore_eos (default: on for random, so output lengths are as asked)"
    a("--ignore-eos", action=argparse.BooleanOptionalAction, default=None, help=eos_help)
    a("--temperature", type=float, default=0.0)
    a("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    a("--api-key", default=None, help="Bearer key to send (default: $SPECSERVE_API_KEY)")
    a("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    a("--max-duration", type=float, default=None, help="seconds one run may take; later requests fail")
    a("--disable-tqdm", action="store_true")


def config_json(args: argparse.Namespace, model: str, ignore_eos: bool, token_count: str) -> dict[str, Any]:
    keys = "base_url endpoint dataset_name dataset_path random_input_len random_output_len random_range_ratio"
    keys += " output_len num_prompts request_rate seed temperature goodput"
    cfg = {k: getattr(args, k) for k in keys.split()}
    cfg["request_rate"] = str(args.request_rate) if args.request_rate == float("inf") else args.request_rate
    return {
        **cfg,
        "model": model,
        "ignore_eos": ignore_eos,
        "max_concurrency": parse_concurrency(args.max_concurrency),
        "prompt_token_count": token_count,
        "date": time.strftime("%Y%m%d-%H%M%S"),
    }


def write_outputs(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = result["config"]
    kind = "chat" if cfg["endpoint"].rstrip("/").endswith("chat/completions") else "completions"
    name = args.result_filename or f"specserve-bench-{kind}-{cfg['model'].replace('/', '_')}-{cfg['date']}.json"
    path = out_dir / name
    path.write_text(json.dumps(result, indent=1))
    print(f"Results: {path}", flush=True)
    try:  # without matplotlib only the figure is missing
        title = f"{cfg['model']} {cfg['endpoint']} ({cfg['dataset_name']})"
        print(f"Plot: {plot_sweep(result['runs'], path.with_suffix('.png'), title)}")
    except ImportError as e:
        print(f"Plots skipped ({e}): pip install matplotlib (or 'specserve[bench]') to draw them.")
    return path


def format_table(agg: dict[str, Any], max_concurrency: int | None) -> str:
    """The result table in `vllm bench serve`'s layout."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "<10.2f") -> None:
        lines.append(f"{label:<40} {value:{fmt}}")

    row("Successful requests:", agg["completed"], "<10")
    row("Failed requests:", agg["failed"], "<10")
    row("Maximum request concurrency:", str(max_concurrency), "<10")
    row("Benchmark duration (s):", agg["duration"])
    row("Total input tokens:", agg["total_input_tokens"], "<10")
    row("Total generated tokens:", agg["total_output_tokens"], "<10")
    row("Request throughput (req/s):", agg["request_throughput"])
    if agg.get("request_goodput") is not None:
        row("Request goodput (req/s):", agg["request_goodput"])
    row("Output token throughput (tok/s):", agg["output_throughput"])
    row("Peak concurrent requests:", agg["max_concurrent_requests"], "<10")
    row("Total Token throughput (tok/s):", agg["total_token_throughput"])
    for key, title, short in METRICS:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat, _ in PERCENTILES:
            row(f"{stat.capitalize()} {short} (ms):", agg[f"{stat}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def format_sweep(runs: list[Run]) -> str:
    """One line per concurrency value of a sweep."""
    head = (
        f"{'concurrency':>11} {'req/s':>8} {'out tok/s':>10} {'p50 TTFT':>9} {'p99 TTFT':>9} "
        f"{'p50 TPOT':>9} {'p99 TPOT':>9} {'p99 E2EL':>9} {'failed':>6}"
    )
    lines = ["Concurrency sweep (latencies in ms)", head]
    for run in runs:
        a = run["aggregates"]
        lines.append(
            f"{run['max_concurrency']!s:>11} {a['request_throughput']:>8.2f} "
            f"{a['output_throughput']:>10.1f} {a['median_ttft_ms']:>9.1f} {a['p99_ttft_ms']:>9.1f} "
            f"{a['median_tpot_ms']:>9.2f} {a['p99_tpot_ms']:>9.2f} {a['p99_e2el_ms']:>9.1f} "
            f"{a['failed']:>6}"
        )
    return "\n".join(lines)


def sweep_series(runs: list[Run]) -> dict[str, list[float]]:
    """The points a sweep plot draws: x = "max_concurrency", y = one list per aggregate key."""

    def x_of(run: Run) -> float:  # unbounded: the number of requests it sent
        agg = run["aggregates"]
        return float(run["max_concurrency"] or agg["completed"] + agg["failed"])

    ordered = sorted(runs, key=x_of)
    latencies = [f"{s}_{m}_ms" for m, _, _ in METRICS for s, _, _ in LINE_STATS]
    series = {
        k: [float(r["aggregates"][k]) for r in ordered] for k in ["request_throughput", "output_throughput", *latencies]
    }
    return {"max_concurrency": [x_of(r) for r in ordered], **series}


def plot_sweep(runs: list[Run], path: Path, title: str) -> Path:
    """Throughput and latency percentiles (p50/p90/p99) against concurrency, one point per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = sweep_series(runs)
    xs = s["max_concurrency"]
    panels = [("output tokens/s", ["output_throughput"]), ("requests/s", ["request_throughput"])]
    panels += [(f"{short} (ms)", [f"{stat}_{m}_ms" for stat, _, _ in LINE_STATS]) for m, _, short in METRICS]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (ylabel, keys) in zip(axes.flat, panels):
        for key, (_, stat, style) in zip(keys, LINE_STATS):
            ax.plot(xs, s[key], "o" + style, color="C0", label=stat if len(keys) > 1 else None)
        if len(keys) > 1:
            ax.legend(fontsize=8)
        if min(xs) > 0 and max(xs) / min(xs) >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
