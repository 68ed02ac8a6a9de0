"""Read GGUF checkpoints (llama, mistral, qwen2): an HF config dict (hf_config.py), the tokenizer,
and tensors under HF names, dequantized one at a time (peak memory: a few float tensors)."""

from __future__ import annotations

import hashlib
import logging
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from specserve.model.catalog import is_gguf_file
from specserve.model.hf_config import gguf_to_hf_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Per-layer GGUF tensor name -> HF name inside `model.layers.N.`.
_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for rope_freqs (llama3 scaling, in the config)."""
    if gguf_name == "rope_freqs.weight":
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: no Hugging Face equivalent known.")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def unpermute_rope(weight: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head it interleaves the rotary halves (0, d/2, 1, ...),
    HF keeps them apart. Weights [rows, cols] or biases [rows]."""
    return weight.reshape(num_heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


class GGUFTensorInfo(NamedTuple):
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    dims: tuple[int, ...]  # GGUF order: fastest-varying first (torch shape reversed)
    offset: int  # absolute byte offset of the data in the file


# GGUF metadata value types -> struct formats (little-endian); 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Sequential little-endian reads over a memory map."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self.pos += length
        return self.buf[self.pos - length : self.pos].decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            return self.scalar(_SCALAR_FORMATS[value_type])
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if item_type in _SCALAR_FORMATS and item_type != 7:  # numbers in one go (vocab scores)
            dtype = np.dtype(_SCALAR_FORMATS[item_type])
            array = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += dtype.itemsize * count
            return array.tolist()
        return [self.value(item_type) for _ in range(count)]


def _check_gguf(path: Path) -> None:
    if not is_gguf_file(path):
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes b'GGUF').")


def parse_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    """Metadata and tensor directory of a GGUF file (v2/v3, little-endian), without the data (faster
    than gguf.GGUFReader on large vocabularies)."""
    _check_gguf(Path(path))
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cursor = _Cursor(buf)
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3, little-endian).")
        num_tensors, num_kv = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"))
        raw = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
            raw.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-cursor.pos // alignment) * alignment  # round up to the alignment
    finally:
        buf.close()
    return metadata, [GGUFTensorInfo(name, kind, dims, data_start + offset) for name, dims, kind, offset in raw]


class GGUFCheckpoint:
    """An open GGUF file: HF config, chat template, and tensors dequantized lazily from a memory map."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.metadata, self.tensors = parse_gguf(path)
        self._data = np.memmap(path, dtype=np.uint8, mode="r")
        # (HF name, tensor) of every parameter, in file order (rope_freqs is in the config).
        self.named = [(name, t) for t in self.tensors if (name := hf_tensor_name(t.name)) is not None]
        by_name = {t.name: t for t in self.tensors}
        self.config: dict[str, Any] = gguf_to_hf_config(
            self.metadata,
            {t.name: t.dims for t in self.tensors},
            rope_freqs=lambda: self._dequantize(by_name["rope_freqs.weight"]),
        )
        template = self.metadata.get("tokenizer.chat_template")
        self.chat_template: str | None = str(template) if template else None

    def _dequantize(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """float32 array in torch layout (GGUF dims reversed); may be a read-only view of the file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize, quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(tensor.ggml_type)
        shape = tuple(reversed(tensor.dims))
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        raw = self._data[tensor.offset : tensor.offset + math.prod(shape) // block_size * type_size]
        return dequantize(raw.reshape(quant_shape_to_byte_shape(shape, qtype)), qtype).reshape(shape)

    def _dequantize_ahead(self, named: list[tuple[str, GGUFTensorInfo]]) -> Iterator[tuple[str, np.ndarray]]:
        """(name, float32 array) in file order, dequantized by threads at most a window ahead."""
        workers = max(1, min(8, os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gguf-dequant") as pool:
            pending: deque[tuple[str, Future]] = deque()
            for name, tensor in named:
                if len(pending) >= 2 * workers:
                    done, future = pending.popleft()
                    yield done, future.result()
                pending.append((name, pool.submit(self._dequantize, tensor)))
            while pending:
                done, future = pending.popleft()
                yield done, future.result()

    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor in HF layout) one tensor at a time, dequantized to `dtype`."""
        heads = {"q_proj": self.config["num_attention_heads"], "k_proj": self.config["num_key_value_heads"]}
        # llama.cpp's converter permutes Q/K for llama-family models (Mistral included), not qwen2.
        permuted = self.config["model_type"] in ("llama", "mistral")
        for name, array in self._dequantize_ahead(self.named):
            proj = name.split(".")[-2]
            if permuted and proj in heads:
                array = unpermute_rope(array, heads[proj], self.config["head_dim"])
            # F32 tensors come back as read-only views of the memory map: torch needs writable memory.
            if not array.flags.writeable or not array.flags.c_contiguous:
                array = np.array(array, dtype=np.float32, copy=True)
            yield name, torch.from_numpy(array).to(dtype)


# Control tokens that end a turn or a document, as llama.cpp's vocabulary loader marks them.
END_OF_GENERATION_TEXTS = frozenset(
    "<|endoftext|> <|im_end|> <|eot_id|> <|eom_id|> <|end_of_text|> <|end|> <end_of_turn> <|return|> <EOT>".split()
)
_CONTROL = 3  # gguf TokenType.CONTROL


def end_of_generation_ids(metadata: dict[str, Any]) -> tuple[int, ...]:
    """Ids of the GGUF vocabulary's end-of-generation control tokens and its eot / eom ids."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or []
    ids = {i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == _CONTROL and t in END_OF_GENERATION_TEXTS}
    extra = (metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom"))
    ids.update(int(i) for i in extra if i is not None)
    return tuple(sorted(ids))


def load_gguf_tokenizer(path: str | os.PathLike[str], *, use_cache: bool = True) -> PreTrainedTokenizerBase:
    """The HF tokenizer stored in a GGUF file, with its chat template; cached under
    `$SPECSERVE_CACHE/tokenizers/` by the file's path, size, mtime and the transformers version."""
    import transformers

    from specserve.envs import specserve_cache

    path = Path(path)
    _check_gguf(path)
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    cache_dir = specserve_cache() / "tokenizers" / hashlib.sha256(ident.encode()).hexdigest()[:24]
    if use_cache and (cache_dir / "tokenizer_config.json").is_file():
        return transformers.AutoTokenizer.from_pretrained(cache_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not tokenizer.chat_template:  # transformers normally copies it from the metadata itself
        template = parse_gguf(path)[0].get("tokenizer.chat_template")
        tokenizer.chat_template = str(template) if template else None
    if use_cache:
        _save_atomically(tokenizer, cache_dir)
    return tokenizer


def _save_atomically(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save into a temp dir and rename, so no reader sees half a save."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is ordinary readable data
        os.replace(tmp, target)
    except OSError as exc:  # another process won the race, or a read-only disk: only the cache entry is lost
        logger.warning("could not cache the converted tokenizer at %s: %s", target, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
