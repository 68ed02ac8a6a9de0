"""Per-layer key offsets for quantized KV: softmax is unchanged when one vector o is subtracted from
every key, so caching k - o, with o the k_proj bias on channels whose RoPE pairs barely rotate, takes
Qwen2's large constant K outliers out before quantization. o comes from the weights, never the data,
so the same prefix stores the same bytes everywhere."""

from __future__ import annotations

import torch

from specserve.model.arch import ModelArch, rope_inv_freq

# A bias channel is part of the offset while its RoPE pair turns less than MAX_ANGLE radians over
# OFFSET_POSITIONS positions: a constant can only cancel what stays (nearly) constant.
MAX_ANGLE = 1.0
OFFSET_POSITIONS = 32768


def slow_channels(arch: ModelArch) -> torch.Tensor:
    """[head_dim] bool: channels of RoPE pairs (i, i + head_dim / 2) slow enough for an offset."""
    slow = rope_inv_freq(arch) * OFFSET_POSITIONS <= MAX_ANGLE  # [head_dim // 2]
    return torch.cat([slow, slow])


def install_key_offsets(model: torch.nn.Module, arch: ModelArch, enabled: bool) -> int:
    """Give every attention layer with a K bias its offset [num_kv_heads, head_dim] (zero on fast
    channels), or remove them (enabled=False); returns how many layers have one."""
    slow = slow_channels(arch)
    count = 0
    for layer in model.layers:
        attn = layer.self_attn
        bias, attn.key_offset = attn.qkv_proj.bias, None
        if not enabled or bias is None or not bool(slow.any()):
            continue
        k_bias = bias[attn.q_size : attn.q_size + attn.kv_size].detach().view(attn.num_kv_heads, attn.head_dim)
        attn.key_offset = torch.where(slow.to(k_bias.device), k_bias, torch.zeros_like(k_bias))
        count += 1
    return count
