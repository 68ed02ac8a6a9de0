"""CLI flags generated from the config dataclasses (field `a_b` -> `--a-b`, vLLM's names). Flags default
to argparse.SUPPRESS, so only what the user typed reaches `EngineConfig.from_kwargs`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve import config as cfg
from specserve import envs
from specserve.config import field_help
from specserve.sampling_params import SamplingParams

_CHOICES = {"dtype": cfg.DTYPES, "kv_cache_dtype": cfg.KV_CACHE_DTYPES, "load_format": cfg.LOAD_FORMATS}
_CHOICES["metrics_prefix"] = METRICS_PREFIXES = ("specserve", "vllm")
_ENGINE_SECTIONS = (cfg.ModelConfig, cfg.CacheConfig, cfg.SchedulerConfig, cfg.ParallelConfig)
# Engine fields only the HTTP server reads: flags of `serve`, not of `generate` / `chat`.
SERVER_ONLY_FIELDS = frozenset({"served_model_name", "max_num_queued_requests"})
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class ServerConfig:
    """HTTP server settings; flags are generated like the engine's."""

    host: str = field_help("address to bind", default="127.0.0.1")
    port: int = field_help("port to bind", default=8000)
    api_key: str | None = field_help(
        "require `Authorization: Bearer KEY` (/health and /metrics stay open); other local users see it in "
        "`ps`: prefer SPECSERVE_API_KEY or --api-key-file",
        default=None,
        repr=False,
    )
    api_key_file: str | None = field_help("read the API key from this file's first line", default=None)
    metrics_prefix: str = field_help(
        "metric name prefix: specserve | vllm (for dashboards built for vLLM)", default="specserve"
    )
    max_request_body_bytes: int = field_help("larger request bodies get 413 (accepts 512K, 16M, ...)", default=16 << 20)
    log_interval: float = field_help("seconds between stats log lines; 0 = off", default=10.0)
    graceful_shutdown_timeout: float = field_help("on SIGTERM, seconds in-flight requests may run", default=5.0)
    uvicorn_log_level: str = field_help("uvicorn log level", default="info")
    trust_request_chat_template: bool = field_help(
        "accept a chat_template sent with a chat request (vLLM's flag)", default=False
    )

    def __post_init__(self) -> None:
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix must be specserve or vllm, got {self.metrics_prefix!r}.")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}.")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1.")
        if self.log_interval < 0 or self.graceful_shutdown_timeout < 0:
            raise ValueError("log_interval and graceful_shutdown_timeout must be >= 0.")


def parse_size(text: str) -> int:
    """'4096', '512K', '16M', '2GiB' -> bytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 512K, 16M, 2G)")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


_FLAG_KINDS: dict[Any, dict[str, Any]] = {bool: {"action": argparse.BooleanOptionalAction}, int: {"type": int}}
_FLAG_KINDS |= {float: {"type": float}, str: {"type": str}, dict: {"type": _json_dict, "metavar": "JSON"}}


def _base_type(hint: Any) -> Any:
    """`int | None` -> int; anything else unchanged."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return typing.get_origin(hint) or hint


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any, dest: str) -> None:
    base = _base_type(hint)
    default = f.default if f.default is not dataclasses.MISSING else None
    help_ = f.metadata.get("help", "")
    if "default" not in help_.lower():  # some helps state their default in words
        help_ = f"{help_} (default: {default})".strip()
    if base not in _FLAG_KINDS:
        return  # tuples and other structures have no flag form
    kw: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_, **_FLAG_KINDS[base]}
    if base is int and dest.endswith("_bytes"):
        kw["type"] = parse_size
    group.add_argument("--" + dest.replace("_", "-"), choices=_CHOICES.get(dest), **kw)


