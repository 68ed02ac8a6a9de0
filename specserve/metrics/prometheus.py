"""Prometheus exposition of StatsCollector (the only module importing prometheus_client). Names are
vLLM's under `specserve:` (or `vllm:`); families never written still appear (0 or empty), so
dashboards see every series from the first scrape."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.core import Metric as PromMetric
from prometheus_client.registry import Collector

from specserve.metrics.stats import FAMILIES, Metric, StatsCollector

PREFIXES = ("specserve", "vllm")
# Families whose series only make sense with labels: no unlabeled zero placeholder for them.
_LABELED_ONLY = {"spec_decode_num_accepted_tokens_per_pos_total", "cache_config_info", "spec_decode_config_info"}
_BUCKETS = {name: buckets for name, _kind, _help, buckets in FAMILIES}


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


class PrometheusMetrics(Collector):
    """What /metrics serves: the stats through a registry of its own."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, stats: StatsCollector, prefix: str = "specserve") -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}.")
        self.stats, self.prefix = stats, prefix
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def describe(self) -> Iterable[PromMetric]:
        return []  # skip the registry's duplicate-name probe (it would call collect())

    def collect(self) -> Iterable[PromMetric]:
        series: dict[str, list[Metric]] = defaultdict(list)
        for metric in self.stats.snapshot():
            series[metric.name].append(metric)
        for name, kind, help_ in self.stats.families():
            family = self._family(f"{self.prefix}:{name}", name, kind, help_, series.get(name, []))
            if family is not None:
                yield family

    def _family(self, full: str, name: str, kind: str, help_: str, items: list[Metric]) -> PromMetric | None:
        if not items and name in _LABELED_ONLY:
            return None
        label_names = sorted({k for m in items for k in m.labels})

        def values(m: Metric) -> list[str]:
            return [m.labels.get(k, "") for k in label_names]

        if kind == "histogram":
            hist = HistogramMetricFamily(full, help_, labels=label_names)
            if not items:
                bounds = [*_BUCKETS.get(name, ()), float("inf")]
                hist.add_metric([], [(_bound(b), 0) for b in bounds], 0.0)
            for m in items:
                buckets = [(_bound(b), c) for b, c in sorted((m.buckets or {}).items())]
                hist.add_metric(values(m), buckets, m.sum)
            return hist
        # gauge and info (=1); CounterMetricFamily appends _total itself
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        fam = cls(full, help_, labels=label_names)
        if not items:
            fam.add_metric([], 0.0)
        for m in items:
            fam.add_metric(values(m), 1.0 if kind == "info" else m.value)
        return fam
