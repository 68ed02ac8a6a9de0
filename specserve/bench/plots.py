"""Benchmark results as vLLM-style text tables and matplotlib PNGs (matplotlib imported on use).
A result is {"config": {...}, "runs": [{"max_concurrency", "aggregates", "requests"}, ...]}."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

METRICS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)
PERCENTILES = (("mean", None), ("median", 50.0), ("p90", 90.0), ("p99", 99.0))
STAT_LABELS = {"mean": "Mean", "median": "Median", "p90": "P90", "p99": "P99"}
LINE_STATS = (("median", "p50", "-"), ("p90", "p90", "--"), ("p99", "p99", ":"))

Run = dict[str, Any]


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
            row(f"{STAT_LABELS[stat]} {short} (ms):", agg[f"{stat}_{key}_ms"])
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


def _x_of(run: Run) -> float:
    """A run's concurrency on a plot axis; unbounded: the number of requests it sent."""
    if run["max_concurrency"] is not None:
        return float(run["max_concurrency"])
    return float(run["aggregates"]["completed"] + run["aggregates"]["failed"])


def sweep_series(runs: list[Run]) -> dict[str, list[float]]:
    """The points a sweep plot draws: x = "max_concurrency", y = one list per aggregate key."""
    ordered = sorted(runs, key=_x_of)
    series: dict[str, list[float]] = {"max_concurrency": [_x_of(r) for r in ordered]}
    keys = ["request_throughput", "output_throughput"] + [
        f"{s}_{m}_ms" for m, _, _ in METRICS for s, _, _ in LINE_STATS
    ]
    for key in keys:
        series[key] = [float(r["aggregates"][key]) for r in ordered]
    return series


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _concurrency_axis(ax: Any, xs: list[float]) -> None:
    if xs and min(xs) > 0 and max(xs) / min(xs) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("max concurrency")
    ax.grid(True, alpha=0.3)


def _plot_over_concurrency(results: list[tuple[str, list[Run]]], path: Path, title: str) -> Path:
    """Throughput and latency percentiles (p50/p90/p99) against concurrency, one colour per result."""
    plt = _pyplot()
    series = [(label, sweep_series(runs)) for label, runs in results]
    panels = [("output tokens/s", ["output_throughput"]), ("requests/s", ["request_throughput"])]
    panels += [(f"{short} (ms)", [f"{stat}_{m}_ms" for stat, _, _ in LINE_STATS]) for m, _, short in METRICS]
    xs = sorted({x for _, s in series for x in s["max_concurrency"]})
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (ylabel, keys) in zip(axes.flat, panels):
        for j, (label, s) in enumerate(series):
            for key, (_, stat, style) in zip(keys, LINE_STATS):
                name = f"{label} {stat}" if len(keys) > 1 else label
                ax.plot(s["max_concurrency"], s[key], "o" + style, color=f"C{j}", label=name.strip() or None)
        if len(keys) > 1 or len(series) > 1:
            ax.legend(fontsize=8)
        _concurrency_axis(ax, xs)
        ax.set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_sweep(runs: list[Run], path: Path, title: str) -> Path:
    """Throughput and latency percentiles against concurrency, one point per run."""
    return _plot_over_concurrency([("", runs)], path, title)


def plot_run(run: Run, path: Path, title: str) -> Path:
    """Distributions (CDFs) of TTFT, TPOT, ITL and E2EL of one run, marked at p50 and p99."""
    from specserve.bench.report import latency_samples_ms
    from specserve.bench.serving import RequestRecord

    plt = _pyplot()
    records = [RequestRecord(**{k: v for k, v in r.items() if k != "tpot_s"}) for r in run["requests"]]
    samples = latency_samples_ms(records)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (metric, name, short) in zip(axes.flat, METRICS):
        values = np.sort(np.asarray(samples[metric]))
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size)
            for pct, style in ((50, "--"), (99, ":")):
                ax.axvline(float(np.percentile(values, pct)), linestyle=style, color="gray", label=f"p{pct}")
            ax.legend()
        ax.set_title(name)
        ax.set_xlabel(f"{short} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{title} (max concurrency {run['max_concurrency']})")
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_compare(
    current: dict[str, Any], baseline: dict[str, Any], path: Path, labels: tuple[str, str] = ("this run", "baseline")
) -> Path:
    """This result against a saved one over concurrency (unbounded runs at their number of requests)."""
    results = [(labels[0], current["runs"]), (labels[1], baseline["runs"])]
    return _plot_over_concurrency(results, path, f"{labels[0]} vs {labels[1]}")


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
