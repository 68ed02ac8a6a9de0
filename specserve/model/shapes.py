"""Real model shapes for `load_format="dummy"` (random weights; for speed and memory work).

`LLM(model="llama-3.1-8b", load_format="dummy")` builds the shape with random weights on the
device, no files needed. Only the architecture matters here; acceptance rates etc. need real
weights.
"""

from __future__ import annotations

from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
