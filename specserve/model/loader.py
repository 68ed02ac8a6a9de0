"""Load a model (HF safetensors dir, GGUF file, or dummy weights) with its tokenizer, architecture and
an identity string that keys persisted KV blocks."""

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
from specserve.model.catalog import resolve_model
from specserve.model.gguf_loader import GGUFCheckpoint, end_of_generation_ids, load_gguf_tokenizer
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
    # Tokens that end generation beyond config.json's eos_token_id (generation_config / GGUF control tokens).
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
    if max_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings {arch.max_position_embeddings}."
        )
    with torch.device(device), _weights_left_unset():
        model = CausalLM(arch, rope_cos_sin_cache(arch, max_len, device), ops)
    model.to(dtype=dtype)
    model.cos_sin_cache = model.cos_sin_cache.float()
    if cfg.load_format == "dummy":
        _init_dummy(model, cfg.seed)
    else:
        opts = dict(desc=f"Loading {source.name}", unit="tensor", disable=not progress, leave=False)
        bar = tqdm(source.iter_weights(), total=source.num_tensors, **opts)
        loaded = model.load_weights((n, t.to(device=device, dtype=dtype)) for n, t in bar)
        missing = sorted({name for name, _ in model.named_parameters()} - loaded)
        if missing:  # (left unset, they would hold whatever the allocator gave)
            raise ValueError(
                f"model {source.name!r} has no weights for {len(missing)} parameter(s): "
                f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}."
            )
    model.eval().requires_grad_(False)
    tokenizer, name = source.tokenizer(cfg.tokenizer), cfg.served_model_name or source.name
    return LoadedModel(
        model, arch, hf_config, tokenizer, name, source.identity, max_len, source.end_of_generation_ids()
    )


@contextmanager
def _weights_left_unset() -> Iterator[None]:
    """nn.Linear / nn.Embedding made inside skip their random init (load_model sets every weight)."""
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
    """Where weights, config and tokenizer come from; the base class is a dummy shape (no weights)."""

    def __init__(self, name: str, hf_config: dict[str, Any], identity: str) -> None:
        self.name, self.hf_config, self.identity = name, hf_config, identity
        self.num_tensors: int | None = None

    @staticmethod
    def open(cfg: ModelConfig) -> WeightSource:
        if cfg.load_format == "dummy" and cfg.model in SHAPES:
            return WeightSource(cfg.model, dict(SHAPES[cfg.model]), f"dummy:{cfg.model}")
        path = Path(cfg.model).expanduser()
        if (path / "config.json").is_file():
            source: WeightSource = _HFDirSource(path.name, path)
        else:
            resolved = resolve_model(cfg.model)
            cls = _GGUFSource if resolved.kind == "gguf" else _HFDirSource
            source = cls(resolved.name, Path(resolved.path))
        # An explicit load_format must be what the reference holds (vLLM refuses a mismatch too).
        kind = "gguf" if isinstance(source, _GGUFSource) else "safetensors"
        if cfg.load_format in ("safetensors", "gguf") and cfg.load_format != kind:
            raise ValueError(
                f"load_format {cfg.load_format!r} does not match model {source.name!r}, which is {kind}; "
                f"use load_format 'auto' or '{kind}'."
            )
        return source

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise ValueError(f"{self.name} has no weights; use load_format='dummy'.")

    def tokenizer(self, override: str | None) -> Any | None:
        """The tokenizer: `override` (a path or HF id) if given, else the model's own (None: token ids only)."""
        if not override:
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(override)

    def end_of_generation_ids(self) -> tuple[int, ...]:
        """Token ids that end generation besides config.json's eos_token_id (LoadedModel's field)."""
        return ()


class _HFDirSource(WeightSource):
    def __init__(self, name: str, path: Path) -> None:
        self.path, self.files = path, sorted(path.glob("*.safetensors"))
        digest = hashlib.sha256()
        for f in self.files:
            digest.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
        config = json.loads((path / "config.json").read_text())
        super().__init__(name, config, f"hf:{name}:{digest.hexdigest()[:16]}")

    def end_of_generation_ids(self) -> tuple[int, ...]:
        try:
            eos = json.loads((self.path / "generation_config.json").read_text()).get("eos_token_id")
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

        try:
            return AutoTokenizer.from_pretrained(str(override or self.path))
        except (OSError, ValueError):
            return None


class _GGUFSource(WeightSource):
    def __init__(self, name: str, path: Path) -> None:
        self.path, self.ckpt = path, GGUFCheckpoint(path)
        super().__init__(name, dict(self.ckpt.config), f"gguf:{path.name}:{path.stat().st_size}")
        self.num_tensors = len(self.ckpt.named)  # sizes the loading progress bar

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.ckpt.iter_tensors(torch.float32)

    def end_of_generation_ids(self) -> tuple[int, ...]:
        return end_of_generation_ids(self.ckpt.metadata)

    def tokenizer(self, override: str | None) -> Any | None:
        return super().tokenizer(override) if override else load_gguf_tokenizer(self.path)
