"""The `specserve` command line (flag generation, dispatch) and the metrics exporters; no model."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.config import EngineConfig
from specserve.metrics.log import StatsLogger
from specserve.metrics.prometheus import PrometheusMetrics
from specserve.metrics.stats import StatsCollector
from specserve.server import cli, cli_args


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli_args.add_engine_args(parser)
    cli_args.add_server_args(parser)
    return parser


def test_serve_flags_become_engine_and_server_config():
    args = _serve_parser().parse_args(
        [
            "some/model",
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "fp8",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "256",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes",
            "64M",
            "--gpu-memory-utilization",
            "0.5",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4}',
            "--tensor-parallel-size",
            "1",
            "--load-format",
            "dummy",
            "--seed",
            "3",
            "--device",
            "cpu",
            "--kv-offload-cpu-bytes",
            "1G",
            "--served-model-name",
            "m",
            "--max-num-queued-requests",
            "7",
            "--port",
            "9001",
            "--api-key",
            "k",
            "--metrics-prefix",
            "vllm",
            "--max-request-body-bytes",
            "1M",
            "--log-interval",
            "0",
        ]
    )
    config = EngineConfig.from_kwargs(**cli_args.engine_kwargs(args))
    assert config.model.model == "some/model" and config.model.dtype == "float32"
    assert config.cache.kv_cache_dtype == "fp8" and config.cache.block_size == 32
    assert config.cache.enable_prefix_caching is False and config.cache.kv_cache_memory_bytes == 64 << 20
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.max_num_queued_requests == 7
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 4
    assert config.offload.cpu_bytes == 1 << 30 and config.device == "cpu" and config.model.seed == 3
    server = cli_args.server_config(args)
    assert (server.port, server.api_key, server.metrics_prefix, server.max_request_body_bytes) == (
        9001,
        "k",
        "vllm",
        1 << 20,
    )


def test_unset_flags_keep_config_defaults():
    args = _serve_parser().parse_args([])
    assert cli_args.engine_kwargs(args) == {}
    assert EngineConfig.from_kwargs(**cli_args.engine_kwargs(args)) == EngineConfig()
    assert cli_args.server_config(args) == cli_args.ServerConfig()


def test_bad_flag_values_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--block-size", "3"])
    assert e.value.code == 2 and "block_size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--kv-cache-dtype", "int3"])
    assert e.value.code == 2


def test_dispatch_help_and_placeholders(capsys, monkeypatch):
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])
    capsys.readouterr()
    # train-draft is part of this build: its own help (not the "not available" path, which exits 1) ...
    assert cli.main(["train-draft", "--help"]) == 0
    out = capsys.readouterr().out
    assert "specserve train-draft" in out and "--method" in out and "p-eagle" in out
    # ... and its arguments reach specserve.train.loop.train_main, whose status is the command's.
    from specserve.train import loop as train

    seen = []
    monkeypatch.setattr(train, "train_main", lambda argv: seen.append(argv) or 7)
    assert cli.main(["train-draft", "--target", "t", "--method", "eagle3", "--out", "o"]) == 7
    assert seen == [["--target", "t", "--method", "eagle3", "--out", "o"]]


def test_prometheus_exposition_with_both_prefixes():
    stats = StatsCollector()
    stats.inc("prompt_tokens_total", 12)
    stats.observe("time_to_first_token_seconds", 0.02)
    stats.set("cache_config_info", 1, {"block_size": "16", "num_gpu_blocks": "100"})
    stats.inc("spec_decode_num_accepted_tokens_per_pos_total", 3, {"position": "0"})
    for prefix in ("specserve", "vllm"):
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(PrometheusMetrics(stats, prefix).render().decode())
            for s in fam.samples
        }
        assert samples[(f"{prefix}:prompt_tokens_total", ())] == 12
        assert samples[(f"{prefix}:num_requests_running", ())] == 0
        assert samples[(f"{prefix}:time_to_first_token_seconds_count", ())] == 1
        assert samples[(f"{prefix}:time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 1
        assert samples[(f"{prefix}:e2e_request_latency_seconds_count", ())] == 0
        assert samples[(f"{prefix}:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "100")))] == 1
        assert samples[(f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == 3
    with pytest.raises(ValueError):
        PrometheusMetrics(stats, "other")


def test_stats_log_line():
    now = [0.0]
    stats = StatsCollector()
    logger = StatsLogger(stats, clock=lambda: now[0])
    assert logger.line() is None  # idle: nothing to say
    stats.inc("prompt_tokens_total", 100)
    stats.inc("generation_tokens_total", 50)
    stats.inc("prefix_cache_queries_total", 100)
    stats.inc("prefix_cache_hits_total", 25)
    stats.set("num_requests_running", 3)
    stats.set("kv_cache_usage_perc", 0.125)
    now[0] = 10.0
    line = logger.line()
    assert "Avg prompt throughput: 10.0 tokens/s" in line and "Avg generation throughput: 5.0 tokens/s" in line
    assert "Running: 3 reqs" in line and "KV cache usage: 12.5%" in line and "Prefix cache hit rate: 25.0%" in line
