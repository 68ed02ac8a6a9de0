"""Request validation: resolve the prompt to token ids and the output budget, or raise ValueError."""

from __future__ import annotations

from typing import Any

from specserve.sampling_params import SamplingParams


def resolve_prompt(
    prompt: str | list[int] | dict, tokenizer: Any | None, vocab_size: int
) -> tuple[str | None, list[int]]:
    """Returns (prompt text or None, prompt token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            _, ids = resolve_prompt(prompt["prompt_token_ids"], tokenizer, vocab_size)
            return (text if isinstance(text, str) else None), ids
        if "prompt" not in prompt:
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'.")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty.")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}.")
        return prompt, list(tokenizer.encode(prompt))
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt).__name__}.")
    if not prompt:
        raise ValueError("prompt must not be empty (prompt_token_ids is an empty list).")
    # Fast path (C loops); anything else takes the loop below, which names the first offending value.
    if set(map(type, prompt)) == {int} and 0 <= min(prompt) and max(prompt) < vocab_size:
        return None, list(prompt)
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids contains {t!r}, outside the vocabulary [0, {vocab_size}).")
    return None, list(prompt)


def resolve_max_tokens(
    num_prompt_tokens: int, params: SamplingParams, max_model_len: int, num_blocks: int, block_size: int
) -> int:
    """The output budget; the prompt must leave room for at least one generated token."""
    if num_prompt_tokens >= max_model_len:
        why = f"max_model_len is {max_model_len} and at least one token must be generated."
        raise ValueError(f"prompt has {num_prompt_tokens} tokens, which is over the context length: {why}")
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is not None and params.max_tokens > room:
        why = f"and max_model_len is {max_model_len}: at most {room} tokens can be generated."
        raise ValueError(f"max_tokens is {params.max_tokens} but the prompt has {num_prompt_tokens} tokens {why}")
    if num_prompt_tokens + 1 > num_blocks * block_size:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens but the KV cache holds only "
            f"{num_blocks * block_size}; raise kv_cache_memory_bytes or gpu_memory_utilization."
        )
    return params.max_tokens if params.max_tokens is not None else room
