"""Per-layer key offsets for quantized KV (fp8 / nvfp4).

Softmax over one query's scores does not change when the same vector o is subtracted from every
key: each score moves by q.o. Qwen2-family models add large, nearly constant biases (up to ~360 in
Qwen2.5-Coder-1.5B's first layers, against a median |k| of 1.3) to K channels whose RoPE pairs
barely rotate. One scale per (token, head) for fp8, or per 16 values for nvfp4, then spends its
range on those channels and the others drown in rounding noise: on the CPU reference path fp8 KV
raised that model's perplexity by 30% and nvfp4 KV made it useless. Writing k - o, with o the
k_proj bias on the slowly rotating channels, takes the outliers out before quantization (fp8:
4.1066 against bf16's 4.1089 on the same text).

o comes from the weights, never from the data, so every sequence, process and restart stores the
same bytes for the same prefix: the prefix cache and the CPU / disk tiers stay valid. Unquantized
KV formats never get an offset (they lose nothing, and their cache stays byte-identical to the
plain path's).
"""

from __future__ import annotations

import torch

from specserve.model.arch import ModelArch, rope_inv_freq

# A bias channel is part of the offset while its RoPE pair turns less than this many radians over
# OFFSET_POSITIONS positions: a constant can only cancel what stays (nearly) constant.
MAX_ANGLE = 1.0
OFFSET_POSITIONS = 32768


def slow_channels(arch: ModelArch) -> torch.Tensor:
    """[head_dim] bool: channels of RoPE pairs (i, i + head_dim / 2) slow enough for an offset."""
    slow = rope_inv_freq(arch) * OFFSET_POSITIONS <= MAX_ANGLE  # [head_dim // 2]
    return torch.cat([slow, slow])


def key_offset(k_bias: torch.Tensor, num_kv_heads: int, head_dim: int, slow: torch.Tensor) -> torch.Tensor:
    """k_bias [num_kv_heads * head_dim] -> offset [num_kv_heads, head_dim] (zero on fast channels)."""
    bias = k_bias.detach().view(num_kv_heads, head_dim)
    return torch.where(slow.to(bias.device), bias, torch.zeros_like(bias))


def install_key_offsets(model: torch.nn.Module, arch: ModelArch, enabled: bool) -> int:
    """Give every attention layer with a K bias its offset (or, enabled=False, remove them: a loaded
    model may be shared by engines with different KV formats); returns how many layers have one.

    Enable only for quantized KV formats on an unsharded model (tensor-parallel ranks keep plain keys).
    """
    slow = slow_channels(arch)
    count = 0
    for layer in model.layers:
        attn = layer.self_attn
        bias = attn.qkv_proj.bias
        attn.key_offset = None
        if not enabled or bias is None or not bool(slow.any()):
            continue
        k_bias = bias[attn.q_size : attn.q_size + attn.kv_size]
        attn.key_offset = key_offset(k_bias, attn.num_kv_heads, attn.head_dim, slow)
        count += 1
    return count
