"""Start-up checks of the configuration and the generated CLI: a clear error naming the field (or
flag) before anything loads, and `--help` that says each thing once. No model is loaded here."""

from __future__ import annotations

import argparse
import logging
import os
import re

import pytest

from specserve.config import CacheConfig, EngineConfig, OffloadConfig, SchedulerConfig, SpeculativeConfig
from specserve.runner.build import check_kv_capacity
from specserve.server import cli, cli_args


@pytest.fixture
def no_engine(monkeypatch):
    """`serve` must fail on its flags; should it get as far as building an engine, fail fast."""
    from specserve.engine.async_engine import AsyncEngine

    def refuse(*args, **kwargs):
        raise AssertionError("the configuration was accepted: serve went on to build the engine")

    monkeypatch.setattr(AsyncEngine, "from_config", refuse)


# ------------------------------------------------------------------------- speculative_config
@pytest.mark.parametrize(
    "spec, match",
    [
        ({"prompt_lookup_min": 0, "prompt_lookup_max": 0}, "prompt_lookup_min must be an integer >= 1"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
        ({"prompt_lookup_max": 0}, "prompt_lookup_max must be an integer >= 1"),
        ({"prompt_lookup_min": -1, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        (
            {"prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)",
        ),
        ({"prompt_lookup_min": True, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"prompt_lookup_max": 2.5}, "prompt_lookup_max"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
        ({"num_speculative_tokens": False}, "num_speculative_tokens must be an integer"),
        ({"draft_tensor_parallel_size": True}, "draft_tensor_parallel_size"),
        ({"disable_by_batch_size": True}, "disable_by_batch_size"),
        ({"max_model_len": True}, "max_model_len"),
        ({"num_speculative_tokens_per_batch_size": [[1, True, 3]]}, "num_speculative_tokens_per_batch_size"),
        ({"num_speculative_tokens_per_batch_size": [[1, 2]]}, "num_speculative_tokens_per_batch_size"),
        ({"num_speculative_tokens_per_batch_size": [[4, 2, 3]]}, "num_speculative_tokens_per_batch_size"),
        ({"num_speculative_tokens_per_batch_size": [3]}, "num_speculative_tokens_per_batch_size"),
        ({"adaptive": "false"}, "adaptive must be true or false"),
        ({"parallel_drafting": 1}, "parallel_drafting must be true or false"),
    ],
    ids=lambda v: str(v)[:50],
)
def test_bad_speculative_values_name_the_field(spec, match):
    cfg = {"method": "ngram", **spec}
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_any(cfg)
    # The path LLM(...) and the CLI take: refused before any model is looked for.
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(model="/nonexistent/model", speculative_config=cfg)


@pytest.mark.parametrize(
    "spec",
    [
        {"prompt_lookup_min": 1, "prompt_lookup_max": 1},
        {"prompt_lookup_min": 2, "prompt_lookup_max": 4},
        {"prompt_lookup_min": 3},
        {"prompt_lookup_max": 5},
        {"num_speculative_tokens": 1, "draft_tensor_parallel_size": 1},
        {"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 0]], "adaptive": False},
    ],
    ids=lambda v: str(v)[:50],
)
def test_good_speculative_values_pass(spec):
    assert SpeculativeConfig.from_any({"method": "ngram", **spec}).method == "ngram"


# ------------------------------------------------------------------------------ disk tier
def test_disk_path_without_size_is_refused(tmp_path):
    path = tmp_path / "kv"
    with pytest.raises(ValueError, match="kv_offload_disk_path.*kv_offload_disk_bytes"):
        OffloadConfig(disk_path=str(path))
    with pytest.raises(ValueError, match="--kv-offload-disk-path.*--kv-offload-disk-bytes"):
        EngineConfig.from_kwargs(kv_offload={"disk_path": str(path)})
    with pytest.raises(ValueError, match="needs kv_offload_disk_path"):
        OffloadConfig(disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_offload_cpu_bytes"):
        OffloadConfig(cpu_bytes=-1)
    assert not path.exists()


def test_disk_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "x"
    f.write_text("")
    with pytest.raises(ValueError, match="kv_offload_disk_path.*exists and is not a directory"):
        OffloadConfig(disk_path=str(f), disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_offload_disk_path.*'.*x' is not a directory"):
        OffloadConfig(disk_path=str(f / "sub" / "kv"), disk_bytes=1 << 20)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_disk_path_that_cannot_be_created_is_refused():
    with pytest.raises(ValueError, match="kv_offload_disk_path.*'/proc/nope' cannot be created"):
        OffloadConfig(disk_path="/proc/nope", disk_bytes=1 << 20)


def test_good_disk_paths_pass_and_the_check_leaves_nothing(tmp_path):
    assert OffloadConfig(disk_path=str(tmp_path), disk_bytes=1 << 20).enabled
    new = tmp_path / "a" / "b"
    assert OffloadConfig(disk_path=str(new), disk_bytes=1 << 20).enabled
    assert os.listdir(tmp_path) == []  # the writability probe is gone; the tier makes its own dir


@pytest.mark.parametrize(
    "make_arg, match",
    [
        (lambda tmp: ["--kv-offload-disk-path", str(tmp / "kv")], "--kv-offload-disk-bytes"),
        (
            lambda tmp: ["--kv-offload-disk-path", str(tmp / "file"), "--kv-offload-disk-bytes", "1G"],
            "--kv-offload-disk-path.*exists and is not a directory",
        ),
        (
            lambda tmp: ["--kv-offload-disk-path", str(tmp / "file" / "kv"), "--kv-offload-disk-bytes", "1G"],
            "--kv-offload-disk-path.*cannot be created",
        ),
    ],
    ids=["no-size", "file", "parent-file"],
)
def test_serve_disk_flag_errors_name_the_flag(tmp_path, capsys, no_engine, make_arg, match):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *make_arg(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Errno" not in err
    assert re.search(match, err), err


# ------------------------------------------------------------ max_num_batched_tokens vs length
def test_token_budget_below_max_model_len_without_chunked_prefill_is_refused(capsys, no_engine):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\).*max_model_len \(64\)"):
        EngineConfig.from_kwargs(max_num_batched_tokens=4, enable_chunked_prefill=False, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens.*max_model_len"):
        SchedulerConfig(max_num_batched_tokens=4, enable_chunked_prefill=False).check_max_model_len(8192)
    # Allowed: chunked prefill on, a budget that covers the context, or the default budget.
    EngineConfig.from_kwargs(max_num_batched_tokens=4, max_model_len=64)
    EngineConfig.from_kwargs(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=64)
    EngineConfig.from_kwargs(enable_chunked_prefill=False, max_model_len=64)
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--max-num-batched-tokens", "4", "--no-enable-chunked-prefill", "--max-model-len", "64"])
    assert e.value.code == 2 and "max_num_batched_tokens (4)" in capsys.readouterr().err


# ----------------------------------------------------------------------- KV pool vs length
def test_kv_capacity_check_names_budget_and_length(caplog):
    cache = CacheConfig(kv_cache_memory_bytes=3 << 20)
    with pytest.raises(
        ValueError,
        match=r"holds 64 tokens.*max_model_len is 8192.*kv_cache_memory_bytes "
        r"\(3145728\) to at least 12582912",
    ):
        check_kv_capacity(4, 24576, 8192, cache, strict=True)
    with pytest.raises(ValueError, match=r"max_model_len to at most 64 or raise gpu_memory_utilization \(0\.9\)"):
        check_kv_capacity(4, 1024, 8192, CacheConfig(), strict=True)
    with caplog.at_level(logging.WARNING, logger="specserve.runner.build"):
        check_kv_capacity(4, 1024, 8192, cache, strict=False)
    assert "max_model_len is 8192" in caplog.text
    check_kv_capacity(512, 1024, 8192, cache, strict=True)  # exactly one full sequence fits


# -------------------------------------------------------------------------------------- help
def _parser(*adders) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    for add in adders:
        add(parser)
    return parser


def test_help_states_each_default_once():
    parser = _parser(cli_args.add_engine_args, cli_args.add_server_args)
    for action in parser._actions:
        assert (action.help or "").lower().count("default") <= 1, action.help
    text = parser.format_help()
    assert "512 CPU) (default" not in text.replace("\n", " ")


def _help_of(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_server_only_flags_are_for_serve_only(capsys):
    for command in ("generate", "chat"):
        text = _help_of(capsys, command)
        assert "--served-model-name" not in text and "--max-num-queued-requests" not in text
        assert "--max-model-len" in text
    text = _help_of(capsys, "serve")
    assert "--served-model-name" in text and "--max-num-queued-requests" in text
    args = _parser(cli_args.add_engine_args, cli_args.add_server_args).parse_args(
        ["--served-model-name", "m", "--max-num-queued-requests", "3"]
    )
    config = EngineConfig.from_kwargs(**cli_args.engine_kwargs(args))
    assert config.model.served_model_name == "m" and config.scheduler.max_num_queued_requests == 3
    with pytest.raises(SystemExit):
        _parser(cli_args.add_engine_args).parse_args(["--served-model-name", "m"])


def test_engine_start_checks_the_kv_pool_and_the_token_budget(tiny_llama_dir, caplog):
    """Wired into engine start-up (engine/setup.py), where the model's max_model_len is known: a pool
    below a max_model_len the user chose is an error, below the model's default a warning; a token
    budget below the model's max_model_len with chunked prefill off is an error."""
    from specserve import LLM

    model = str(tiny_llama_dir)
    with pytest.raises(ValueError, match="max_model_len is 512"):
        LLM(model=model, progress=False, kv_cache_memory_bytes=60_000, max_model_len=512)
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=model, progress=False, kv_cache_memory_bytes=60_000)
    assert any("does not fit" in r.getMessage() for r in caplog.records)
    assert llm.engine.max_model_len > llm.engine.kv.num_blocks * llm.engine.kv.block_size
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) is smaller than max_model_len"):
        LLM(
            model=model,
            progress=False,
            kv_cache_memory_bytes=4 << 20,
            max_num_batched_tokens=4,
            enable_chunked_prefill=False,
        )


def test_offload_settings_as_flat_keywords_or_a_dict(tmp_path):
    """LLM(kv_offload_cpu_bytes=...) as the CLI flags are named, or kv_offload={...}; unknown names
    are a ValueError naming them (found by an independent check: flat names were refused, a mistyped
    dict key was a TypeError)."""
    flat = EngineConfig.from_kwargs(
        kv_offload_cpu_bytes=1 << 20, kv_offload_disk_path=str(tmp_path / "d"), kv_offload_disk_bytes=1 << 20
    )
    nested = EngineConfig.from_kwargs(
        kv_offload={"cpu_bytes": 1 << 20, "disk_path": str(tmp_path / "d"), "disk_bytes": 1 << 20}
    )
    assert flat.offload == nested.offload and flat.offload.enabled
    with pytest.raises(ValueError, match="cpu_byte"):
        EngineConfig.from_kwargs(kv_offload={"cpu_byte": 1})
    with pytest.raises(ValueError, match="kv_offload_cpu_byte"):
        EngineConfig.from_kwargs(kv_offload_cpu_byte=1)
