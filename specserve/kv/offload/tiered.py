"""Tiers stacked fastest first (CPU, then disk): read-through with promotion, write-through."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.kv.offload.base import BlockKey, BlockPayload, OffloadTier, TierStats


class TieredStore:
    """`get` promotes a hit into every faster tier; `put` stores into every tier (write-through:
    each tier evicts on its own budget, no demotion traffic)."""

    name = "tiered"

    def __init__(self, tiers: list[OffloadTier]) -> None:
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)

    def contains(self, key: BlockKey) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def get(self, key: BlockKey) -> BlockPayload | None:
        for i, tier in enumerate(self.tiers):
            payload = tier.get(key)
            if payload is not None:
                for faster in self.tiers[:i]:
                    faster.put(key, payload)
                return payload
        return None

    def put(self, key: BlockKey, payload: BlockPayload) -> None:
        for tier in self.tiers:
            tier.put(key, payload)

    def put_many(self, keys: list[BlockKey], payloads: Sequence[BlockPayload]) -> None:
        for tier in self.tiers:
            tier.put_many(keys, payloads)  # type: ignore[attr-defined]

    @property
    def used_bytes(self) -> int:
        return sum(tier.used_bytes for tier in self.tiers)

    @property
    def capacity_bytes(self) -> int:
        return sum(tier.capacity_bytes for tier in self.tiers)

    @property
    def stats(self) -> dict[str, TierStats]:
        """Counters per tier name (a hit in tier i was a miss in tiers 0..i-1)."""
        return {tier.name: tier.stats for tier in self.tiers}

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
