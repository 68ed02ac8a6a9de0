"""Frozen configuration dataclasses, validated in __post_init__; CLI flags are generated from the fields."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "nvfp4")
DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "dummy", "safetensors", "gguf")
SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")


def field_help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_choice(obj: Any, name: str, choices: tuple[str, ...], prefix: str = "") -> None:
    if getattr(obj, name) not in choices:
        raise ValueError(f"{prefix}{name} must be one of {choices}, got {getattr(obj, name)!r}.")


@dataclass(frozen=True)
class ModelConfig:
    model: str = field_help(
        "catalog name, HF model dir, .gguf file, or HF id in the local cache", default=DEFAULT_MODEL
    )
    dtype: str = field_help("weights and activations: auto (bfloat16 on GPU, float32 on CPU)", default="auto")
    max_model_len: int | None = field_help("context length (prompt + output); default: the model's", default=None)
    load_format: str = field_help(
        "auto | dummy (random weights of the real shape) | safetensors | gguf", default="auto"
    )
    seed: int = field_help("seed for dummy weights and unseeded sampling", default=0)
    tokenizer: str | None = field_help("tokenizer dir, if not the model's", default=None)
    served_model_name: str | None = field_help("name the API reports", default=None)
    hf_overrides: dict[str, Any] | None = field_help("JSON dict of config overrides (dummy shapes)", default=None)
    enforce_eager: bool = field_help("never use CUDA graphs", default=False)
    batch_invariant: bool = field_help(
        "batch-invariant matmul and attention: greedy output identical at any batch size, with or without "
        "speculation (docs/tuning.md)",
        default=False,
    )

    def __post_init__(self) -> None:
        _check_choice(self, "dtype", DTYPES)
        _check_choice(self, "load_format", LOAD_FORMATS)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field_help("tokens per KV block", default=16)
    kv_cache_dtype: str = field_help("auto | bfloat16 | float16 | float32 | fp8 | nvfp4", default="auto")
    gpu_memory_utilization: float = field_help("fraction of GPU memory the engine may use", default=0.9)
    kv_cache_memory_bytes: int | None = field_help(
        "KV pool size in bytes (any device); overrides utilization", default=None
    )
    enable_prefix_caching: bool = field_help("reuse KV blocks of identical prefixes", default=True)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}.")
        _check_choice(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field_help("most requests running at once", default=256)
    max_num_batched_tokens: int | None = field_help("token budget per step (default: 2048 GPU, 512 CPU)", default=None)
    enable_chunked_prefill: bool = field_help("split long prompts over steps", default=True)
    max_num_queued_requests: int | None = field_help(
        "requests waiting beyond the running batch (max_num_seqs) past which new ones get 503", default=None
    )
    async_scheduling: bool | None = field_help(
        "prepare the next step while the GPU runs this one; with speculation, the steps that draft "
        "nothing (default: on for CUDA without tensor parallelism)",
        default=None,
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")

    def check_max_model_len(self, max_model_len: int) -> None:
        """Without chunked prefill a prompt is prefilled in one step: the token budget must hold it (vLLM)."""
        n = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and n is not None and n < max_model_len:
            fix = "enable_chunked_prefill off: raise it, lower max_model_len, or enable chunked prefill."
            raise ValueError(f"max_num_batched_tokens ({n}) is smaller than max_model_len ({max_model_len}) with {fix}")


@dataclass(frozen=True)
class OffloadConfig:
    cpu_bytes: int = field_help("CPU tier for evicted KV blocks, bytes (0 = off; accepts 4G)", default=0)
    disk_path: str | None = field_help(
        "directory of the disk tier for evicted KV blocks (needs --kv-offload-disk-bytes)", default=None
    )
    disk_bytes: int = field_help("disk tier size, bytes (accepts 100G; needs --kv-offload-disk-path)", default=0)

    def __post_init__(self) -> None:
        cpu, disk, path = _OFFLOAD_FLAGS
        for name, value in ((cpu, self.cpu_bytes), (disk, self.disk_bytes)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        if self.disk_bytes > 0 and not self.disk_path:
            raise ValueError(f"{disk} > 0 needs {path}, the directory of the disk tier.")
        if self.disk_path is None:
            return
        if self.disk_bytes == 0:  # no default size: the tier fills a disk shared with weights and logs
            msg = f"{path} is set but {disk} is not: give the disk tier a size (e.g. 100G), or drop the path."
            raise ValueError(msg)
        _check_disk_dir(os.fspath(self.disk_path))

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or (self.disk_bytes > 0 and self.disk_path is not None)


_OFFLOAD_FLAGS = [
    f"kv_offload_{n} (--kv-offload-{n.replace('_', '-')})" for n in ("cpu_bytes", "disk_bytes", "disk_path")
]


def _check_disk_dir(path: str) -> None:
    """The disk tier's directory must be one, or be creatable: an error naming the flag, before anything loads."""
    name = _OFFLOAD_FLAGS[2]
    if not path.strip():
        raise ValueError(f"{name} must not be empty.")
    if os.path.lexists(path) and not os.path.exists(path):
        raise ValueError(f"{name} {path!r} is a broken symbolic link.")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{name} {path!r} exists and is not a directory.")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{name} {path!r} is not writable.")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{name} {path!r} cannot be created: {parent!r} is not a directory.")
    # Permission bits do not tell (root passes them; /proc refuses anyway): probe with a directory.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".specserve-probe-", dir=parent))
    except OSError as e:
        raise ValueError(f"{name} {path!r} cannot be created in {parent!r}: {e.strerror or e}.") from None


_SPEC_MINIMA = {"num_speculative_tokens": 1, "disable_by_batch_size": 2, "max_model_len": 2, "prompt_lookup_min": 1}
_SPEC_MINIMA.update(prompt_lookup_max=1, tree_branching=1, tree_node_budget=1)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    model: str | None = None
    num_speculative_tokens: int = 3
    parallel_drafting: bool = False
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    adaptive: bool = True
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    draft_tensor_parallel_size: int | None = None
    # vLLM's: no drafts while more than this many requests run (the controller or table decides below).
    disable_by_batch_size: int | None = None
    # vLLM's: no drafts for a request past this length (the draft model's window is cut to it too).
    max_model_len: int | None = None
    # Draft trees (speculative/tree.py): children per node and draft nodes per request (depth:
    # num_speculative_tokens), or vLLM's explicit tree of child-rank paths, e.g. "[(0,), (1,), (0, 0)]".
    tree_branching: int | None = None
    tree_node_budget: int | None = None
    speculative_token_tree: str | None = None

    def __post_init__(self) -> None:
        _check_choice(self, "method", SPEC_METHODS, "speculative_config.")
        for name, least in _SPEC_MINIMA.items():
            n = getattr(self, name)
            if (n is not None or name == "num_speculative_tokens") and (not _is_int(n) or n < least):
                raise ValueError(f"speculative_config.{name} must be an integer >= {least}, got {n!r}.")
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}.")
        for name in ("parallel_drafting", "adaptive"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"speculative_config.{name} must be true or false, got {value!r}.")
        if (n := self.draft_tensor_parallel_size) is not None and (not _is_int(n) or n != 1):
            msg = f"speculative_config.draft_tensor_parallel_size must be 1 (drafts run on rank 0), got {n!r}."
            raise ValueError(msg)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi}).")
        table = self.num_speculative_tokens_per_batch_size
        for row in () if table is None else table if isinstance(table, (list, tuple)) else [table]:
            ok = isinstance(row, (list, tuple)) and len(row) == 3 and all(_is_int(v) for v in row)
            if not ok or not 0 <= row[0] <= row[1] or row[2] < 0:
                what = "rows must be [min_batch, max_batch, k] integers with 0 <= min_batch <= max_batch and k >= 0"
                raise ValueError(f"speculative_config.num_speculative_tokens_per_batch_size {what}, got {row!r}.")

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict or a JSON object.")
        if unknown := set(value) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"speculative_config has unknown keys: {sorted(unknown)}.")
        if "method" not in value:
            raise ValueError("speculative_config.method is required.")
        table = value.get("num_speculative_tokens_per_batch_size")
        if isinstance(table, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in table):
            value = {**value, "num_speculative_tokens_per_batch_size": tuple(tuple(r) for r in table)}
        return cls(**value)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field_help("GPUs to shard the model over", default=1)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}.")
        if self.scheduler.async_scheduling and self.parallel.tensor_parallel_size > 1:
            raise ValueError("async_scheduling cannot be combined with tensor_parallel_size > 1.")
        if self.model.batch_invariant and self.parallel.tensor_parallel_size > 1:
            raise ValueError("batch_invariant needs tensor_parallel_size 1 (all-reduce order varies with size).")
        if self.model.max_model_len is not None:
            self.scheduler.check_max_model_len(self.model.max_model_len)

    @classmethod
    def from_kwargs(cls, **kw: Any) -> EngineConfig:
        """Build from flat vLLM-style keyword arguments (LLM(...) and the CLI)."""
        parts: dict[str, Any] = {}
        subs = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
        for name, sub in subs.items():
            parts[name] = sub(**{f.name: kw.pop(f.name) for f in dataclasses.fields(sub) if f.name in kw})
        offload = kw.pop("kv_offload", None) or {}
        # the CLI's flat names work as keywords too (LLM(kv_offload_cpu_bytes=...))
        flat = {k[len("kv_offload_") :]: kw.pop(k) for k in list(kw) if k.startswith("kv_offload_")}
        if isinstance(offload, OffloadConfig) and flat:
            raise ValueError(f"give kv_offload or the kv_offload_* keywords, not both: {sorted(flat)}.")
        if not isinstance(offload, (dict, OffloadConfig)):
            raise ValueError(f"kv_offload must be a dict or an OffloadConfig, got {offload!r}.")
        if isinstance(offload, dict):
            fields = {f.name for f in dataclasses.fields(OffloadConfig)}
            if unknown := sorted(set(offload) - fields) + sorted(f"kv_offload_{k}" for k in set(flat) - fields):
                raise ValueError(f"unknown kv_offload settings: {unknown}; known: {sorted(fields)} (or kv_offload_*).")
            offload = OffloadConfig(**{**offload, **flat})
        parts["offload"] = offload
        parts["speculative"] = SpeculativeConfig.from_any(kw.pop("speculative_config", None))
        device = kw.pop("device", "auto")
        if kw:
            raise ValueError(f"unknown engine arguments: {sorted(kw)}.")
        return cls(device=device, **parts)
