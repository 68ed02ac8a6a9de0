"""Published EAGLE-3 / P-EAGLE heads (HF and speculators layouts): they load, serve losslessly, refuse a
target they do not fit, and round-trip through save_published."""

from __future__ import annotations

import dataclasses
import json
import random
import types
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model.arch import ModelArch, rope_cos_sin_cache
from specserve.speculative.proposers.eagle_head import EagleHead, head_config_for, load_head
from specserve.speculative.proposers.head_formats import save_published
from tests.helpers.tiny_models import make_tiny_model_dir

K = 3
AUX = (0, 2, 3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("t4"), arch="llama", seed=4, num_layers=4)


def _arch(target_dir: Path) -> tuple[ModelArch, dict]:
    hf = json.loads((target_dir / "config.json").read_text())
    return ModelArch.from_hf_config(hf), hf


def make_published(target_dir: Path, out: Path, layout: str, slots: int = 0, draft: int | None = None, **kw) -> Path:
    """A random published-flavour head for the target, written in `layout`."""
    arch, hf = _arch(target_dir)
    cfg = head_config_for(arch, hf, "tiny", "id", "eagle3", slots, draft)
    cfg = dataclasses.replace(cfg, aux_hidden_layers=AUX, flavour="published", mask_token_id=5 if slots else None, **kw)
    torch.manual_seed(len(layout) + slots)
    head = EagleHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.05 if "norm" in name else 0.1)
        if draft is not None:
            head.d2t.copy_(torch.sort(torch.randperm(cfg.vocab_size)[:draft]).values)
    return save_published(head, out, layout)


def _prompts() -> list[dict]:
    rng = random.Random(5)
    return [{"prompt_token_ids": [rng.randrange(10, 300) for _ in range(n)]} for n in (3, 17, 40)]


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(target_dir) -> list[list[int]]:
    return _greedy(LLM(model=str(target_dir), progress=False, kv_cache_memory_bytes=4 << 20))


CASES = {
    "hf": dict(layout="hf"),
    "hf-reduced-own-embed": dict(layout="hf", draft=200, own_embed=True, norm_before_residual=True),
    "speculators": dict(layout="speculators", draft=150),
    "peagle": dict(layout="speculators", slots=K - 1, draft=150, norm_before_residual=True),
}


@pytest.mark.parametrize(
    "case, mode", [(c, "eager") for c in CASES] + [("hf-reduced-own-embed", "static"), ("peagle", "static")]
)
def test_published_head_serves_losslessly(case, mode, target_dir, reference, tmp_path, monkeypatch):
    """Eager forwards, and the static buffers the CUDA graphs capture (run uncaptured here)."""
    from specserve.speculative.proposers.eagle import EagleProposer

    monkeypatch.setattr(EagleProposer, "step_graphs", mode)
    kw = dict(CASES[case])
    head_dir = make_published(target_dir, tmp_path / case, kw.pop("layout"), **kw)
    data = json.loads((head_dir / "config.json").read_text())
    assert "format" not in data and "specserve" in data
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": K, "adaptive": False}
    if case == "peagle":
        spec["parallel_drafting"] = True
    llm = LLM(model=str(target_dir), progress=False, kv_cache_memory_bytes=4 << 20, speculative_config=spec)
    assert llm.engine.spec.proposer.head.cfg.flavour == "published"
    assert _greedy(llm) == reference
    counters = {m.name: m.value for m in llm.get_metrics()}
    assert any(v > 0 for n, v in counters.items() if n.endswith("spec_decode_num_drafts_total"))


