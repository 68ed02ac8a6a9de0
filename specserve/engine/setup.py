"""Build the engine's parts from an EngineConfig: device, model, KV pool, scheduler, sampler."""

from __future__ import annotations

from typing import cast

import torch

from specserve.config import EngineConfig
from specserve.kv.manager import KVCacheManager
from specserve.kv.smoothing import smoothing_tag
from specserve.metrics.stats import StatsCollector
from specserve.model.loader import LoadedModel, resolve_dtype
from specserve.runner.build import EngineParts, build_runner, max_num_batched_tokens, ops_for
from specserve.runner.model_runner import ModelRunner
from specserve.sample.sampler import Sampler
from specserve.scheduler.scheduler import Scheduler


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available.")
    return torch.device(name)


def _eos_ids(loaded: LoadedModel) -> tuple[int, ...]:
    tok_eos = getattr(loaded.tokenizer, "eos_token_id", None)  # (no tokenizer: None)
    ids = set(loaded.arch.eos_token_ids) | set(loaded.extra_eos_token_ids) | {t for t in (tok_eos,) if t is not None}
    return tuple(sorted(ids))


def build_engine_parts(config: EngineConfig, progress: bool = True) -> EngineParts:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.model.dtype, device)
    torch.manual_seed(config.model.seed)
    if config.parallel.tensor_parallel_size > 1:
        from specserve.distributed.executor import build_tp_executor  # one process per rank

        # The executor stands in for a ModelRunner: the same execute / capture interface over the ranks.
        runner: ModelRunner = cast(ModelRunner, build_tp_executor(config, device, dtype, progress))
    else:
        runner = build_runner(config, device, dtype, progress)
    loaded, spec, num_blocks = runner.loaded, runner.spec, runner.num_blocks
    arch, cc, sc = loaded.arch, config.cache, config.scheduler
    max_batched = max_num_batched_tokens(config, device, loaded.max_model_len)
    kv = KVCacheManager(
        num_blocks, cc.block_size, cc.enable_prefix_caching, hash_extra=f"{loaded.identity}|{spec.fmt.name}".encode()
    )
    num_lookahead = config.speculative.num_speculative_tokens if config.speculative else 0
    # Short prompts in graph-sized pieces where prefill graphs were captured (scheduler.py).
    graphs = getattr(runner, "graphs", None)  # (the tensor-parallel executor captures none here)
    piece = max(graphs.prefill_query_lens) if graphs is not None and graphs.prefill_query_lens else None
    args = (kv, sc.max_num_seqs, max_batched, loaded.max_model_len, sc.enable_chunked_prefill, num_lookahead)
    scheduler = Scheduler(*args, prefill_piece=piece)
    stats = StatsCollector()
    if config.offload.enabled:
        if not cc.enable_prefix_caching:
            raise ValueError("kv_offload needs enable_prefix_caching (tiers are keyed by prefix block hashes).")
        from specserve.kv.offload.offloader import KVOffloader

        # "koff1": quantized KV is stored minus the per-layer key offset (model/key_offset.py).
        koff = ("|koff1" if spec.fmt.quantized else "") + smoothing_tag(runner.kv_caches)  # kv/smoothing.py
        namespace = (
            f"{loaded.identity}|{spec.fmt.name}{koff}|{spec.fmt.global_scale}|bs{cc.block_size}|"
            f"L{arch.num_layers}|H{arch.num_kv_heads}|D{arch.head_dim}"
        )
        kv.attach_offloader(KVOffloader(config.offload, runner.kv_caches, namespace, cc.block_size, stats))
    info = {"block_size": cc.block_size, "cache_dtype": spec.fmt.name, "num_gpu_blocks": num_blocks}
    info["enable_prefix_caching"] = cc.enable_prefix_caching
    stats.set("cache_config_info", 1, {k: str(v) for k, v in info.items()})
    return EngineParts(device, loaded, runner, kv, scheduler, Sampler(), stats, _eos_ids(loaded), ops_for(device))
