"""Draft tokens kept on the device while a proposer drafts, read back to the host once.

A proposer that drafts k tokens autoregressively feeds each draft into its next forward. Reading
every draft back (`.tolist()`) would make the host wait for each forward: at batch 1 the GPU then
idles between the small draft forwards. Instead each step's sampled tokens stay a device tensor,
the next forward takes its inputs from it (an embedding lookup, or the runner's placeholder fill),
and all drafts cross to the host in one copy at the end.
"""
from __future__ import annotations

import torch


class DraftTokens:
    def __init__(self) -> None:
        self.steps: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # (active, tokens, probs)

    def add(self, active: list[int], tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """Step s drafted tokens [len(active)] (and their distributions [len(active), vocab] or None)
        for the requests `active` (indices into the propose's request list)."""
        self.steps.append((active, tokens if tokens.dtype == torch.int64 else tokens.to(torch.int64), probs))

    @property
    def last_tokens(self) -> torch.Tensor:
        """The last step's tokens, [len(its active)] on the device."""
        return self.steps[-1][1]

    def rows_in_last(self, active: list[int]) -> list[int]:
        """These requests' rows in last_tokens (each must have drafted in the last step)."""
        pos = {i: r for r, i in enumerate(self.steps[-1][0])}
        return [pos[i] for i in active]

    def to_lists(self, n: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Per request: its drafts (host ints: the one read-back, which waits for the last draft) and
        their distributions (device rows; empty if greedy)."""
        values = torch.cat([t for _, t, _ in self.steps]).tolist()
        drafts: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        at = 0
        for active, _, p in self.steps:
            for r, i in enumerate(active):
                drafts[i].append(values[at + r])
                if p is not None:
                    probs[i].append(p[r])
            at += len(active)
        return drafts, probs
