"""Bad speculative_config: a clear ValueError before any request runs (most before anything loads)."""

from __future__ import annotations

import json
import shutil

import pytest

from specserve import LLM
from specserve.config import SpeculativeConfig
from tests.helpers.eagle_heads import make_random_head_dir
from tests.helpers.tiny_models import make_tiny_model_dir


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"method": "medusa", "model": "x"}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 1.5}, "num_speculative_tokens"),
        ({"method": "draft_model"}, "model is required"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, "model is required"),
        ({"model": "x"}, "method is required"),
        ({"method": "ngram", "bogus": 1}, "unknown keys"),
        ("{not json", "not valid JSON"),
        ({"method": "ngram", "disable_by_batch_size": 1}, "disable_by_batch_size must be an integer >= 2"),
        ({"method": "ngram", "disable_by_batch_size": "4"}, "disable_by_batch_size"),
        ({"method": "ngram", "disable_by_batch_size": True}, "disable_by_batch_size"),
        ({"method": "ngram", "max_model_len": 0}, "max_model_len must be an integer >= 2"),
        ({"method": "ngram", "max_model_len": 2048.0}, "max_model_len"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_config_fails_before_loading(cfg, match):
    # The model path does not exist: the config error must come first.
    with pytest.raises(ValueError, match=match):
        LLM(model="/nonexistent/model", speculative_config=cfg)
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_any(cfg)


def _llm(target, **spec):
    return LLM(
        model=str(target),
        progress=False,
        kv_cache_memory_bytes=1 << 20,
        speculative_config={"num_speculative_tokens": 3, **spec},
    )


def test_draft_with_other_vocab_size_is_refused(tiny_llama_dir, tmp_path):
    other = make_tiny_model_dir(tmp_path / "small-vocab", vocab_size=320, seed=4, num_layers=1)
    with pytest.raises(ValueError, match="vocab_size"):
        _llm(tiny_llama_dir, method="draft_model", model=str(other))


def test_draft_with_other_token_strings_is_refused(tiny_llama_dir, tmp_path):
    other = tmp_path / "swapped"
    shutil.copytree(tiny_llama_dir, other)
    tok_file = other / "tokenizer.json"
    data = json.loads(tok_file.read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    for a in range(100, 140):  # same size, same merges, but ids 100..139 and 200..239 swap strings
        vocab[by_id[a]], vocab[by_id[a + 100]] = a + 100, a
    tok_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="tokenizer differs"):
        _llm(tiny_llama_dir, method="draft_model", model=str(other))


def test_unknown_draft_model_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown model"):
        _llm(tiny_llama_dir, method="draft_model", model="no-such-model-anywhere")


@pytest.fixture(scope="module")
def heads(tiny_llama_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("heads")
    return {
        "eagle3": make_random_head_dir(str(tiny_llama_dir), base / "eagle3", "eagle3"),
        "eagle": make_random_head_dir(str(tiny_llama_dir), base / "eagle", "eagle"),
    }


def test_bad_head_dirs_are_refused(tiny_llama_dir, tiny_qwen2_dir, heads, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        _llm(tiny_llama_dir, method="eagle3", model=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="must hold config.json"):
        _llm(tiny_llama_dir, method="eagle3", model=str(tmp_path / "empty"))
    bad_json = tmp_path / "bad-json"
    shutil.copytree(heads["eagle3"], bad_json)
    (bad_json / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        _llm(tiny_llama_dir, method="eagle3", model=str(bad_json))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(heads["eagle3"], corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read"):
        _llm(tiny_llama_dir, method="eagle3", model=str(corrupt))
    not_a_head = tmp_path / "not-a-head"
    shutil.copytree(heads["eagle3"], not_a_head)
    (not_a_head / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a specserve EAGLE head"):
        _llm(tiny_llama_dir, method="eagle3", model=str(not_a_head))


def test_head_for_another_target_or_method_is_refused(tiny_llama_dir, tiny_qwen2_dir, heads, tmp_path):
    other_target = make_tiny_model_dir(tmp_path / "wide", hidden_size=96, seed=5, num_layers=2)
    with pytest.raises(ValueError, match="trained for a target"):
        _llm(other_target, method="eagle3", model=str(heads["eagle3"]))
    with pytest.raises(ValueError, match="is an 'eagle' head"):
        _llm(tiny_llama_dir, method="eagle3", model=str(heads["eagle"]))
    with pytest.raises(ValueError, match="not trained for parallel drafting"):
        _llm(tiny_llama_dir, method="eagle3", model=str(heads["eagle3"]), parallel_drafting=True)
    p_head = make_random_head_dir(str(tiny_llama_dir), tmp_path / "p", "eagle3", num_mask_slots=1)
    with pytest.raises(ValueError, match="at most 2 tokens in parallel"):
        _llm(tiny_llama_dir, method="eagle3", model=str(p_head), parallel_drafting=True)  # k = 3


def test_valid_configs_build(tiny_llama_dir, heads):
    for spec in (
        {"method": "eagle3", "model": str(heads["eagle3"])},
        {"method": "eagle", "model": str(heads["eagle"])},
        {"method": "draft_model", "model": str(tiny_llama_dir)},
    ):
        llm = _llm(tiny_llama_dir, **spec)
        assert llm.engine.spec.proposer.needs_target_hidden == spec["method"].startswith("eagle")
