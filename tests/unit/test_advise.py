"""`specserve advise` on synthetic /metrics pages, one regime per test."""

from __future__ import annotations

import math

import pytest

from specserve.bench.advise import Advice, advise, regime, window_stats
from specserve.bench.metrics_parse import Histogram, parse_metrics

ITL_BOUNDS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.5)


def page(
    prefix: str = "specserve",
    running: float = 0,
    waiting: float = 0,
    kv: float = 0.0,
    preempt: float = 0,
    gen: float = 0,
    requests: float = 0,
    prefix_q: float = 0,
    prefix_h: float = 0,
    drafts: float = 0,
    draft_tokens: float = 0,
    accepted_pos: tuple[float, ...] = (),
    itl_counts: tuple[int, ...] = (),
    cache: dict[str, str] | None = None,
    kv_name: str = "kv_cache_usage_perc",
    itl_sum: float | None = None,
    spec_info: dict[str, str] | None = None,
    chosen_k: float | None = None,
) -> str:
    """A /metrics page in Prometheus text format with the given values (counters are totals)."""
    p = prefix + ":"
    lines = [
        f"# TYPE {p}num_requests_running gauge",
        f'{p}num_requests_running{{model_name="m"}} {running}',
        f"# TYPE {p}num_requests_waiting gauge",
        f'{p}num_requests_waiting{{model_name="m"}} {waiting}',
        f"# TYPE {p}{kv_name} gauge",
        f'{p}{kv_name}{{model_name="m"}} {kv}',
    ]
    counters = {
        "num_preemptions": preempt,
        "generation_tokens": gen,
        "request_success": requests,
        "prefix_cache_queries": prefix_q,
        "prefix_cache_hits": prefix_h,
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": sum(accepted_pos),
    }
    for name, value in counters.items():
        lines += [
            f"# TYPE {p}{name}_total counter",
            f'{p}{name}_total{{model_name="m"}} {value}',
            f'{p}{name}_created{{model_name="m"}} 1.7e9',
        ]
    if accepted_pos:
        lines.append(f"# TYPE {p}spec_decode_num_accepted_tokens_per_pos_total counter")
        lines += [
            f'{p}spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}'
            for i, v in enumerate(accepted_pos)
        ]
    if itl_counts:  # per-bucket (not cumulative) counts, one per bound plus +Inf
        lines.append(f"# TYPE {p}inter_token_latency_seconds histogram")
        cum = 0
        for bound, c in zip([*map(str, ITL_BOUNDS), "+Inf"], itl_counts):
            cum += c
            lines.append(f'{p}inter_token_latency_seconds_bucket{{le="{bound}"}} {cum}')
        total = cum * 0.01 if itl_sum is None else itl_sum
        lines += [f"{p}inter_token_latency_seconds_count {cum}", f"{p}inter_token_latency_seconds_sum {total}"]
    for name, info in (("cache_config_info", cache), ("spec_decode_config_info", spec_info)):
        if info:
            labels = ",".join(f'{k}="{v}"' for k, v in info.items())
            lines += [f"# TYPE {p}{name} gauge", f"{p}{name}{{{labels}}} 1.0"]
    if chosen_k is not None:
        lines += [f"# TYPE {p}spec_decode_chosen_num_tokens gauge", f"{p}spec_decode_chosen_num_tokens {chosen_k}"]
    return "\n".join(lines) + "\n"


def window(before: dict, after: dict, seconds: float = 10.0) -> list:
    """Two snapshots `seconds` apart; gauges come from `after` for both unless given in `before`."""
    gauges = {k: after[k] for k in ("running", "waiting", "kv") if k in after}
    return [parse_metrics(page(**{**gauges, **before}), 100.0), parse_metrics(page(**after), 100.0 + seconds)]


def titles(found: list[Advice]) -> list[str]:
    return [a.title for a in found]


def find(found: list[Advice], needle: str) -> Advice:
    hits = [a for a in found if needle in a.title]
    assert hits, f"no advice titled *{needle}* in {titles(found)}"
    return hits[0]


def test_idle_server() -> None:
    found = advise(window({}, {}))
    assert titles(found) == ["No load in the window"]
    assert found[0].severity == "info"


def test_low_concurrency_without_speculation_suggests_it() -> None:
    found = advise(
        window({"gen": 1000}, {"running": 2, "gen": 3000, "requests": 10, "itl_counts": (0, 90, 10, 0, 0, 0, 0)})
    )
    spec = find(found, "speculation may pay (its cost is unmeasured here)")  # one batch size: no step-cost slope
    assert spec.evidence["running_avg"] == 2 and spec.evidence["waiting_max"] == 0
    assert spec.evidence["generation_tokens_per_s"] == 200.0 and spec.evidence["step_ms_per_extra_request"] is None
    assert "ngram" in spec.action and "eagle3" in spec.action and "draft_model" in spec.action
    assert "costs about one step" not in spec.action
    assert not any("KV cache" in t for t in titles(found))


