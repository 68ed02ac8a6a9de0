"""Draft tokens kept on the device while a proposer drafts, read back to the host once.

A proposer that drafts k tokens autoregressively feeds each draft into its next forward. Reading
every draft back (`.tolist()`) would make the host wait for each forward: at batch 1 the GPU then
idles between the small draft forwards. Instead each step's sampled tokens stay a device tensor,
the next forward takes its inputs from it (an embedding lookup, or the runner's placeholder fill),
and all drafts cross to the host in one copy at the end.
"""
from __future__ import annotations

import torch

from specserve.sample.h2d import h2d


class DraftTokens:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # (active, tokens, probs)
        self._flat: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def add(self, active: list[int], tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """Step s drafted tokens [len(active)] (and their distributions [len(active), vocab] or None)
        for the requests `active` (indices into the propose's request list)."""
        self.steps.append((active, tokens.to(torch.int64), probs))
        self._flat = None

    def rows_in_last(self, active: list[int]) -> torch.Tensor:
        """Device indices of these requests' rows in the last step's tokens (each must be there)."""
        pos = {i: r for r, i in enumerate(self.steps[-1][0])}
        return h2d(torch.tensor([pos[i] for i in active], dtype=torch.int64), self.device)

    def last(self, active: list[int]) -> torch.Tensor:
        """The last step's tokens of `active`, [len(active)] on the device."""
        return self.steps[-1][1].index_select(0, self.rows_in_last(active))

    def flat(self) -> torch.Tensor:
        """Every step's tokens, concatenated: [sum of len(active)] on the device."""
        if self._flat is None:
            self._flat = torch.cat([t for _, t, _ in self.steps])
        return self._flat

    def start_copy(self) -> None:
        """Start reading the drafts back now (later forwards need not finish before to_lists)."""
        flat = self.flat()
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def to_lists(self, n: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Per request: its drafts (host ints) and their distributions (device rows; empty if greedy)."""
        if self._host is None:
            self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
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