def _add_dataclass(
    group: argparse._ArgumentGroup, cls: type, server_only: bool | None = False, prefix: str = ""
) -> None:
    """Flags of cls's fields; server_only: just SERVER_ONLY_FIELDS (True), all but them (False), all (None)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if server_only is None or (f.name in SERVER_ONLY_FIELDS) == server_only:
            _add_field(group, f, hints[f.name], prefix + f.name)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags; MODEL is an optional positional (and --model) defaulting to the catalog default."""
    model_help = f"catalog name, model dir, .gguf file or HF id (default: {cfg.DEFAULT_MODEL})"
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None, help=model_help)
    group = parser.add_argument_group("engine")
    for cls in _ENGINE_SECTIONS:
        _add_dataclass(group, cls)
    _add_dataclass(group, cfg.OffloadConfig, None, prefix="kv_offload_")
    spec_help = 'e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\''
    group.add_argument("--speculative-config", default=argparse.SUPPRESS, metavar="JSON", help=spec_help)
    group.add_argument("--device", default=argparse.SUPPRESS, help="auto | cpu | cuda | cuda:N (default: auto)")
    threads_help = "torch CPU threads (default: the usable CPU cores minus one, at most what torch picks)"
    group.add_argument("--num-threads", type=int, default=None, help=threads_help)


def available_cpus() -> int:
    """CPU cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota (containers)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    return max(1, n)


def choose_num_threads(requested: int | None, available: int, torch_default: int) -> int:
    """torch's intra-op threads: the process's cores minus one (for the engine and HTTP threads,
    which would otherwise preempt torch's spinning workers), at most torch's default."""
    if requested is not None and requested < 1:
        raise ValueError(f"num_threads must be >= 1, got {requested}.")
    return requested or max(1, min(torch_default, available - 1))


def apply_num_threads(args: argparse.Namespace) -> int:
    """Set torch's thread count from --num-threads (or the default above); returns it."""
    import torch

    torch.set_num_threads(choose_num_threads(args.num_threads, available_cpus(), torch.get_num_threads()))
    return torch.get_num_threads()


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flat vLLM-style kwargs of `EngineConfig.from_kwargs` / `LLM(...)` the user gave."""
    values = dict(vars(args))
    model = values.pop("model_tag", None) or values.pop("model", None)
    names = {f.name for cls in _ENGINE_SECTIONS for f in dataclasses.fields(cls)} | {"speculative_config", "device"}
    kw: dict[str, Any] = ({"model": model} if model else {}) | {n: values[n] for n in names if n in values}
    fields = [f.name for f in dataclasses.fields(cfg.OffloadConfig)]
    if offload := {f: values[f"kv_offload_{f}"] for f in fields if f"kv_offload_{f}" in values}:
        kw["kv_offload"] = offload
    return kw


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Server flags, and the engine fields only the server reads (still passed by `engine_kwargs`)."""
    group = parser.add_argument_group("server")
    for cls in (ServerConfig, *_ENGINE_SECTIONS):
        _add_dataclass(group, cls, None if cls is ServerConfig else True)


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's data-parallel flags of `serve`; replicas run on Ray Serve (`specserve.ray`)."""
    group = parser.add_argument_group("data parallel")
    group.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas (default: 1)")
    ray_help = "ray: replicas as a Ray Serve application (pip install 'specserve[ray]')"
    group.add_argument("--data-parallel-backend", choices=("ray",), default=None, help=ray_help)
    group.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start one)")


def wants_data_parallel(args: argparse.Namespace) -> bool:
    """True when `serve` should run replicas on Ray; ValueError for sizes without a backend."""
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}.")
    if args.data_parallel_backend is None and (args.data_parallel_size > 1 or args.ray_address):
        raise ValueError("data_parallel_size > 1 and ray_address need --data-parallel-backend ray.")
    return args.data_parallel_backend == "ray"


def server_config(args: argparse.Namespace) -> ServerConfig:
    """ServerConfig from the flags; the API key from --api-key, else --api-key-file, else SPECSERVE_API_KEY."""
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if values.get("api_key") is None and values.get("api_key_file"):
        first = (Path(values["api_key_file"]).read_text(encoding="utf-8").splitlines() or [""])[0].strip()
        if not first:
            raise ValueError(f"api_key_file {values['api_key_file']} holds no key on its first line.")
        values["api_key"] = first
    values["api_key"] = values.get("api_key") or envs.api_key()
    return ServerConfig(**values)


_SAMPLING_FLAGS = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
_SAMPLING_FLAGS |= {"repetition_penalty": 1.0, "n": 1}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags of `generate` / `chat` (engine --seed seeds weights; --sampling-seed sampling)."""
    g = parser.add_argument_group("sampling")
    for name, default in _SAMPLING_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", type=int, default=None)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    names = [*_SAMPLING_FLAGS, "stop", "ignore_eos"]
    return SamplingParams(**{n: getattr(args, n) for n in names}, seed=args.sampling_seed)
