"""ModelArch: the architecture facts the engine needs, from an HF-style config dict."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}.")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
        )

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim + self.num_heads * self.head_dim * h
        per_layer = attn + 3 * h * i + 2 * h
        return self.num_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """[head_dim // 2] float64: the rotation speed (radians per position) of each RoPE pair, scaling applied."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = dict(arch.rope_scaling or ())
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "llama3":
        return llama3_scale(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type not in ("default", None):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported.")
    return inv_freq


def rope_cos_sin_cache(arch: ModelArch, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the half-frequencies, then sin (neox layout)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), rope_inv_freq(arch))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(device)


def llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1's frequency-dependent RoPE scaling (same math as transformers)."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)
