"""A random EAGLE head for a target: speculation must stay lossless whatever it proposes."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from specserve.model.arch import ModelArch, rope_cos_sin_cache
from specserve.speculative.proposers.eagle_head import EagleHead, head_config_for, save_head


def make_random_head_dir(
    target_model: str,
    out_dir: str | Path,
    method: str = "eagle3",
    num_mask_slots: int = 0,
    seed: int = 0,
    load_format: str = "auto",
    d2t: list[int] | None = None,
) -> Path:
    """A random head for `target_model` (tests, benchmarks); d2t: a reduced draft vocabulary (ascending ids)."""
    from specserve.config import ModelConfig
    from specserve.model.loader import WeightSource

    source = WeightSource.open(ModelConfig(model=target_model, load_format=load_format))
    arch = ModelArch.from_hf_config(source.hf_config)
    cfg = head_config_for(
        arch, source.hf_config, source.name, source.identity, method, num_mask_slots, None if d2t is None else len(d2t)
    )
    torch.manual_seed(seed)
    head = EagleHead(cfg)
    if d2t is not None:
        head.set_draft_vocab(torch.tensor(d2t, dtype=torch.int64))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)
    return save_head(head, out_dir)


# A toy target shape for head unit tests.
TOY_HF = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 6,
    "vocab_size": 50,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128,
}


def toy_head(method: str = "eagle3", slots: int = 0, seed: int = 0) -> tuple[EagleHead, types.SimpleNamespace]:
    """A random head for the toy shape, and the target parts it reads (embedding, RoPE table)."""
    arch = ModelArch.from_hf_config(TOY_HF)
    torch.manual_seed(seed)
    head = EagleHead(head_config_for(arch, TOY_HF, "t", "id", method, slots))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    target = types.SimpleNamespace(
        embed_tokens=torch.nn.Embedding(50, 32), cos_sin_cache=rope_cos_sin_cache(arch, 128, torch.device("cpu"))
    )
    return head.eval(), target
