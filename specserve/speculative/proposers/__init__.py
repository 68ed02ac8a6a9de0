"""Proposers: n-gram lookup, a draft model, EAGLE / EAGLE-3 / P-EAGLE heads (one `Proposer` ABC)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.config import SpeculativeConfig
from specserve.speculative.proposers.base import Proposer

if TYPE_CHECKING:
    from specserve.runner.build import EngineParts


def build_proposer(cfg: SpeculativeConfig, parts: EngineParts) -> Proposer:
    """The proposer `cfg.method` names; model-backed ones load their weights here."""
    if cfg.method == "ngram":
        from specserve.speculative.proposers.ngram import NgramProposer

        lo = cfg.prompt_lookup_min or cfg.prompt_lookup_max or 3
        hi = cfg.prompt_lookup_max or max(lo, 5)
        return NgramProposer(lo, hi)
    if cfg.method == "draft_model":
        from specserve.speculative.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(cfg, parts)
    from specserve.speculative.proposers.eagle import EagleProposer

    return EagleProposer(cfg, parts)
