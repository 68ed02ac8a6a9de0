"""An explicit load_format must be what the model reference holds (a GGUF asked for as safetensors, or
the reverse, is refused by name instead of loading silently)."""
from __future__ import annotations

import pytest

from specserve import LLM


def test_explicit_load_format_must_match_the_model(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="load_format 'gguf' does not match"):
        LLM(model=str(tiny_llama_dir), load_format="gguf", progress=False)
    assert LLM(model=str(tiny_llama_dir), load_format="safetensors", progress=False,
               kv_cache_memory_bytes=4 << 20).engine is not None
