"""Size the KV pool: an explicit byte budget, or profile the GPU and take what is left."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from specserve.config import CacheConfig
from specserve.kv.spec import KVCacheSpec

logger = logging.getLogger(__name__)

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
