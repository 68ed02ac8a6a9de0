"""Real model shapes for `load_format="dummy"` (random weights, no files)."""

from __future__ import annotations

from typing import Any

_DIMS = "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim"


def _shape(model_type: str, dims: tuple[int, ...], rest: dict[str, Any]) -> dict[str, Any]:
    """An HF config dict: dims in _DIMS order, then the other fields."""
    return {"model_type": model_type, **dict(zip(_DIMS.split(), dims)), **rest}


_QWEN = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True)
_QWEN.update(attention_bias=True, bos_token_id=151643, eos_token_id=151645)
_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_SCALING["original_max_position_embeddings"] = 8192

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _shape(
        "llama",
        (128256, 4096, 14336, 32, 32, 8, 128),
        dict(rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=_LLAMA3_SCALING)
        | dict(tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    ),
    "qwen2.5-1.5b": _shape("qwen2", (151936, 1536, 8960, 28, 12, 2, 128), _QWEN),
    "qwen2.5-0.5b": _shape("qwen2", (151936, 896, 4864, 24, 14, 2, 64), _QWEN),
    "smollm2-135m": _shape(
        "llama",
        (49152, 576, 1536, 30, 9, 3, 64),
        dict(rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
        | dict(bos_token_id=1, eos_token_id=2),
    ),
}
