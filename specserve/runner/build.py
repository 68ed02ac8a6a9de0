"""Build a ModelRunner from an EngineConfig: load the model, size the KV pool (an explicit byte budget, or
profile the GPU and take what is left), capture CUDA graphs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from specserve.config import CacheConfig, EngineConfig
from specserve.kv.manager import KVCacheManager
from specserve.kv.spec import KVCacheSpec, kv_format
from specserve.metrics.stats import StatsCollector
from specserve.model.key_offset import install_key_offsets
from specserve.model.loader import LoadedModel, load_model
from specserve.runner.cuda_graph import MIXED_TOKEN_LENS, PREFILL_QUERY_LENS, graph_output_bytes
from specserve.runner.key_smoothing import install_key_smoothing
from specserve.runner.model_runner import ModelRunner, select_backend
from specserve.runner.warmup import dummy_forward, dummy_logits
from specserve.sample.sampler import Sampler
from specserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    device: torch.device
    loaded: LoadedModel
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    sampler: Sampler
    stats: StatsCollector
    eos_token_ids: tuple[int, ...]
    ops: ModuleType  # the model's layer ops (Triton on CUDA, torch otherwise): a draft model loads with them


def ops_for(device: torch.device, batch_invariant: bool = False) -> ModuleType:
    """The model's layer ops: Triton kernels on CUDA where triton imports, torch otherwise; with
    batch_invariant, their projections as fixed-shape GEMMs (model/layers/batch_invariant.py)."""
    if batch_invariant:
        from specserve.model.layers.batch_invariant import make_ops

        return make_ops(ops_for(device))
    if device.type == "cuda":
        try:
            from specserve.model.layers import triton_ops

            return triton_ops
        except ImportError:
            pass
    from specserve.model.layers import ops

    return ops


def max_num_batched_tokens(config: EngineConfig, device: torch.device, max_model_len: int) -> int:
    """The scheduler's token budget per step (also the largest forward the KV profile runs)."""
    sc = config.scheduler
    max_batched = sc.max_num_batched_tokens or (2048 if device.type == "cuda" else 512)
    if not sc.enable_chunked_prefill:
        sc.check_max_model_len(max_model_len)  # a budget the user set must hold a whole prompt
        max_batched = max(max_batched, max_model_len)
    return max_batched


