"""A Prometheus `/metrics` page as a snapshot `advise` can diff; names lose their `specserve:` or
`vllm:` prefix, and accessors sum a name's series or group them by one label."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Series = list[tuple[dict[str, str], float]]


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts keyed by upper bound (math.inf last), with count and sum."""

    buckets: dict[float, float]
    count: float
    sum: float

    def minus(self, earlier: Histogram) -> Histogram:
        """Observations made between `earlier` and this one (both cumulative)."""
        buckets = {le: c - earlier.buckets.get(le, 0.0) for le, c in self.buckets.items()}
        return Histogram(buckets, self.count - earlier.count, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket, as PromQL's histogram_quantile; None if empty."""
        if self.count <= 0 or not self.buckets:
            return None
        bounds = sorted(self.buckets)
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le in bounds:
            cum = self.buckets[le]
            if cum >= rank:
                if math.isinf(le):  # in the overflow bucket: the best known is the last finite bound
                    return lower
                in_bucket = cum - below
                frac = (rank - below) / in_bucket if in_bucket > 0 else 1.0
                return lower + (le - lower) * frac
            lower, below = (le if not math.isinf(le) else lower), cum
        return lower


@dataclass
class MetricsSnapshot:
    """One scrape: sample name (prefix stripped) -> [(labels, value)], taken at `timestamp` (s)."""

    timestamp: float
    samples: dict[str, Series] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.samples

    def value(self, name: str) -> float:
        """Sum of the series of `name` (0 when none)."""
        return float(sum(v for _, v in self.samples.get(name, [])))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Values of `name` summed per value of one label, e.g. per draft `position`."""
        out: dict[str, float] = {}
        for lab, v in self.samples.get(name, []):
            if label in lab:
                out[lab[label]] = out.get(lab[label], 0.0) + v
        return out

    def labels_of(self, name: str) -> dict[str, str]:
        """Labels of the first series of `name` (for `*_info` metrics); empty when absent."""
        series = self.samples.get(name, [])
        return dict(series[0][0]) if series else {}

    def histogram(self, name: str) -> Histogram | None:
        """The histogram `name` (without `_bucket`), summed over its label sets; None if absent."""
        bucket_series = self.samples.get(name + "_bucket")
        if not bucket_series:
            return None
        buckets: dict[float, float] = {}
        for lab, v in bucket_series:
            le = float(lab.get("le", "+Inf").replace("+Inf", "inf"))
            buckets[le] = buckets.get(le, 0.0) + v
        return Histogram(buckets, self.value(name + "_count"), self.value(name + "_sum"))


def parse_metrics(text: str, timestamp: float) -> MetricsSnapshot:
    """Parse Prometheus text exposition format. Accepts `specserve:` and `vllm:` names alike."""
    snap = MetricsSnapshot(timestamp=timestamp)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):  # prometheus_client's creation timestamps
                continue
            name = sample.name.removeprefix("specserve:").removeprefix("vllm:")
            snap.samples.setdefault(name, []).append((dict(sample.labels), float(sample.value)))
    return snap