def _rows(head: EagleHead, arch: ModelArch, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Dense causal forward of the head over rows; returns greedy target ids [rows]."""
    target = types.SimpleNamespace(embed_tokens=torch.nn.Embedding(arch.vocab_size, arch.hidden_size))
    torch.manual_seed(9)
    target.embed_tokens.weight.data.normal_()
    cos_sin = rope_cos_sin_cache(arch, 64, torch.device("cpu"))

    def attend(q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        ).transpose(0, 1)

    hidden = head.fuse_target(feats)
    _, normed = head(head.embed(tokens, target), hidden, torch.arange(tokens.shape[0]), cos_sin, attend)
    return head.greedy_token_ids(head.compute_logits(normed, target))


def test_hf_and_speculators_layouts_give_the_same_drafts(target_dir, tmp_path):
    arch, _ = _arch(target_dir)
    a = make_published(target_dir, tmp_path / "a", "hf", draft=100, own_embed=True)
    state = load_head(a, arch, "id", torch.device("cpu"), torch.float32)
    b = save_published(state, tmp_path / "b", "speculators")
    again = load_head(b, arch, "id", torch.device("cpu"), torch.float32)
    tokens = torch.randint(0, arch.vocab_size, (12,))
    feats = torch.randn(12, len(AUX) * arch.hidden_size)
    for key, t in state.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], t)
    assert torch.equal(_rows(state, arch, tokens, feats), _rows(again, arch, tokens, feats))


def test_bin_weights_load(target_dir, tmp_path):
    from safetensors.torch import load_file

    arch, _ = _arch(target_dir)
    d = make_published(target_dir, tmp_path / "h", "hf", draft=64)
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    head = load_head(d, arch, "id", torch.device("cpu"), torch.float32)
    assert head.d2t is not None and head.d2t.shape == (64,)


def test_a_head_for_another_target_is_refused_naming_the_tensor(target_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    arch, _ = _arch(target_dir)
    d = make_published(target_dir, tmp_path / "h", "hf")
    state = load_file(str(d / "model.safetensors"))
    state["fc.weight"] = torch.zeros(arch.hidden_size, 2 * arch.hidden_size)
    save_file(state, str(d / "model.safetensors"))
    shape = (arch.hidden_size, 3 * arch.hidden_size)
    with pytest.raises(
        ValueError, match=rf"'fc.weight' has shape \({arch.hidden_size}, {2 * arch.hidden_size}\).*{shape}"
    ):
        load_head(d, arch, "id", torch.device("cpu"), torch.float32)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 7}))
    with pytest.raises(ValueError, match="vocab_size is 7"):
        load_head(d, arch, "id", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("method", ["eagle3", "p-eagle"])
def test_train_draft_writes_a_published_head_that_reloads_with_the_same_drafts(method, target_dir, tmp_path):
    from safetensors.torch import load_file

    from specserve.speculative.proposers.eagle_head import read_head_config
    from specserve.train.loop import train_main

    out = tmp_path / "head"
    args = ["--target", str(target_dir), "--method", method, "--out", str(out), "--steps", "2", "--quiet"]
    args += ["--num-prompts", "3", "--max-seq-len", "96", "--max-new-tokens", "12", "--batch-tokens", "384"]
    args += ["--num-mask-slots", "2", "--draft-vocab-size", "120"]
    assert train_main(args) == 0
    data = json.loads((out / "config.json").read_text())
    if method == "p-eagle":
        assert data["speculators_model_type"] == "peagle" and data["mask_token_id"] is not None
    else:
        assert data["architectures"] == ["LlamaForCausalLMEagle3"]
    tensors = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d", "norm.weight"} <= set(tensors)
    assert tensors["fc.weight"].shape[1] == len(data["specserve"]["aux_hidden_layers"]) * 64
    cfg = read_head_config(out)
    assert cfg.flavour == "published" and cfg.draft_vocab_size == 120
    arch, _ = _arch(target_dir)
    # The saved head, loaded as serving loads it, drafts what a second save + load of it drafts.
    head = load_head(out, arch, "id", torch.device("cpu"), torch.float32)
    save_dir = tmp_path / "again"
    from specserve.speculative.proposers.eagle_head import save_head

    save_head(head, save_dir)
    again = load_head(save_dir, arch, "id", torch.device("cpu"), torch.float32)
    for key, t in head.state_dict().items():
        assert torch.equal(again.state_dict()[key], t), key
    tokens = torch.randint(0, arch.vocab_size, (10,))
    feats = torch.randn(10, len(cfg.aux_hidden_layers) * arch.hidden_size)
    assert torch.equal(_rows(head, arch, tokens, feats), _rows(again, arch, tokens, feats))
