"""Shard an already-built CausalLM for tensor parallelism: every rank loads the full weights, then
`shard_model` swaps qkv / gate_up for column-parallel and o / down for row-parallel linears, the embedding
and LM head for vocabulary-parallel ones. Norms and RoPE stay replicated."""

from __future__ import annotations

from specserve.distributed.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from specserve.distributed.parallel_state import TPGroup
from specserve.model.arch import ModelArch
from specserve.model.llama import CausalLM


def check_tp_size(arch: ModelArch, tensor_parallel_size: int) -> None:
    """ValueError unless the attention heads and the KV heads split evenly over the ranks."""
    tp, a, b = tensor_parallel_size, arch.num_heads, arch.num_kv_heads
    for n, what in ((a, "attention heads"), (b, "KV heads")):
        if n % tp:
            fits = [d for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0]
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's {n} {what} (try one of {fits}).")


def shard_model(model: CausalLM, rank: int, world_size: int, group: TPGroup) -> CausalLM:
    """Replace `model`'s layers by this rank's shards (in place; returns the model)."""
    arch = model.arch
    check_tp_size(arch, world_size)
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    for layer in model.layers:
        attn = layer.self_attn
        attn.qkv_proj = ColumnParallelLinear.from_linear(attn.qkv_proj, (q_size, kv_size, kv_size), rank, world_size)
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, rank, world_size, group)
        # Per-rank head counts: Attention.forward splits the fused projection with these.
        attn.num_heads, attn.num_kv_heads = arch.num_heads // world_size, arch.num_kv_heads // world_size
        attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        mlp = layer.mlp
        inter = arch.intermediate_size
        mlp.gate_up_proj = ColumnParallelLinear.from_linear(mlp.gate_up_proj, (inter, inter), rank, world_size)
        # shard_range gives down_proj's input columns the same slice as gate's and up's rows.
        mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, rank, world_size, group)
    full_head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    embed = VocabParallelEmbedding.from_embedding(model.embed_tokens, rank, world_size, group)
    if model.lm_head is None:  # tied: the head shares the embedding's (identically sliced) rows
        head = ParallelLMHead(embed.weight, arch.vocab_size, group)
    else:
        head = ParallelLMHead.from_weight(full_head, rank, world_size, group)
    model.embed_tokens, model.lm_head, model.logits_head = embed, None, head
    return model
