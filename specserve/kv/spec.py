"""KV cache storage layout. A slot is `block_id * block_size + offset`; quantized formats store
per-token, per-head scales, so writing one token never rewrites another's data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class LayerKVCache(NamedTuple):
    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, packed_dim]
    value: torch.Tensor  # [num_blocks, block_size, num_kv_heads, packed_dim]
    key_scale: torch.Tensor | None  # [num_blocks, block_size, num_kv_heads, num_scale_groups]
    value_scale: torch.Tensor | None
    # [num_kv_heads, head_dim] float32 powers of two: keys are cached as k / s (kv/smoothing.py); None: as k.
    key_smooth: torch.Tensor | None = None


@dataclass(frozen=True)
class KVFormat:
    """How head_dim values are stored: data dtype, packing and scales."""

    name: str  # bfloat16 | float16 | float32 | fp8 | nvfp4
    storage_dtype: torch.dtype
    values_per_element: int  # 2 for nvfp4 (two e2m1 codes per byte)
    scale_group: int | None  # head_dim values sharing one scale; None = unquantized
    scale_dtype: torch.dtype | None
    # NVFP4's static float32 global dequant multiplier (see quant.py); 1.0 elsewhere.
    global_scale: float = 1.0
    rotate: bool = False  # store head vectors Hadamard-rotated (see quant.py)

    @property
    def quantized(self) -> bool:
        return self.scale_group is not None

    def packed_dim(self, head_dim: int) -> int:
        return head_dim // self.values_per_element

    def num_scale_groups(self, head_dim: int) -> int:
        return 0 if self.scale_group is None else max(1, head_dim // self.scale_group)

    def bytes_per_token_head(self, head_dim: int) -> int:
        scales = 0 if self.scale_dtype is None else self.num_scale_groups(head_dim) * self.scale_dtype.itemsize
        return self.packed_dim(head_dim) * self.storage_dtype.itemsize + scales


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """Resolve the `kv_cache_dtype` name ("auto" follows the model's dtype)."""
    plain = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if kv_cache_dtype == "auto":
        return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype, 1, None, None)
    if kv_cache_dtype in plain:
        return KVFormat(kv_cache_dtype, plain[kv_cache_dtype], 1, None, None)
    if kv_cache_dtype == "fp8":
        return KVFormat("fp8", torch.float8_e4m3fn, 1, 1 << 30, torch.float16)
    if kv_cache_dtype == "nvfp4":
        # e2m1 codes two per byte, one e4m3 scale per 16 values, global scale 4 (see quant.py).
        return KVFormat("nvfp4", torch.uint8, 2, 16, torch.float8_e4m3fn, global_scale=4.0, rotate=True)
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported.")


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the whole KV pool of one model (one rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    fmt: KVFormat

    @property
    def bytes_per_block(self) -> int:
        per_token = 2 * self.num_kv_heads * self.fmt.bytes_per_token_head(self.head_dim)
        return self.num_layers * self.block_size * per_token

    def num_blocks_for(self, num_bytes: int) -> int:
        return max(0, num_bytes // self.bytes_per_block)

    def allocate(self, num_blocks: int, device: torch.device) -> list[LayerKVCache]:
        data_shape = (num_blocks, self.block_size, self.num_kv_heads, self.fmt.packed_dim(self.head_dim))
        caches = []
        for _ in range(self.num_layers):
            key = torch.zeros(data_shape, dtype=self.fmt.storage_dtype, device=device)
            value = torch.zeros(data_shape, dtype=self.fmt.storage_dtype, device=device)
            key_scale = value_scale = None
            if self.fmt.quantized:
                scale_shape = data_shape[:3] + (self.fmt.num_scale_groups(self.head_dim),)
                key_scale = torch.ones(scale_shape, dtype=torch.float32, device=device).to(self.fmt.scale_dtype)
                value_scale = key_scale.clone()
            caches.append(LayerKVCache(key, value, key_scale, value_scale))
        return caches
