"""Replica choice for the front door: prefix affinity by rendezvous hashing, load override, P2C.

Pure Python (no Ray). Invariants:
- the same routing key maps to the same live replica as long as the set of live replicas is
  unchanged, and a replica going down moves only the keys it owned (rendezvous hashing);
- a replica marked down receives nothing until `mark_up` (its stats answered again);
- `outstanding[i]` counts requests this router sent to replica i that have not ended.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.kv.block_pool import hash_blocks


def routing_key(token_ids: Sequence[int], block_size: int, prefix_blocks: int) -> bytes | None:
    """Chained block hash of the first `prefix_blocks` full blocks; None without a full block."""
    num_blocks = min(prefix_blocks, len(token_ids) // block_size)
    if num_blocks < 1:
        return None
    return hash_blocks(None, list(token_ids[: num_blocks * block_size]), block_size)[-1]


@dataclass
class ReplicaLoad:
    up: bool = True
    num_waiting: float = 0.0
    num_running: float = 0.0
    kv_usage: float = 0.0
    outstanding: int = 0

    @property
    def load(self) -> float:
        return self.outstanding + self.num_waiting


class Router:
    """Pick the key's owner unless its KV usage reaches `max_kv_usage` or it has `max_imbalance`
    more requests than the least loaded live replica; else the less loaded of two random ones.
    `policy="round_robin"` ignores keys and load."""

    POLICIES = ("affinity", "round_robin")

    def __init__(
        self,
        num_replicas: int,
        max_imbalance: int = 32,
        max_kv_usage: float = 0.9,
        policy: str = "affinity",
        seed: int | None = None,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
        if policy not in self.POLICIES:
            raise ValueError(f"policy must be one of {self.POLICIES}, got {policy!r}.")
        self.policy, self._next = policy, 0
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self.max_imbalance, self.max_kv_usage = max_imbalance, max_kv_usage
        self._rng = random.Random(seed)

    def live(self, exclude: Sequence[int] = ()) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.up and i not in exclude]

    def owner(self, key: bytes, candidates: Sequence[int]) -> int:
        return max(candidates, key=lambda i: hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=8).digest())

    def choose(self, key: bytes | None, exclude: Sequence[int] = ()) -> int | None:
        """A live replica not in `exclude`, or None when there is none."""
        candidates = self.live(exclude)
        if not candidates:
            return None
        if self.policy == "round_robin":
            self._next += 1
            return candidates[self._next % len(candidates)]
        if key is not None:
            i = self.owner(key, candidates)
            r, least = self.replicas[i], min(self.replicas[j].load for j in candidates)
            if r.kv_usage < self.max_kv_usage and r.load - least < self.max_imbalance:
                return i
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if self.replicas[a].load <= self.replicas[b].load else b

    def started(self, i: int) -> None:
        self.replicas[i].outstanding += 1

    def finished(self, i: int) -> None:
        self.replicas[i].outstanding = max(0, self.replicas[i].outstanding - 1)

    def mark_down(self, i: int) -> None:
        self.replicas[i].up = False

    def mark_up(self, i: int, num_waiting: float, num_running: float, kv_usage: float) -> None:
        r = self.replicas[i]
        r.up, r.num_waiting, r.num_running, r.kv_usage = True, num_waiting, num_running, kv_usage
