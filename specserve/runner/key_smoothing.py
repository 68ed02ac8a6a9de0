"""Calibrate and install per-channel key smoothing (kv/smoothing.py) on a runner's KV pool: one causal
forward of the calibration text over a scratch float32 cache, recording what every attention layer
hands the cache (keys after RoPE and the key offset) and its queries."""

from __future__ import annotations

import torch

from specserve.attention.base import AttentionMetadata, ForwardContext, forward_context
from specserve.attention.torch_ref import TorchRefBackend
from specserve.kv.smoothing import calibration_ids, smoothing_factors, with_key_smoothing
from specserve.kv.spec import KVCacheSpec, KVFormat, LayerKVCache, kv_format
from specserve.model.loader import LoadedModel

_BLOCK_SIZE = 16
CHUNK_TOKENS = 256  # calibration forwards are this long at most


class _Recorder:
    """An attention backend that records each layer's per-channel absmax of q and k, then attends as torch_ref."""

    def __init__(self, caches: list[LayerKVCache]) -> None:
        self.layer_of = {cache.key.data_ptr(): i for i, cache in enumerate(caches)}
        self.key_absmax: list[torch.Tensor | None] = [None] * len(caches)
        self.query_absmax: list[torch.Tensor | None] = [None] * len(caches)
        self.inner = TorchRefBackend()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        fmt: KVFormat,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        i, num_kv_heads = self.layer_of[cache.key.data_ptr()], k.shape[1]
        key = k.float().abs().amax(dim=0)  # [Hkv, D]
        query = q.float().abs().view(q.shape[0], num_kv_heads, -1, q.shape[2]).amax(dim=(0, 2))  # [Hkv, D]
        seen_key, seen_query = self.key_absmax[i], self.query_absmax[i]
        self.key_absmax[i] = key if seen_key is None else torch.maximum(seen_key, key)
        self.query_absmax[i] = query if seen_query is None else torch.maximum(seen_query, query)
        return self.inner.forward(q, k, v, cache, fmt, meta, scale)


@torch.inference_mode()
def record_absmax(
    loaded: LoadedModel, ids: list[int], num_kv_heads: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal forwards of `ids` in pieces of CHUNK_TOKENS (each from position 0, so the factors do not
    depend on max_model_len where it is at least that) -> (key_absmax, query_absmax), each
    [num_layers, num_kv_heads, head_dim] (a query channel: its max over the KV head's query heads)."""
    arch, chunk = loaded.arch, min(CHUNK_TOKENS, loaded.max_model_len)
    spec = KVCacheSpec(arch.num_layers, num_kv_heads, arch.head_dim, _BLOCK_SIZE, kv_format("float32", torch.float32))
    caches = spec.allocate(-(-chunk // _BLOCK_SIZE), device)
    recorder = _Recorder(caches)
    for start in range(0, len(ids), chunk):
        _forward(loaded.model, ids[start : start + chunk], caches, spec.fmt, recorder, device)
    keys, queries = recorder.key_absmax, recorder.query_absmax
    if any(x is None for x in keys):
        raise RuntimeError("key smoothing calibration: an attention layer did not run")
    return torch.stack(keys), torch.stack(queries)  # type: ignore[arg-type]


def _forward(
    model: torch.nn.Module,
    ids: list[int],
    caches: list[LayerKVCache],
    fmt: KVFormat,
    recorder: _Recorder,
    device: torch.device,
) -> None:
    """One sequence of `ids` at positions 0.. over the scratch caches."""
    n = len(ids)
    num_blocks = -(-n // _BLOCK_SIZE)
    meta = AttentionMetadata(
        cu_query_lens=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        max_query_len=n,
        max_seq_len=n,
        num_seqs=1,
        num_tokens=n,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    positions = torch.arange(n, dtype=torch.int64, device=device)
    with forward_context(ForwardContext(meta, caches, fmt, recorder)):
        model(torch.tensor(ids, dtype=torch.int64, device=device), positions)


def calibrate_key_smoothing(loaded: LoadedModel, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The smoothing factors s [num_layers, num_kv_heads, head_dim] (float32 powers of two) of `loaded`."""
    ids = calibration_ids(loaded.tokenizer, loaded.arch.vocab_size)
    return smoothing_factors(*record_absmax(loaded, ids, num_kv_heads, device))


def install_key_smoothing(runner, enabled: bool) -> bool:
    """Attach calibrated factors to runner.kv_caches (a ModelRunner before it writes any KV, or captures
    graphs) where `enabled` and its format is rotated (nvfp4); returns whether it did."""
    if not enabled or not runner.fmt.rotate:
        return False
    factors = calibrate_key_smoothing(runner.loaded, runner.spec.num_kv_heads, runner.device)
    runner.kv_caches = with_key_smoothing(runner.kv_caches, factors)
    return True
