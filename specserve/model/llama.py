"""One config-driven decoder for Llama, Qwen2 and Mistral over the paged KV cache, with fused
projections (qkv_proj, gate_up_proj); attention reads the batch from the forward context."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from specserve.attention.base import get_forward_context
from specserve.model.arch import ModelArch
from specserve.model.layers import ops as torch_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, ops: ModuleType) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Linear(nn.Linear):
    """nn.Linear whose forward is `ops.linear` (on CUDA a GEMV for decode-sized batches)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: ModuleType) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, ops: ModuleType) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias, ops)
        self.o_proj = Linear(self.q_size, arch.hidden_size, False, ops)
        self.scale, self.ops = self.head_dim**-0.5, ops
        # [num_kv_heads, head_dim], subtracted from keys before they are cached (quantized KV only: key_offset.py).
        self.key_offset: torch.Tensor | None = None

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """qkv [T, q_size + 2 * kv_size] (the fused projection's output) -> [T, hidden]."""
        ctx = get_forward_context()
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k, v = k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, self.head_dim)
        cache = ctx.kv_caches[self.layer_idx]
        fused = getattr(ctx.backend, "forward_rope", None)  # RoPE + KV write in one kernel (Triton)
        if fused is not None and self.key_offset is None:
            out = fused(q, k, v, positions, cos_sin, cache, ctx.fmt, ctx.meta, self.scale)
        else:
            q, k = self.ops.apply_rope(q, k, positions, cos_sin)
            if self.key_offset is not None:
                k = k - self.key_offset
            out = ctx.backend.forward(q, k, v, cache, ctx.fmt, ctx.meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    """gate_up_proj [2 * inter, hidden] (gate | up) and down_proj; DecoderLayer runs them fused with the norm."""

    def __init__(self, arch: ModelArch, ops: ModuleType) -> None:
        super().__init__()
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, False, ops)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, False, ops)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, ops: ModuleType) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = Attention(arch, layer_idx, ops)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp = MLP(arch, ops)
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, ops = self.self_attn, self.ops
        qkv, residual = ops.rms_norm_linear(
            x, residual, self.input_layernorm.weight, self.input_layernorm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias
        )
        x = attn.attend(qkv, positions, cos_sin)
        ln = self.post_attention_layernorm
        x, residual = ops.rms_norm_linear_silu_and_mul(x, residual, ln.weight, ln.eps, self.mlp.gate_up_proj.weight)
        return self.mlp.down_proj(x), residual


class CausalLM(nn.Module):
    """Decoder-only LM. forward: input_ids [T], positions [T] -> hidden [T, hidden]."""

    def __init__(self, arch: ModelArch, cos_sin_cache: torch.Tensor, ops: ModuleType = torch_ops) -> None:
        super().__init__()
        self.arch, self.ops = arch, ops
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, ops) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        # Layers whose inputs (the residual stream entering layer i) are also returned, for EAGLE-3 heads.
        self.aux_hidden_layers: tuple[int, ...] = ()
        # Set by distributed/parallel_layers.py: a vocabulary-sharded head that computes and gathers the logits.
        self.logits_head: nn.Module | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Returns hidden [T, hidden] (final-normed), or (hidden, [aux [T, hidden], ...])."""
        x, residual, aux = self.embed_tokens(input_ids), None, []
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_layers:
                aux.append(x if residual is None else x + residual)
            x, residual = layer(x, residual, positions, self.cos_sin_cache)
        x, _ = self.norm(x, residual)
        return (x, aux) if self.aux_hidden_layers else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        if self.logits_head is not None:
            return self.logits_head(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the fused parameters. Returns the parameter names loaded."""
        params, a = dict(self.named_parameters()), self.arch
        loaded: set[str] = set()
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, a.intermediate_size),
            "up_proj": ("gate_up_proj", a.intermediate_size, a.intermediate_size),
        }
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            for part, (target, offset, size) in fused.items():
                if f".{part}." in name:
                    name = name.replace(f".{part}.", f".{target}.")
                    params[name].narrow(0, offset, size).copy_(tensor)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the {a.model_type} model.")
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded
