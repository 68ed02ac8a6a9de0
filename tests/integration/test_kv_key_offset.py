"""Key offsets for quantized KV (specserve/model/key_offset.py) on a Qwen2-shaped model whose K bias
has large outlier channels on slowly rotating RoPE pairs, as Qwen2.5 has (up to ~360 there).

Without the offset, fp8 / nvfp4 KV spend their per-(token, head) / per-16 scales on the outliers and
the scores drown in rounding noise; with it, the quantized cache stays close to float32 KV. The
offset must never change attention itself: with float32 KV, keys minus a constant give the same
log-probabilities.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams
from specserve.model.arch import ModelArch
from specserve.model.key_offset import slow_channels
from tests.helpers.tiny_models import make_tiny_model_dir

PROMPT = list(range(3, 150))


@pytest.fixture(scope="module")
def outlier_qwen2_dir(tmp_path_factory):
    path = make_tiny_model_dir(
        tmp_path_factory.mktemp("qwen2-outliers"),
        arch="qwen2",
        seed=5,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=1e6,
    )
    weights = load_file(str(path / "model.safetensors"))
    head_dim, gen = 32, torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith("k_proj.bias"):
            b = w.view(2, head_dim)
            b[:, head_dim // 2 - 2 : head_dim // 2] = 300 * torch.sign(torch.randn(2, 2, generator=gen))
            b[:, head_dim - 1] = -250.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _prompt_logprobs(model_dir, kv_cache_dtype: str) -> torch.Tensor:
    llm = LLM(
        model=str(model_dir),
        kv_cache_dtype=kv_cache_dtype,
        progress=False,
        kv_cache_memory_bytes=16 << 20,
        max_model_len=256,
    )
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    return torch.tensor([e[PROMPT[i]].logprob for i, e in enumerate(out.prompt_logprobs) if e is not None])


def _disable_offsets(monkeypatch) -> None:
    import specserve.runner.build as setup

    original = setup.install_key_offsets
    monkeypatch.setattr(setup, "install_key_offsets", lambda model, arch, enabled: original(model, arch, False))


def test_slow_channels_are_the_slowly_rotating_pairs() -> None:
    arch = ModelArch.from_hf_config(
        {
            "model_type": "qwen2",
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "intermediate_size": 256,
            "vocab_size": 64,
            "rope_theta": 1e6,
            "max_position_embeddings": 512,
        }
    )
    slow = slow_channels(arch)
    assert slow.shape == (32,)
    assert slow[15] and slow[31] and not slow[0] and not slow[16]  # pairs (i, i + 16) share a frequency
    assert torch.equal(slow[:16], slow[16:])


@pytest.mark.parametrize("kv_cache_dtype,max_error", [("fp8", 0.05), ("nvfp4", 0.25)])
def test_offsets_keep_quantized_kv_close_to_float32(
    outlier_qwen2_dir, monkeypatch, kv_cache_dtype: str, max_error: float
) -> None:
    reference = _prompt_logprobs(outlier_qwen2_dir, "float32")
    with_offsets = (_prompt_logprobs(outlier_qwen2_dir, kv_cache_dtype) - reference).abs().mean().item()
    _disable_offsets(monkeypatch)
    without = (_prompt_logprobs(outlier_qwen2_dir, kv_cache_dtype) - reference).abs().mean().item()
    assert with_offsets < max_error, f"{kv_cache_dtype}: mean |dlogprob| {with_offsets:.4f} with offsets"
    assert with_offsets < 0.5 * without, f"offsets did not help: {with_offsets:.4f} vs {without:.4f}"


def test_offsets_do_not_change_attention(outlier_qwen2_dir, monkeypatch) -> None:
    """Forcing offsets onto float32 KV: same log-probabilities (softmax ignores a per-query constant)."""
    plain = _prompt_logprobs(outlier_qwen2_dir, "float32")
    import specserve.runner.build as setup

    original = setup.install_key_offsets
    monkeypatch.setattr(setup, "install_key_offsets", lambda model, arch, enabled: original(model, arch, True))
    forced = _prompt_logprobs(outlier_qwen2_dir, "float32")
    torch.testing.assert_close(forced, plain, atol=2e-4, rtol=0)
