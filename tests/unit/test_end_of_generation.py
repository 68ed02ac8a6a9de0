"""Tokens that end generation beyond config.json's eos_token_id: a GGUF's end-of-generation control
tokens (llama.cpp's rule; Qwen2.5-Instruct GGUFs name <|im_end|> only, and the model also ends with
<|endoftext|>) and an HF dir's generation_config.json eos ids (vLLM's rule)."""

from __future__ import annotations

import json

from specserve import LLM, SamplingParams
from specserve.model.gguf_loader import end_of_generation_ids


def test_gguf_control_tokens_by_text() -> None:
    tokens = ["a", "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|eot_id|>", "b"]
    types = [1, 3, 3, 3, 1, 3, 1]  # 3: CONTROL; a normal token with an end text does not count
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    assert end_of_generation_ids(meta) == (1, 2, 5)
    assert end_of_generation_ids({**meta, "tokenizer.ggml.eot_token_id": 6}) == (1, 2, 5, 6)
    assert end_of_generation_ids({}) == ()


def test_generation_config_eos_ids_end_generation(tiny_llama_dir, tmp_path) -> None:
    """A token the model emits ends the request once generation_config.json lists it as an eos id."""
    params = SamplingParams(temperature=0.0, max_tokens=12)
    free = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    out = free.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    stop_at = out.token_ids[4]
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    for f in tiny_llama_dir.iterdir():
        (model_dir / f.name).symlink_to(f)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (model_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [config.get("eos_token_id", 0), stop_at]})
    )
    llm = LLM(model=str(model_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    assert stop_at in llm.engine.eos_token_ids
    got = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0]
    first = out.token_ids.index(stop_at)
    assert got.token_ids == out.token_ids[: first + 1] and got.finish_reason == "stop"
