"""How many tokens to draft per request in the next step: the `Controller` interface and its three
implementations.

- `FixedController`: k = `num_speculative_tokens` every step (vLLM's default).
- `TableController`: vLLM's `num_speculative_tokens_per_batch_size`, rows (min_batch, max_batch, k);
  a batch size no row covers drafts nothing.
- `AdaptiveController`: k = argmax over 0..K of expected tokens per second (see its docstring).

Contract: `choose(batch_size)` is called once per proposal with the number of running requests and
returns 0..max_k; `observe(record)` is called once per engine step, in step order, with what that step
measured. Neither may touch the engine: a controller sees only its arguments (and, for the adaptive
one, the cost table given to it at construction), so it is tested on tables alone.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from specserve.config import SpeculativeConfig


@dataclass(frozen=True)
class StepRecord:
    """What one engine step and the proposal that fed it measured, as a controller sees it."""

    batch_size: int  # requests scheduled in the step
    k: int  # the controller's choice for this step (0: the step verified no drafts)
    reached: tuple[int, ...]  # per draft position j < k: requests that had a draft at position j
    accepted: tuple[int, ...]  # per draft position j < k: requests whose draft at position j was accepted
    step_seconds: float  # the target's forward + sampling/verification, host wall time
    propose_seconds: float  # the proposal that fed this step (0.0 when none ran)
    catch_up_tokens: int = 0  # tokens the proposer fed beyond its drafting (a draft model catching up)


class StepCostTable(Protocol):
    """The target's step cost by shape, measured at start-up (`runner/step_costs.py`)."""

    def seconds(self, batch_size: int, query_len: int) -> float:
        """Seconds of one target step of `batch_size` requests of `query_len` tokens each."""
        ...


class Controller(ABC):
    """Chooses k in 0..max_k per step. `follows_load`: whether k depends on the load (batch size,
    measurements) rather than being the same every step."""

    follows_load: bool = True

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k

    @abstractmethod
    def choose(self, batch_size: int) -> int:
        """Drafts per request for the next step of `batch_size` running requests."""

    def observe(self, record: StepRecord) -> None:
        """What the step just run measured; called once per step, in order."""


class FixedController(Controller):
    """k = max_k every step."""

    follows_load = False

    def choose(self, batch_size: int) -> int:
        return self.max_k


class TableController(Controller):
    """vLLM's `num_speculative_tokens_per_batch_size`: the k of the first row whose
    [min_batch, max_batch] holds the batch size, capped at max_k; 0 where no row does."""

    def __init__(self, max_k: int, table: tuple[tuple[int, int, int], ...]) -> None:
        super().__init__(max_k)
        self.table = table

    def choose(self, batch_size: int) -> int:
        for lo, hi, k in self.table:
            if lo <= batch_size <= hi:
                return min(k, self.max_k)
        return 0


class AdaptiveController(Controller):
    """k = argmax over 0..max_k of expected tokens per second (to be written)."""

    def __init__(self, max_k: int, costs: StepCostTable) -> None:
        super().__init__(max_k)
        self.costs = costs

    def choose(self, batch_size: int) -> int:
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        raise NotImplementedError


def build_controller(cfg: SpeculativeConfig, costs: StepCostTable | None) -> Controller:
    """The controller `cfg` asks for: a table if given, else adaptive (when `cfg.adaptive` and a cost
    table was measured), else fixed. `disable_by_batch_size` is applied by the caller (the decoder)."""
    k = cfg.num_speculative_tokens
    if cfg.num_speculative_tokens_per_batch_size:
        return TableController(k, cfg.num_speculative_tokens_per_batch_size)
    if cfg.adaptive and costs is not None:
        return AdaptiveController(k, costs)
    return FixedController(k)
