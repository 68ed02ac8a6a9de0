"""An explicit load_format must be what the model reference holds (a GGUF asked for as safetensors, or
the reverse, is refused by name instead of loading silently)."""

from __future__ import annotations

import pytest

from specserve import LLM


def test_explicit_load_format_must_match_the_model(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="load_format 'gguf' does not match"):
        LLM(model=str(tiny_llama_dir), load_format="gguf", progress=False)
    assert (
        LLM(model=str(tiny_llama_dir), load_format="safetensors", progress=False, kv_cache_memory_bytes=4 << 20).engine
        is not None
    )


def test_a_checkpoint_without_a_parameter_is_refused_by_name(tmp_path, tiny_llama_dir) -> None:
    """Weights are allocated, not drawn, before a checkpoint fills them (loader._weights_left_unset): a
    parameter that no tensor fills would hold whatever memory it got, so the load refuses it by name."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.post_attention_layernorm.weight"
    assert name in tensors
    save_file({k: v for k, v in tensors.items() if k != name}, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no weights for 1 parameter.*layers.1.post_attention_layernorm.weight"):
        LLM(model=str(broken), progress=False, kv_cache_memory_bytes=4 << 20)


def test_modules_made_after_a_load_draw_their_weights_again(tiny_llm) -> None:
    """The loader's no-init context ends with the load: nn.Linear made later is initialized as usual."""
    import torch

    torch.manual_seed(0)
    w = torch.nn.Linear(64, 64).weight
    assert w.abs().max() > 0 and w.abs().max() <= 1 / 8 + 1e-6  # kaiming uniform: within 1/sqrt(64)
    assert w.std() > 0.05
