"""How many tokens to draft this step: fixed k, vLLM's per-batch-size table, or adaptive.

The adaptive policy (issue 7) lives in `AdaptiveController`; this module keeps the simple ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.config import SpeculativeConfig

if TYPE_CHECKING:
    from specserve.spec.adaptive import SpecStepStats


class FixedController:
    """k from the config, or from `num_speculative_tokens_per_batch_size` ((lo, hi, k) rows)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.k = cfg.num_speculative_tokens
        self.table = cfg.num_speculative_tokens_per_batch_size

    def choose(self, batch_size: int) -> int:
        if self.table:
            for lo, hi, k in self.table:
                if lo <= batch_size <= hi:
                    return min(k, self.k) if k else 0
            return 0
        return self.k

    def observe(self, step: SpecStepStats) -> None:
        pass


class BatchSizeLimit:
    """vLLM's `disable_by_batch_size`: no drafts while more than `limit` requests run; at or below it the
    inner controller (fixed, table or adaptive) chooses. Everything else is the inner controller's."""

    def __init__(self, inner, limit: int) -> None:
        self.inner, self.limit = inner, limit

    def choose(self, batch_size: int) -> int:
        return 0 if batch_size > self.limit else self.inner.choose(batch_size)

    def __getattr__(self, name: str):  # observe, prepare, the adaptive controller's state
        if name == "inner":  # not set yet (a copy being built): no recursion through this method
            raise AttributeError(name)
        return getattr(self.inner, name)
