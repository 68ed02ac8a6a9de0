"""The periodic stats line, like vLLM's "Avg prompt throughput: ..."; throughputs are counter deltas
over the measured time since the last `maybe_log()`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from specserve.metrics.stats import StatsCollector

_COUNTERS = (
    "prompt_tokens_total generation_tokens_total prefix_cache_queries_total prefix_cache_hits_total "
    "num_preemptions_total spec_decode_num_draft_tokens_total spec_decode_num_accepted_tokens_total "
    "spec_decode_num_drafts_total"
).split()


class StatsLogger:
    def __init__(
        self, stats: StatsCollector, logger: logging.Logger | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stats = stats
        self.logger = logger or logging.getLogger("specserve.stats")
        self.clock = clock
        self._last_time = clock()
        self._last = self._read()
        self._was_idle = True

    def _read(self) -> dict[str, float]:
        return {name: self.stats.get(name) for name in _COUNTERS}

    def line(self) -> str | None:
        """The line for the interval since the last call; None when idle and already said so."""
        now, current = self.clock(), self._read()
        elapsed = max(now - self._last_time, 1e-9)
        delta = {k: current[k] - self._last[k] for k in current}
        self._last_time, self._last = now, current
        running = self.stats.get("num_requests_running")
        waiting = self.stats.get("num_requests_waiting")
        idle = not running and not waiting and not delta["prompt_tokens_total"] and not delta["generation_tokens_total"]
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        queries, hits = current["prefix_cache_queries_total"], current["prefix_cache_hits_total"]
        text = (
            f"Avg prompt throughput: {delta['prompt_tokens_total'] / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {delta['generation_tokens_total'] / elapsed:.1f} tokens/s, "
            f"Running: {running:.0f} reqs, Waiting: {waiting:.0f} reqs, "
            f"KV cache usage: {100 * self.stats.get('kv_cache_usage_perc'):.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        if delta["num_preemptions_total"]:
            text += f", Preemptions: {delta['num_preemptions_total']:.0f}"
        drafted = delta["spec_decode_num_draft_tokens_total"]
        if drafted:
            accepted = delta["spec_decode_num_accepted_tokens_total"]
            drafts = max(delta["spec_decode_num_drafts_total"], 1.0)
            text += (
                f", Spec decode: acceptance rate {100 * accepted / drafted:.1f}%, "
                f"mean acceptance length {1 + accepted / drafts:.2f}"
            )
        return text

    def maybe_log(self) -> None:
        text = self.line()
        if text is not None:
            self.logger.info(text)