def build_runner(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool,
    shard: Callable[[LoadedModel], int] | None = None,
    agree: Callable[[int], int] | None = None,
    make_runner: Callable[..., ModelRunner] = ModelRunner,
) -> ModelRunner:
    """Load the model, size the KV pool, capture CUDA graphs: the model side of the engine."""
    bi = config.model.batch_invariant
    loaded = load_model(config.model, device, dtype, ops_for(device, bi), progress)
    num_kv_heads = shard(loaded) if shard is not None else loaded.arch.num_kv_heads
    arch, cc, sc = loaded.arch, config.cache, config.scheduler
    spec = KVCacheSpec(arch.num_layers, num_kv_heads, arch.head_dim, cc.block_size, kv_format(cc.kv_cache_dtype, dtype))
    install_key_offsets(loaded.model, arch, enabled=spec.fmt.quantized and shard is None)
    max_batched = max_num_batched_tokens(config, device, loaded.max_model_len)
    backend = select_backend(device, bi)

    def profile() -> None:
        profile_run(loaded, spec, device, backend, max_batched, sc.max_num_seqs)

    graphs = device.type == "cuda" and not config.model.enforce_eager and getattr(backend, "name", "") == "triton"
    k = config.speculative.num_speculative_tokens if config.speculative else 0
    # Graphs for every verify length (the controller drafts 0..k per step), short prefills, and ragged steps
    # (a prompt chunk beside decodes) without tensor parallelism; no catch-up lengths (no draft model here).
    lens = (tuple(range(1, k + 2)), PREFILL_QUERY_LENS, (), MIXED_TOKEN_LENS if shard is None else ())
    act = (arch.vocab_size, arch.hidden_size, torch.finfo(dtype).bits // 8)
    reserve = graph_output_bytes(sc.max_num_seqs, *lens[:2], *act, *lens[2:], loaded.max_model_len) if graphs else 0
    budget = kv_budget_bytes(spec, device, cc, profile, sc.max_num_seqs * loaded.max_model_len, reserve)
    num_blocks = spec.num_blocks_for(budget)
    if agree is not None:
        num_blocks = agree(num_blocks)
    # An error where the user chose max_model_len; a warning where it is the model's default.
    strict = config.model.max_model_len is not None
    check_kv_capacity(num_blocks, spec.bytes_per_block, loaded.max_model_len, cc, strict=strict)
    runner = make_runner(loaded, spec, num_blocks, device, backend)
    # Before any KV is written: cached blocks share the factors (per rank they would need the rank's heads).
    install_key_smoothing(runner, enabled=shard is None)
    if graphs:
        runner.capture_graphs(sc.max_num_seqs, loaded.max_model_len, *lens)
    return runner


def profile_run(
    loaded: LoadedModel, spec: KVCacheSpec, device: torch.device, backend, num_tokens: int, max_num_seqs: int
) -> None:
    """One forward of the largest step the scheduler can build, to measure peak activation memory."""
    num_tokens = min(num_tokens, loaded.max_model_len - 1)
    num_blocks = -(-(num_tokens + 1) // spec.block_size) + 1
    runner = ModelRunner(loaded, spec, num_blocks, device, backend)
    dummy_forward(runner, num_tokens)
    # Logits for every running sequence at once are the other large activation.
    dummy_logits(runner, max_num_seqs)
    del runner


CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB when nothing is said, on the CPU


def kv_budget_bytes(
    spec: KVCacheSpec,
    device: torch.device,
    cache: CacheConfig,
    profile: Callable[[], None],
    useful_tokens: int,
    reserve: int,
) -> int:
    """Bytes for the KV pool; `profile` runs the largest batch once (CUDA), `reserve` is kept for graphs."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if device.type != "cuda":
        useful = -(-useful_tokens // spec.block_size) * spec.bytes_per_block
        return min(CPU_DEFAULT_KV_BYTES, max(useful, spec.bytes_per_block))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    # Memory used outside torch's allocator (CUDA context, other processes) counts against us too.
    non_torch = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * cache.gpu_memory_utilization) - peak - max(0, non_torch) - reserve
    if budget < spec.bytes_per_block:
        raise ValueError(
            f"no memory left for the KV cache at gpu_memory_utilization="
            f"{cache.gpu_memory_utilization} (weights+activations peak {peak / 2**30:.1f} GiB, CUDA "
            f"graphs {reserve / 2**30:.1f} GiB of {total / 2**30:.1f} GiB); raise it, lower "
            f"max_num_batched_tokens or max_num_seqs, or set enforce_eager."
        )
    return budget


def check_kv_capacity(
    num_blocks: int, bytes_per_block: int, max_model_len: int, cache: CacheConfig, strict: bool
) -> None:
    """Start-up check, as vLLM's: the KV pool must hold one sequence of max_model_len tokens."""
    capacity = num_blocks * cache.block_size
    if capacity >= max_model_len:
        return
    needed = -(-max_model_len // cache.block_size) * bytes_per_block
    if cache.kv_cache_memory_bytes is not None:
        budget = f"kv_cache_memory_bytes ({cache.kv_cache_memory_bytes}) to at least {needed}"
    else:
        budget = (
            f"gpu_memory_utilization ({cache.gpu_memory_utilization}), or set kv_cache_memory_bytes "
            f"to at least {needed}"
        )
    msg = (
        f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {cache.block_size}) but max_model_len "
        f"is {max_model_len}: one sequence of max_model_len does not fit. Lower max_model_len to at most "
        f"{capacity} or raise {budget}."
    )
    if strict:
        raise ValueError(msg)
    logger.warning(msg)