def steps(*phases: tuple[float, float]) -> list:
    """Snapshots 5 s apart; phase i: `running` requests, 100 ITL observations of `itl_s` each."""
    snaps, count, total = [parse_metrics(page(running=phases[0][0]), 0.0)], 0, 0.0
    for i, (running, itl_s) in enumerate(phases, 1):
        count, total = count + 100, total + 100 * itl_s
        snaps.append(
            parse_metrics(
                page(running=running, gen=count, requests=10 * i, itl_counts=(0, 0, 0, 0, count, 0, 0), itl_sum=total),
                5.0 * i,
            )
        )
    return snaps


def test_step_cost_is_judged_from_measured_itl() -> None:
    """A CPU whose ITL rose from 85 ms with one request to 140 ms with three: each extra token in a
    step costs ~32% of a step, not "about nothing"; a GPU's 10 -> 10.4 ms makes drafting cheap."""
    cpu = find(advise(steps((1, 0.085), (1, 0.085), (3, 0.140), (3, 0.140))), "Low concurrency")
    assert cpu.evidence["step_ms_1_request"] == pytest.approx(85.0, abs=1.0)
    assert cpu.evidence["step_ms_per_extra_request"] == pytest.approx(27.5, abs=1.0)
    assert "32%" in cpu.action and cpu.severity == "low"
    dear = find(advise(steps((1, 0.085), (3, 0.300), (3, 0.300))), "Low concurrency")
    assert "unlikely to pay" in dear.title
    gpu = find(advise(steps((1, 0.010), (1, 0.010), (3, 0.0104), (3, 0.0104))), "Low concurrency")
    assert "turn speculation on" in gpu.title and gpu.severity == "medium"


def test_configured_k_and_the_controllers_choices_come_from_metrics() -> None:
    """Configured with k=4; the adaptive controller drafted 3 on average: advise says k=4."""
    info = {"method": "ngram", "num_speculative_tokens": "4", "adaptive": "True"}
    before = {"spec_info": info, "chosen_k": 2}
    after = {
        "running": 1,
        "gen": 900,
        "requests": 20,
        "drafts": 200,
        "draft_tokens": 600,
        "spec_info": info,
        "accepted_pos": (160, 120, 50, 10),
        "chosen_k": 4,
    }
    k = find(advise(window(before, after)), "well sized")
    assert k.title.endswith("(k=4)") and k.evidence["num_speculative_tokens"] == 4
    assert k.evidence["mean_drafted_per_draft"] == 3.0 and k.evidence["chosen_k_mean"] == 3.0
    assert "lower bounds" in k.action


def test_prefix_hit_rate_is_no_reason_for_ngram() -> None:
    """A benchmark that repeats its prompts makes the prefix cache hit; n-gram needs outputs that copy
    their prompts, which the hit rate does not show."""
    found = advise(window({}, {"running": 2, "gen": 3000, "requests": 20, "prefix_q": 1e5, "prefix_h": 9e4}))
    spec = find(found, "Low concurrency")
    assert "hit rate" not in spec.action and "prefix_hit_rate" not in spec.evidence


def test_thin_evidence_is_said() -> None:
    found = advise(
        [parse_metrics(page(running=1, gen=40, requests=2, drafts=10, draft_tokens=30, accepted_pos=(8, 5, 1)), 0.0)]
    )
    thin = find(found, "Thin evidence")
    assert "one snapshot" in thin.action and "requests finished" in thin.action
    assert find(found, "Too few drafts").severity == "info"
    assert not any("Draft fewer" in t or "Draft more" in t for t in titles(found))


def test_low_concurrency_too_many_draft_positions() -> None:
    before = {"drafts": 100, "draft_tokens": 500, "accepted_pos": (50, 40, 20, 5, 2)}
    after = {"running": 3, "gen": 500, "drafts": 200, "draft_tokens": 1000, "accepted_pos": (130, 100, 55, 15, 7)}
    found = advise(window(before, after))
    k = find(found, "Draft fewer tokens")
    assert k.title.endswith("5 -> 3")
    assert k.evidence["acceptance_pos_0"] == 0.8 and k.evidence["acceptance_pos_2"] == 0.35
    assert k.evidence["acceptance_pos_3"] == 0.1 and k.evidence["mean_acceptance_length"] == 2.9
    assert '"num_speculative_tokens": 3' in k.action
    assert not any("turn speculation on" in t for t in titles(found))  # it is already on


def test_speculation_draft_more_and_rejected() -> None:
    more = advise(window({}, {"running": 1, "gen": 100, "drafts": 100, "draft_tokens": 200, "accepted_pos": (90, 75)}))
    assert find(more, "Draft more tokens").title.endswith("2 -> 4")
    bad = advise(window({}, {"running": 1, "gen": 100, "drafts": 100, "draft_tokens": 300, "accepted_pos": (10, 2, 0)}))
    rejected = find(bad, "rarely pays")
    assert rejected.severity == "high" and rejected.evidence["acceptance_pos_0"] == 0.1
    assert bad[0] is rejected  # most severe first


