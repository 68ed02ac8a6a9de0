"""Engine statistics, the single source for LLM.get_metrics() and /metrics; names are vLLM's without
the prefix. Counters only grow; gauges are set each step; readers take a snapshot under the lock."""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass, field

# fmt: off
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# fmt: on
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

Labels = tuple[tuple[str, str], ...]


@dataclass
class Metric:
    """One series: `value` for counters and gauges; buckets/count/sum for histograms."""

    name: str
    kind: str  # counter | gauge | histogram | info
    help: str
    labels: dict[str, str]
    value: float = 0.0
    buckets: dict[float, int] | None = None  # upper bound -> cumulative count
    count: int = 0
    sum: float = 0.0


@dataclass
class _Family:
    name: str
    kind: str
    help: str
    buckets: tuple[float, ...] = ()
    values: dict[Labels, float] = field(default_factory=dict)
    hist: dict[Labels, list[int]] = field(default_factory=dict)  # per-bucket (not cumulative) counts
    sums: dict[Labels, float] = field(default_factory=dict)


FAMILIES: tuple[tuple[str, str, str, tuple[float, ...]], ...] = (
    ("num_requests_running", "gauge", "Number of requests in model execution batches.", ()),
    ("num_requests_waiting", "gauge", "Number of requests waiting to be processed.", ()),
    ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", ()),
    ("num_preemptions_total", "counter", "Cumulative number of preemptions.", ()),
    ("prompt_tokens_total", "counter", "Number of prefill tokens processed.", ()),
    ("generation_tokens_total", "counter", "Number of generation tokens processed.", ()),
    ("request_success_total", "counter", "Count of successfully processed requests.", ()),
    ("prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", ()),
    ("prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", ()),
    ("e2e_request_latency_seconds", "histogram", "End-to-end request latency in seconds.", LATENCY_BUCKETS),
    ("time_to_first_token_seconds", "histogram", "Time to first token in seconds.", LATENCY_BUCKETS),
    ("inter_token_latency_seconds", "histogram", "Inter-token latency in seconds.", ITL_BUCKETS),
    ("request_queue_time_seconds", "histogram", "Time spent waiting in the queue.", LATENCY_BUCKETS),
    ("request_prefill_time_seconds", "histogram", "Time spent in the prefill phase.", LATENCY_BUCKETS),
    ("request_decode_time_seconds", "histogram", "Time spent in the decode phase.", LATENCY_BUCKETS),
    ("request_prompt_tokens", "histogram", "Number of prefill tokens processed per request.", TOKEN_BUCKETS),
    ("request_generation_tokens", "histogram", "Number of generation tokens per request.", TOKEN_BUCKETS),
    ("spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", ()),
    ("spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", ()),
    ("spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.", ()),
    ("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted tokens per draft position.", ()),
    ("spec_decode_chosen_num_tokens", "gauge", "Draft length the speculation controller chose last step.", ()),
    ("kv_offload_queries_total", "counter", "Offload tier lookups (prefetch reads too), in tokens.", ()),
    ("kv_offload_hits_total", "counter", "Tokens loaded from an offload tier into a request's KV.", ()),
    ("kv_offload_bytes_total", "counter", "Bytes moved to or from an offload tier.", ()),
    ("kv_offload_errors_total", "counter", "Offload tier entries that failed to load (corrupt, foreign).", ()),
    ("cache_config_info", "info", "Information of the KV cache configuration.", ()),
    ("spec_decode_config_info", "info", "The speculative decoding configuration (k: the most a step drafts).", ()),
)


class StatsCollector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families = {name: _Family(name, kind, help_, buckets) for name, kind, help_, buckets in FAMILIES}

    @staticmethod
    def _key(labels: dict[str, str] | None) -> Labels:
        return tuple(sorted((k, str(v)) for k, v in (labels or {}).items()))

    def inc(self, name: str, amount: float = 1.0, labels: dict[str, str] | None = None) -> None:
        fam, key = self._families[name], self._key(labels)
        with self._lock:
            fam.values[key] = fam.values.get(key, 0.0) + amount

    def set(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        fam = self._families[name]
        with self._lock:
            fam.values[self._key(labels)] = float(value)

    def observe(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        self.observe_many(name, [value], labels)

    def observe_many(self, name: str, values: list[float], labels: dict[str, str] | None = None) -> None:
        if not values:
            return
        fam, key = self._families[name], self._key(labels)
        with self._lock:
            counts = fam.hist.setdefault(key, [0] * (len(fam.buckets) + 1))
            for value in values:
                counts[bisect.bisect_left(fam.buckets, value)] += 1
            fam.sums[key] = fam.sums.get(key, 0.0) + sum(values)

    def get(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Counter/gauge value (0 when never set); histogram observation count."""
        fam, key = self._families[name], self._key(labels)
        with self._lock:
            if fam.kind == "histogram":
                return float(sum(fam.hist.get(key, ())))
            return fam.values.get(key, 0.0)

    def snapshot(self) -> list[Metric]:
        out: list[Metric] = []
        with self._lock:
            for fam in self._families.values():
                head = (fam.name, fam.kind, fam.help)
                for key, counts in fam.hist.items():
                    cumulative = dict(zip((*fam.buckets, float("inf")), itertools.accumulate(counts)))
                    sum_ = fam.sums.get(key, 0.0)
                    out.append(Metric(*head, dict(key), buckets=cumulative, count=sum(counts), sum=sum_))
                if fam.kind != "histogram":
                    out.extend(Metric(*head, dict(key), value=value) for key, value in fam.values.items())
        return out

    def families(self) -> list[tuple[str, str, str]]:
        return [(f.name, f.kind, f.help) for f in self._families.values()]
