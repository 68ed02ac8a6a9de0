"""Load a model: HF safetensors dirs, GGUF files (via the gguf package), or dummy weights.

Returns the model on its device plus what the engine needs beside it (tokenizer, chat
template, architecture, an identity string used to key persisted KV blocks).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from specserve.config import ModelConfig
from specserve.model.arch import ModelArch, rope_cos_sin_cache
from specserve.model.layers import ops as torch_ops
from specserve.model.llama import CausalLM
from specserve.model.shapes import SHAPES


@dataclass
class LoadedModel:
    model: CausalLM
    arch: ModelArch
    hf_config: dict[str, Any]
    tokenizer: Any | None  # transformers PreTrainedTokenizerBase, or None (token ids only)
    name: str
    identity: str  # stable id of the weights (for keying persisted KV)
    max_model_len: int
    # Tokens that also end generation, beyond config.json's eos_token_id: an HF dir's
    # generation_config.json eos ids (as vLLM reads them), a GGUF's end-of-generation control tokens
    # (as llama.cpp finds them). Qwen2.5's <|endoftext|> is one: GGUF files name only <|im_end|>.
    extra_eos_token_ids: tuple[int, ...] = ()


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]


def load_model(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, ops: ModuleType = torch_ops, progress: bool = True
) -> LoadedModel:
    source = WeightSource.open(cfg)
    hf_config = {**source.hf_config, **(cfg.hf_overrides or {})}
    arch = ModelArch.from_hf_config(hf_config)
    max_len = cfg.max_model_len or arch.max_position_embeddings
    if cfg.max_model_len and cfg.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}."
        )
    with torch.device(device), _weights_left_unset():
        model = CausalLM(arch, rope_cos_sin_cache(arch, max_len, device), ops)
    model.to(dtype=dtype)
    model.cos_sin_cache = model.cos_sin_cache.float()
    if cfg.load_format == "dummy":
        _init_dummy(model, cfg.seed)
    else:
        names = source.iter_weights()
        it = tqdm(
            names,
            total=source.num_tensors,
            desc=f"Loading {source.name}",
            unit="tensor",
            disable=not progress,
            leave=False,
        )
        loaded = model.load_weights((n, t.to(device=device, dtype=dtype)) for n, t in it)
        missing = sorted({name for name, _ in model.named_parameters()} - loaded)
        if missing:  # (left unset, they would hold whatever the allocator gave)
            raise ValueError(
                f"model {source.name!r} has no weights for {len(missing)} parameter(s): "
                f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}."
            )
    model.eval().requires_grad_(False)
    tokenizer = source.tokenizer(cfg.tokenizer)
    return LoadedModel(
        model,
        arch,
        hf_config,
        tokenizer,
        cfg.served_model_name or source.name,
        source.identity,
        max_len,
        source.end_of_generation_ids(),
    )


@contextmanager
def _weights_left_unset() -> Iterator[None]:
    """Modules made inside allocate their weights without drawing them: nn.Linear and nn.Embedding draw
    random ones when made (kaiming / normal init), and every one is then overwritten, by the checkpoint's
    or by the dummy weights. On this project's 2-core CPU machine the draws took 24 of the 69 s that
    Qwen2.5-Coder-1.5B (GGUF Q4_K_M) took to load. load_model checks that a checkpoint filled every
    parameter."""
    linear, embedding = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = linear, embedding


@torch.no_grad()
def _init_dummy(model: CausalLM, seed: int) -> None:
    """Random weights of the real shape, made on the device (small, so bf16 stays finite)."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.uniform_(-0.02, 0.02, generator=gen)


class WeightSource:
    """Where weights, config and tokenizer come from."""

    def __init__(self, name: str, hf_config: dict[str, Any], identity: str) -> None:
        self.name, self.hf_config, self.identity = name, hf_config, identity
        self.num_tensors: int | None = None

    @staticmethod
    def open(cfg: ModelConfig) -> WeightSource:
        if cfg.load_format == "dummy" and cfg.model in SHAPES:
            return _ShapeSource(cfg.model)
        path = Path(cfg.model).expanduser()
        if (path / "config.json").is_file():
            return _HFDirSource(path.name, path)._check_format(cfg.load_format, "safetensors")
        from specserve.model.catalog import resolve_model

        resolved = resolve_model(cfg.model)
        if resolved.kind == "gguf":
            return _GGUFSource(resolved.name, Path(resolved.path))._check_format(cfg.load_format, "gguf")
        return _HFDirSource(resolved.name, Path(resolved.path))._check_format(cfg.load_format, "safetensors")

    def _check_format(self, load_format: str, kind: str) -> WeightSource:
        """An explicit load_format must be what the model reference holds (vLLM refuses a mismatch too)."""
        if load_format in ("safetensors", "gguf") and load_format != kind:
            raise ValueError(
                f"load_format {load_format!r} does not match model {self.name!r}, which is {kind}; "
                f"use load_format 'auto' or '{kind}'."
            )
        return self

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise ValueError(f"{self.name} has no weights; use load_format='dummy'.")

    def tokenizer(self, override: str | None) -> Any | None:
        if override:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(override)
        return None

    def end_of_generation_ids(self) -> tuple[int, ...]:
        """Token ids that end generation besides config.json's eos_token_id (LoadedModel's field)."""
        return ()


class _ShapeSource(WeightSource):
    def __init__(self, name: str) -> None:
        super().__init__(name, dict(SHAPES[name]), f"dummy:{name}")


class _HFDirSource(WeightSource):
    def __init__(self, name: str, path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        files = sorted(path.glob("*.safetensors"))
        digest = hashlib.sha256()
        for f in files:
            st = f.stat()
            digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        super().__init__(name, cfg, f"hf:{name}:{digest.hexdigest()[:16]}")
        self.path, self.files = path, files

    def end_of_generation_ids(self) -> tuple[int, ...]:
        gen = self.path / "generation_config.json"
        if not gen.is_file():
            return ()
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            return ()
        ids = eos if isinstance(eos, list) else [eos]
        return tuple(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool))

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        if not self.files:
            raise ValueError(f"no *.safetensors files in {self.path}.")
        handles = [safe_open(str(f), framework="pt") for f in self.files]
        self.num_tensors = sum(len(h.keys()) for h in handles)
        for h in handles:
            for key in h.keys():
                yield key, h.get_tensor(key)

    def tokenizer(self, override: str | None) -> Any | None:
        from transformers import AutoTokenizer

        path = override or self.path
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError):
            return None


class _GGUFSource(WeightSource):
    def __init__(self, name: str, path: Path) -> None:
        from specserve.model.gguf_loader import read_gguf

        self.ckpt = read_gguf(path)
        st = path.stat()
        super().__init__(name, dict(self.ckpt.config), f"gguf:{path.name}:{st.st_size}")
        self.path = path
        self.num_tensors = len(self.ckpt.tensor_names())  # sizes the loading progress bar

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.ckpt.iter_tensors(torch.float32)

    def end_of_generation_ids(self) -> tuple[int, ...]:
        from specserve.model.gguf_loader import end_of_generation_ids

        return end_of_generation_ids(self.ckpt.metadata)

    def tokenizer(self, override: str | None) -> Any | None:
        if override:
            return super().tokenizer(override)
        from specserve.model.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(self.path)
