"""The front door's routing (pure Python, no Ray) and its /metrics merge."""

from __future__ import annotations

import pytest

from specserve.bench.metrics_parse import parse_metrics
from specserve.kv.block_pool import hash_blocks
from specserve.ray.prom import merge_metrics
from specserve.ray.router import Router, routing_key


def test_routing_key_is_the_prefix_cache_hash_of_the_first_blocks():
    ids = list(range(100))
    assert routing_key(ids[:15], 16, 4) is None  # no full block: nothing to reuse
    assert routing_key(ids, 16, 4) == hash_blocks(None, ids[:64], 16)[-1]
    assert routing_key(ids[:40], 16, 4) == hash_blocks(None, ids[:32], 16)[-1]
    assert routing_key(ids, 16, 4) == routing_key(ids[:64] + [7] * 30, 16, 4)  # same prefix, same key


def test_same_key_same_replica_and_only_the_dead_ones_keys_move():
    router = Router(4, seed=0)
    keys = [routing_key(list(range(i, i + 64)), 16, 4) for i in range(200)]
    owners = [router.choose(k) for k in keys]
    assert owners == [router.choose(k) for k in keys]
    assert set(owners) == {0, 1, 2, 3}
    router.mark_down(2)
    moved = [router.choose(k) for k in keys]
    assert 2 not in moved
    assert all(a == b for a, b in zip(owners, moved) if a != 2)


def test_load_overrides_affinity_and_p2c_picks_the_less_loaded():
    router = Router(2, max_imbalance=4, seed=0)
    key = routing_key(list(range(64)), 16, 4)
    owner = router.choose(key)
    for _ in range(4):
        router.started(owner)
    assert router.choose(key) == 1 - owner  # 4 more outstanding than the other: overridden
    router.finished(owner)
    assert router.choose(key) == owner
    router.mark_up(owner, num_waiting=0, num_running=1, kv_usage=0.95)
    assert router.choose(key) == 1 - owner  # its KV cache is nearly full
    assert all(router.choose(None) == 1 - owner for _ in range(10))  # P2C of two: the less loaded


def test_round_robin_and_exclusions():
    router = Router(3, policy="round_robin")
    assert sorted(router.choose(None) for _ in range(3)) == [0, 1, 2]
    assert router.choose(None, exclude=[0, 1]) == 2
    assert router.choose(None, exclude=[0, 1, 2]) is None
    with pytest.raises(ValueError, match="policy"):
        Router(2, policy="random")


def test_merged_metrics_label_each_replica_and_parse():
    page = (
        "# HELP specserve:num_requests_waiting Waiting.\n# TYPE specserve:num_requests_waiting gauge\n"
        "specserve:num_requests_waiting 2.0\n"
        "# HELP specserve:request_success_total Done.\n# TYPE specserve:request_success_total counter\n"
        'specserve:request_success_total{finished_reason="stop"} 5.0\n'
    )
    merged = merge_metrics([("0", page), ("1", page.replace("2.0", "3.0"))])
    assert merged.count("# TYPE specserve:num_requests_waiting gauge") == 1
    snap = parse_metrics(merged, 0.0)
    assert snap.by_label("num_requests_waiting", "replica") == {"0": 2.0, "1": 3.0}
    assert snap.samples["request_success_total"] == [
        ({"finished_reason": "stop", "replica": "0"}, 5.0),
        ({"finished_reason": "stop", "replica": "1"}, 5.0),
    ]


def test_advise_reads_gauges_per_replica_on_a_merged_page():
    from specserve.bench.advise import window_stats

    page = (
        "# HELP specserve:kv_cache_usage_perc KV.\n# TYPE specserve:kv_cache_usage_perc gauge\n"
        "specserve:kv_cache_usage_perc {}\n"
    )
    merged = merge_metrics([("0", page.format(0.6)), ("1", page.format(0.7))])
    assert window_stats([parse_metrics(merged, 0.0)]).kv_usage_max == pytest.approx(0.7)  # not 1.3
