"""Client-side tools: `specserve bench` (serving benchmark) and `specserve advise` (metrics advisor)."""

from specserve.bench.advise import Advice, add_advise_args, advise, advise_main
from specserve.bench.metrics_parse import MetricsSnapshot, parse_metrics
from specserve.bench.serving import add_bench_args, bench_main

__all__ = [
    "Advice",
    "MetricsSnapshot",
    "add_advise_args",
    "add_bench_args",
    "advise",
    "advise_main",
    "bench_main",
    "parse_metrics",
]
