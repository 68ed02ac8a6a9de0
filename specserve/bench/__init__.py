"""Client-side tools: `specserve bench` (serving benchmark) and `specserve advise` (metrics advisor)."""

from specserve.bench.advise import add_advise_args, advise_main
from specserve.bench.serving import add_bench_args, bench_main

__all__ = ["add_advise_args", "add_bench_args", "advise_main", "bench_main"]
