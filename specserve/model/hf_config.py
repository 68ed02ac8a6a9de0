"""GGUF metadata -> a Hugging Face `config.json` dict (llama, mistral, qwen2), so a GGUF file and an HF
model dir look the same downstream. Shapes the tensors also give (vocab size) come from the tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from specserve.model.arch import llama3_scale

# GGUF `general.architecture` -> HF `architectures` entry.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp's converter writes Llama-3.x's rope scaling as a `rope_freqs` tensor of per-frequency
# divisors; these are the parameters every Llama-3.x release used with it.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def gguf_to_hf_config(
    metadata: Mapping[str, Any],
    tensor_dims: Mapping[str, tuple[int, ...]],
    rope_freqs: Callable[[], np.ndarray] | None = None,
) -> dict[str, Any]:
    """The HF config dict from GGUF metadata and tensor dims (GGUF order, fastest first); `rope_freqs`
    loads the `rope_freqs.weight` tensor. ValueError for unsupported features."""
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}.")
    # llama.cpp files Mistral models under `llama`; only the name tells them apart (as in transformers).
    model_type = "mistral" if arch == "llama" and "mistral" in str(metadata.get("general.name") or "").lower() else arch

    def meta(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    hidden_size = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
    rope_dim = meta("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(
            f"GGUF rope.dimension_count={rope_dim} != head_dim={head_dim}: partial rotary embeddings are not supported."
        )
    if "token_embd.weight" not in tensor_dims:
        raise ValueError("GGUF file has no token_embd.weight tensor.")
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "vocab_size": int(tensor_dims["token_embd.weight"][-1]),  # GGUF dims: [hidden, vocab]
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        # No separate output matrix means the LM head reuses the embedding (llama.cpp's rule).
        "tie_word_embeddings": "output.weight" not in tensor_dims,
        "attention_bias": "blk.0.attn_q.bias" in tensor_dims,
    }
    if model_type == "mistral":
        config["sliding_window"] = int(meta("attention.sliding_window") or 0) or None
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        token_id = metadata.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            config[f"{hf_key}_token_id"] = int(token_id)
    freqs = rope_freqs if "rope_freqs.weight" in tensor_dims else None
    rope_scaling = _rope_scaling(metadata, arch, freqs, head_dim, config["rope_theta"])
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(
    metadata: Mapping[str, Any], arch: str, rope_freqs: Callable[[], np.ndarray] | None, head_dim: int, theta: float
) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` metadata or a llama3 `rope_freqs` tensor."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {
            "rope_type": str(kind),
            "factor": float(metadata.get(f"{arch}.rope.scaling.factor", 1.0)),
        }
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if rope_freqs is None:
        return None
    divisors = np.asarray(rope_freqs(), dtype=np.float64).reshape(-1)
    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), **_LLAMA3_DEFAULTS}
    expected = llama3_rope_divisors(scaling, head_dim, theta)
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-4, atol=1e-4):
        raise ValueError(
            f"GGUF rope_freqs tensor does not match llama3 rope scaling with factor {scaling['factor']} and the "
            f"Llama-3 defaults {_LLAMA3_DEFAULTS}; this rope scaling is not supported."
        )
    return scaling


def llama3_rope_divisors(scaling: dict[str, Any], head_dim: int, rope_theta: float) -> np.ndarray:
    """What llama.cpp's converter stores in `rope_freqs` for llama3 scaling (inv_freq divisors)."""
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (inv_freq / llama3_scale(inv_freq, scaling)).numpy()
