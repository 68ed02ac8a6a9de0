"""The real SmolLM2-135M-Instruct GGUF, read by specserve, against transformers' own GGUF loader.

Needs the model in the cache: `specserve models install smollm2-135m-instruct` (CI runs it
first). A missing model is a failure, not a skip: a skipped fidelity test looks like a pass.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import transformers

from specserve.model.catalog import install_command, model_path
from specserve.model.gguf_loader import GGUFCheckpoint, load_gguf_tokenizer

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far"]
TOKENIZER_TEXTS = [
    "Hello world!",
    "  leading spaces and\ttabs\n\nnewlines",
    "naïve café 東京 🙂",
    "x = [i ** 2 for i in range(10)]  # 12345",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = model_path(MODEL)
    if path is None:
        pytest.fail(f"{MODEL} is not installed; run: {install_command(MODEL)}")
    return path


@pytest.fixture(scope="module")
def checkpoint(gguf_path: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(gguf_path)


@pytest.fixture(scope="module")
def ours(checkpoint: GGUFCheckpoint) -> transformers.LlamaForCausalLM:
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten below; random init would cost seconds
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**checkpoint.config))
    state = dict(checkpoint.iter_tensors(torch.float32))
    if checkpoint.config["tie_word_embeddings"]:
        # HF's state_dict lists the tied head under its own name; it is the embedding tensor.
        assert "lm_head.weight" not in state
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.float().eval()


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def test_config_matches_models_md(checkpoint: GGUFCheckpoint) -> None:
    config = checkpoint.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["attention_bias"] is False and "rope_scaling" not in config
    assert checkpoint.chat_template and "<|im_start|>" in checkpoint.chat_template


def test_logits_match_transformers(
    ours: transformers.LlamaForCausalLM,
    reference: transformers.PreTrainedModel,
    reference_tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    for prompt in PROMPTS:
        input_ids = reference_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            diff = (ours(input_ids).logits - reference(input_ids).logits).abs().max().item()
        assert diff < 1e-3, f"{prompt!r}: max abs logit diff {diff}"


class OurTokenizers(NamedTuple):
    converted: transformers.PreTrainedTokenizerBase  # first load: converted from the GGUF metadata
    cached: transformers.PreTrainedTokenizerBase  # second load: from the saved conversion
    cache_root: Path
    cached_source: object  # what the second load passed to AutoTokenizer.from_pretrained
    cached_kwargs: dict[str, object]


@pytest.fixture(scope="module")
def our_tokenizers(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> OurTokenizers:
    """load_gguf_tokenizer twice on an empty cache: the first converts, the second must hit the cache."""
    cache_root = tmp_path_factory.mktemp("specserve-cache")
    calls: list[tuple[object, dict[str, object]]] = []
    original = transformers.AutoTokenizer.from_pretrained

    def recording(source: object, **kwargs: object) -> object:
        calls.append((source, kwargs))
        return original(source, **kwargs)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("SPECSERVE_CACHE", str(cache_root))
        start = time.perf_counter()
        converted = load_gguf_tokenizer(gguf_path)
        print(f"tokenizer: converted in {time.perf_counter() - start:.2f} s")
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
        start = time.perf_counter()
        cached = load_gguf_tokenizer(gguf_path)
        print(f"tokenizer: loaded from the cache in {time.perf_counter() - start:.2f} s")
    [(source, kwargs)] = calls
    return OurTokenizers(converted, cached, cache_root, source, kwargs)


def test_greedy_chat_answers_paris(ours: transformers.LlamaForCausalLM, our_tokenizers: OurTokenizers) -> None:
    tokenizer = our_tokenizers.cached
    input_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    with torch.no_grad():
        output = ours.generate(input_ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_tokenizer_matches_transformers(
    our_tokenizers: OurTokenizers, checkpoint: GGUFCheckpoint, reference_tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    assert Path(str(our_tokenizers.cached_source)).parent == our_tokenizers.cache_root / "tokenizers"
    assert "gguf_file" not in our_tokenizers.cached_kwargs
    expected_chat = reference_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    for tokenizer in (our_tokenizers.converted, our_tokenizers.cached):
        assert tokenizer.chat_template == checkpoint.chat_template
        for text in TOKENIZER_TEXTS:
            assert tokenizer(text).input_ids == reference_tokenizer(text).input_ids, text
        chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert chat == expected_chat
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
            reference_tokenizer.bos_token_id,
            reference_tokenizer.eos_token_id,
        )
