"""Offload tiers: where KV blocks evicted from the device cache go, and come back from.

A tier is a key -> payload store under a byte budget. Keys are content addresses (the caller's
`namespace_hash + chained_block_hash`): one key always names the same bytes, so a tier may drop,
keep or rewrite an entry at any time without coordination, and a miss is always safe (the engine
recomputes the block).

Ownership: `put` takes the payload's tensors; the caller must not modify them afterwards (the
disk tier serializes them later, on its writer thread). Tensors returned by `get` may be shared
with the tier; treat them as read-only (`insert_block` only copies out of them).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import torch

from specserve.kv.spec import LayerKVCache

BlockKey = bytes
# One block of every layer: "{layer}.key", "{layer}.value" [block_size, num_kv_heads, packed_dim]
# and, for quantized formats, "{layer}.key_scale", "{layer}.value_scale"
# [block_size, num_kv_heads, num_scale_groups]; contiguous CPU tensors.
BlockPayload = dict[str, torch.Tensor]

_FIELDS = ("key", "value", "key_scale", "value_scale")


@dataclass
class TierStats:
    """Counters of one tier; they only grow."""

    queries: int = 0  # get() calls
    hits: int = 0
    bytes_in: int = 0  # payload bytes accepted by put()
    bytes_out: int = 0  # payload bytes returned by get() hits
    errors: int = 0  # corrupt / foreign entries met, failed writes
    evictions: int = 0  # entries dropped to stay under the byte budget
    dropped: int = 0  # puts not stored: larger than the tier, or the write queue was full

    def snapshot(self) -> "TierStats":
        return TierStats(**{f.name: getattr(self, f.name) for f in fields(self)})


class StatsCounter:
    """TierStats behind a lock: tiers update them from more than one thread."""

    def __init__(self) -> None:
        self._stats = TierStats()
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def snapshot(self) -> TierStats:
        with self._lock:
            return self._stats.snapshot()


@runtime_checkable
class OffloadTier(Protocol):
    """A byte-bounded store of KV blocks. No method raises on bad stored data or I/O trouble:
    those become misses (and `stats.errors`)."""

    name: str

    def contains(self, key: BlockKey) -> bool:
        """Cheap existence check (a later `get` may still miss: eviction, corruption)."""
        ...

    def get(self, key: BlockKey) -> BlockPayload | None:
        """The block, or None on a miss or on a corrupt / foreign entry."""
        ...

    def put(self, key: BlockKey, payload: BlockPayload) -> None:
        """Store the block (may evict older ones; never blocks on slow storage)."""
        ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def stats(self) -> TierStats:
        """A consistent copy of the counters."""
        ...

    def flush(self) -> None:
        """Return once every earlier put is stored (or has failed and been counted)."""
        ...

    def close(self) -> None:
        """Flush and release resources; the tier is unusable afterwards."""
        ...


def payload_nbytes(payload: BlockPayload) -> int:
    """Bytes of tensor data in one payload (what tier budgets count)."""
    return sum(t.numel() * t.element_size() for t in payload.values())


def _layer_tensors(cache: LayerKVCache) -> list[tuple[str, torch.Tensor]]:
    return [(name, t) for name, t in zip(_FIELDS, cache) if t is not None]


def extract_blocks(caches: list[LayerKVCache], block_ids: list[int]) -> list[BlockPayload]:
    """Copy blocks of every layer to the CPU, one payload per block id.

    One gather and one device->host copy per cache tensor for the whole list, so offloading many
    blocks costs O(layers) transfers rather than O(layers * blocks).
    """
    ids = torch.tensor(block_ids, dtype=torch.long)
    payloads: list[BlockPayload] = [{} for _ in block_ids]
    for layer, cache in enumerate(caches):
        for name, tensor in _layer_tensors(cache):
            rows = tensor[ids.to(tensor.device)].cpu()  # [n, block_size, H, X], a fresh copy
            for payload, row in zip(payloads, rows.unbind(0)):
                # clone: each payload owns its storage (safetensors refuses shared storage).
                payload[f"{layer}.{name}"] = row.clone() if len(block_ids) > 1 else row
    return payloads


def extract_block(caches: list[LayerKVCache], block_id: int) -> BlockPayload:
    """Copy one block of every layer to the CPU: {"{layer}.key": [block_size, H, packed_dim], ...}."""
    return extract_blocks(caches, [block_id])[0]


def check_payload(caches: list[LayerKVCache], payload: BlockPayload) -> str | None:
    """Why `payload` cannot go into `caches` (names, shapes, dtypes), or None if it can."""
    expected = {f"{layer}.{name}": t
                for layer, cache in enumerate(caches) for name, t in _layer_tensors(cache)}
    if set(payload) != set(expected):
        return f"payload tensors {sorted(payload)[:4]}... do not match the cache's {sorted(expected)[:4]}..."
    for name, tensor in expected.items():
        got = payload[name]
        if got.dtype != tensor.dtype or tuple(got.shape) != tuple(tensor.shape[1:]):
            return (f"{name}: payload {got.dtype} {tuple(got.shape)} vs cache block "
                    f"{tensor.dtype} {tuple(tensor.shape[1:])}")
    return None


def insert_block(caches: list[LayerKVCache], block_id: int, payload: BlockPayload) -> None:
    """Copy a payload into block `block_id` of every layer. ValueError (nothing written) if the
    payload's layout differs from the caches' (another model, KV format or block size)."""
    insert_blocks(caches, [block_id], [payload])


def insert_blocks(caches: list[LayerKVCache], block_ids: list[int], payloads: list[BlockPayload]) -> None:
    """Copy payloads[i] into block block_ids[i] of every layer: one host->device copy per cache
    tensor. ValueError, with nothing written, if any payload's layout differs from the caches'."""
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
    for payload in payloads:
        problem = check_payload(caches, payload)
        if problem is not None:
            raise ValueError(f"cannot insert KV block: {problem}")
    if not block_ids:
        return
    ids = torch.tensor(block_ids, dtype=torch.long)
    for layer, cache in enumerate(caches):
        for name, tensor in _layer_tensors(cache):
            rows = torch.stack([p[f"{layer}.{name}"] for p in payloads])  # [n, block_size, H, X]
            dst = tensor
            if tensor.element_size() == 1 and tensor.dtype != torch.uint8:
                # index_copy_ has no float8 kernel on CPU; copying the bytes is the same thing.
                dst, rows = tensor.view(torch.uint8), rows.view(torch.uint8)
            dst.index_copy_(0, ids.to(tensor.device), rows.to(tensor.device))