@pytest.mark.parametrize("prefix,kv_name", [("specserve", "kv_cache_usage_perc"), ("vllm", "gpu_cache_usage_perc")])
def test_medium_concurrency_kv_pool_full(prefix: str, kv_name: str) -> None:
    cache = {"block_size": "16", "gpu_memory_utilization": "0.85", "num_gpu_blocks": "4096"}
    snaps = [
        parse_metrics(
            page(prefix, running=30, waiting=5, kv=0.95, preempt=3, gen=1e4, cache=cache, kv_name=kv_name), 0.0
        ),
        parse_metrics(
            page(prefix, running=28, waiting=7, kv=0.97, preempt=15, gen=2e4, cache=cache, kv_name=kv_name), 20.0
        ),
    ]
    assert regime(window_stats(snaps)) == "medium"
    found = advise(snaps)
    kv = find(found, "KV cache pool is the bottleneck")
    assert kv.severity == "high"
    assert kv.evidence["preemptions"] == 12 and kv.evidence["preemptions_per_s"] == 0.6
    assert kv.evidence["waiting_max"] == 7 and kv.evidence["kv_usage_max"] == 0.97
    assert kv.evidence["running_avg"] == 29 and kv.evidence["gpu_memory_utilization"] == "0.85"
    assert "--gpu-memory-utilization 0.90" in kv.action and "fp8" in kv.action
    assert not any("speculation" in t for t in titles(found))


def test_medium_concurrency_waiting_with_free_blocks_is_scheduler_bound() -> None:
    found = advise(window({}, {"running": 16, "waiting": 4, "kv": 0.4, "gen": 1000}))
    sched = find(found, "scheduler limits the batch")
    assert "--max-num-seqs" in sched.action and sched.evidence["kv_usage_max"] == 0.4


def test_high_concurrency_capacity_advice() -> None:
    after = {
        "running": 120,
        "waiting": 10,
        "kv": 0.98,
        "gen": 1e5,
        "drafts": 50,
        "draft_tokens": 150,
        "accepted_pos": (30, 20, 10),
        "cache": {"cache_dtype": "auto", "enable_prefix_caching": "True"},
    }
    found = advise(window({}, after))
    got = titles(found)
    assert regime(window_stats(window({}, after))) == "high"
    assert "High concurrency: store the KV cache as fp8" in got
    assert any("CPU offload tier" in t for t in got) and any("Scale out" in t for t in got)
    assert "--kv-offload-cpu-bytes" in find(found, "CPU offload tier").action
    assert any("speculation competes with batching" in t for t in got)
    fp8 = advise(window({}, {**after, "cache": {"cache_dtype": "fp8_e4m3"}}))
    assert "High concurrency: store the KV cache as nvfp4" in titles(fp8)


def test_low_prefix_hit_rate_suggests_prefix_aware_routing() -> None:
    found = advise(
        window({"prefix_q": 1e4, "prefix_h": 100}, {"running": 12, "gen": 1e4, "prefix_q": 1.1e5, "prefix_h": 2100})
    )
    pre = find(found, "Prefix cache hit rate is low")
    assert pre.evidence["prefix_hit_rate"] == 0.02 and pre.evidence["prefix_queried_tokens"] == 100000
    assert "prefix-cache-aware routing" in pre.action
    off = advise(window({}, {"running": 12, "gen": 10, "cache": {"enable_prefix_caching": "False"}}))
    assert "Prefix caching is off" in titles(off)


def test_latency_percentiles_from_histogram_deltas() -> None:
    snaps = window(
        {"itl_counts": (100, 0, 0, 0, 0, 0, 0)}, {"running": 4, "gen": 10, "itl_counts": (100, 50, 50, 0, 0, 0, 0)}
    )
    lat = find(advise(snaps), "Latency percentiles")
    # In the window: 50 in (5, 10] ms and 50 in (10, 20] ms -> p50 = 10 ms, p99 = 10 + 10 * 49/50 ms.
    assert lat.evidence["itl_p50_ms"] == 10.0 and lat.evidence["itl_p99_ms"] == 19.8
    assert lat.evidence["ttft_p99_ms"] is None


def test_histogram_quantile_and_single_snapshot() -> None:
    h = Histogram({0.1: 1.0, 1.0: 3.0, math.inf: 4.0}, 4.0, 3.0)
    assert h.quantile(0.25) == pytest.approx(0.1) and h.quantile(0.5) == pytest.approx(0.55)
    assert h.quantile(1.0) == 1.0 and Histogram({}, 0, 0).quantile(0.5) is None
    stats = window_stats([parse_metrics(page(running=5, gen=42, preempt=1), 0.0)])
    assert stats.seconds is None and stats.counters["generation_tokens"] == 42 and stats.rate("preemptions") is None
    with pytest.raises(ValueError):
        advise([])


def test_default_interval_samples_a_short_window_more_than_twice() -> None:
    from specserve.bench.advise import default_interval

    assert default_interval(5.0, None) == 0.5  # a 5 s window: 11 samples, not its two ends
    assert default_interval(30.0, None) == 3.0
    assert default_interval(600.0, None) == 5.0
    assert default_interval(5.0, 2.0) == 2.0  # --interval given
