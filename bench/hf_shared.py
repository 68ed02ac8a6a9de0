"""A `transformers` model whose parameters ARE a loaded specserve model's tensors (no second copy).

Benchmarks compare specserve against `transformers` generate on the same weights. Loading the
GGUF a second time through transformers doubles the memory (6 GB more for a 1.5B model in float32:
too much beside a draft model on a 23 GB CPU box) and costs another dequantization (tens of
seconds on the GPU host). Instead the HF module is built on the meta device from the same HF
config and each HF parameter is pointed at the matching slice of specserve's fused tensors
(q/k/v rows of `qkv_proj`, gate/up rows of `gate_up_proj`: row slices of a row-major matrix are
contiguous views), so both run the very same values (specserve's dequantization, which
tests/integration checks against transformers' GGUF loader token for token). Speed is that of an
ordinarily loaded HF model: these are plain contiguous tensors on the same device.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _hf_config(loaded) -> Any:
    from transformers import AutoConfig

    cfg = {k: v for k, v in loaded.hf_config.items() if k != "architectures"}
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def _views(loaded) -> dict[str, torch.Tensor]:
    """HF parameter name -> tensor (a view of specserve's parameter)."""
    m, a = loaded.model, loaded.arch
    q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    out = {"model.embed_tokens.weight": m.embed_tokens.weight, "model.norm.weight": m.norm.weight,
           "lm_head.weight": m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight}
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj.weight
        out[p + "self_attn.q_proj.weight"] = qkv[:q]
        out[p + "self_attn.k_proj.weight"] = qkv[q:q + kv]
        out[p + "self_attn.v_proj.weight"] = qkv[q + kv:]
        if attn.qkv_proj.bias is not None:
            b = attn.qkv_proj.bias
            out[p + "self_attn.q_proj.bias"], out[p + "self_attn.k_proj.bias"] = b[:q], b[q:q + kv]
            out[p + "self_attn.v_proj.bias"] = b[q + kv:]
        out[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
        out[p + "mlp.gate_proj.weight"] = mlp.gate_up_proj.weight[:inter]
        out[p + "mlp.up_proj.weight"] = mlp.gate_up_proj.weight[inter:]
        out[p + "mlp.down_proj.weight"] = mlp.down_proj.weight
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return out


def hf_model_sharing(loaded, eos_token_ids: tuple[int, ...] | list[int]) -> nn.Module:
    """An HF CausalLM over `loaded.model`'s tensors, in eval mode, on their device and dtype."""
    from transformers import AutoModelForCausalLM

    weight = loaded.model.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    config = _hf_config(loaded)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    views = _views(loaded)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = names - set(views)
    if missing:
        raise ValueError(f"no specserve tensor for HF parameters {sorted(missing)[:4]}")
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        tensor = views[name]
        if tuple(tensor.shape) != tuple(getattr(module, leaf).shape):
            raise ValueError(f"{name}: specserve {tuple(tensor.shape)} vs HF {tuple(getattr(module, leaf).shape)}")
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    # Buffers (rotary inverse frequencies) are computed, not loaded: build those modules for real.
    for owner_name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent, _, leaf = owner_name.rpartition(".")
            try:
                rebuilt = type(module)(config=config, device=device)
            except TypeError:  # transformers versions differ; float32 inv_freq either way
                rebuilt = type(module)(config=config).to(device)
            setattr(model.get_submodule(parent) if parent else model, leaf, rebuilt)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"HF tensors left on the meta device: {left[:4]}")
    eos = list(eos_token_ids)
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = eos, eos[0], False
    gc.temperature = gc.top_p = gc.top_k = None
    return model.eval()
