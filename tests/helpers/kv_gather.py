"""The test oracle for a paged KV cache: a sequence's tokens read back, dequantized."""

from __future__ import annotations

import torch

from specserve.kv.quant import dequantize
from specserve.kv.spec import KVFormat, LayerKVCache


def gather_kv(
    cache: LayerKVCache, fmt: KVFormat, block_ids: torch.Tensor, num_tokens: int, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first num_tokens tokens of a sequence whose blocks are block_ids [n], dequantized.

    Returns (key, value), each [num_tokens, H, D] in out_dtype.
    """
    block_size = cache.key.shape[1]
    num_blocks = -(-num_tokens // block_size)
    if num_blocks > block_ids.numel():
        raise ValueError(f"{num_tokens} tokens need {num_blocks} blocks, block_ids has {block_ids.numel()}")
    ids = block_ids[:num_blocks].to(device=cache.key.device, dtype=torch.long)
    out = []
    for data_cache, scale_cache in ((cache.key, cache.key_scale), (cache.value, cache.value_scale)):
        data = data_cache[ids].flatten(0, 1)[:num_tokens]  # [num_tokens, H, packed_dim]
        scale = None if scale_cache is None else scale_cache[ids].flatten(0, 1)[:num_tokens]
        out.append(dequantize(data, scale, fmt, out_dtype))
    return out[0], out[1]
