"""Tiny random-weight models built in-process: an HF dir (config, safetensors, tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "def add(a, b):\n    return a + b\n# numbers 0 1 2 3 4 5 6 7 8 9 and words: alpha beta gamma delta "
    "speculative decoding drafts tokens; the target verifies them in one forward pass. "
    "Unicode: café, naïve, 東京, emoji 🙂. "
) * 20


def make_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        unk_token=None,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model_dir(
    path: Path,
    arch: str = "llama",
    vocab_size: int = 384,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    **overrides,
) -> Path:
    """Write config.json, model.safetensors and tokenizer files for a tiny random model."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        tie_word_embeddings=(arch == "qwen2"),
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(arch)
    # Larger-than-default init so greedy paths differ across prompts (tiny models are otherwise flat).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, in float32 (the reference)."""
    model = _hf_model(str(path))
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


_cache: dict[str, object] = {}


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    if path not in _cache:
        _cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _cache[path]
