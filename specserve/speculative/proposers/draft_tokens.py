"""Draft tokens kept on the device while a proposer drafts, read back to the host once."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from specserve.runner.batch import PendingTokens
from specserve.sample.h2d import h2d
from specserve.scheduler.request import PLACEHOLDER, Request


class DraftTokens:
    def __init__(self) -> None:
        self.steps: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # (active, tokens, probs)

    def add(self, active: list[int], tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """A step's tokens [len(active)] (and distributions [len(active), vocab] or None) for requests `active`
        (P-EAGLE: all drafts in one step, each request repeated per draft; rows_in_last then does not apply)."""
        self.steps.append((active, tokens.to(torch.int64), probs))

    @property
    def last_tokens(self) -> torch.Tensor:
        """The last step's tokens, [len(its active)] on the device."""
        return self.steps[-1][1]

    def rows_in_last(self, active: list[int]) -> list[int]:
        """These requests' rows in last_tokens (each must have drafted in the last step)."""
        pos = {i: r for r, i in enumerate(self.steps[-1][0])}
        return [pos[i] for i in active]

    def request_major(self, n: int) -> tuple[torch.Tensor, list[int], list[list[torch.Tensor]]]:
        """(flat [sum(counts)] int64 on the device, request-major; counts per request; per request its drafts'
        distributions (device rows; empty if greedy))."""
        per_req: list[list[int]] = [[] for _ in range(n)]  # request i's rows of the step-major flat
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        at = 0
        for active, _, p in self.steps:
            for r, i in enumerate(active):
                per_req[i].append(at + r)
                if p is not None:
                    probs[i].append(p[r])
            at += len(active)
        order = [row for rows in per_req for row in rows]
        flat = torch.cat([t for _, t, _ in self.steps])
        if order != list(range(len(order))):
            flat = flat.index_select(0, h2d(torch.tensor(order, dtype=torch.int64), flat.device))
        return flat, [len(rows) for rows in per_req], probs


# finish(drafts, probs): per request, its draft ids (host) and distributions (device rows; empty if greedy).
Finish = Callable[[list[list[int]], list[list[torch.Tensor]]], None]


class DeferredDrafts:
    """A proposal's drafts left on the device for the step that verifies them."""

    def __init__(
        self,
        flat: torch.Tensor,
        counts: list[int],
        probs: list[list[torch.Tensor]],
        request_ids: list[str],
        finish: Finish,
    ) -> None:
        """flat [sum(counts)] int64 on the device, request-major; probs as DraftTokens.request_major's."""
        starts = np.cumsum([0] + counts).tolist()
        self.pending = PendingTokens(flat, dict(zip(request_ids, starts)))
        self._starts, self._probs, self._finish = starts, probs, finish
        self._event = None
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def resolve(self) -> None:
        """Wait for the ids to reach the host, then hand them to `finish` (once)."""
        if self._event is not None:
            self._event.synchronize()
        values, s = self._host.tolist(), self._starts
        self._finish([values[s[i] : s[i + 1]] for i in range(len(s) - 1)], self._probs)


class DraftDelivery:
    """A device-drafting proposer's hand-over: read back now, or DeferredDrafts the decoder takes (`take_deferred`)
    where the runner allows it (`allow_deferred`) and the proposer defers by default."""

    defer_drafts: bool = False
    defers_by_default: bool = True
    _deferred: DeferredDrafts | None = None

    def allow_deferred(self, allowed: bool) -> None:
        self.defer_drafts = allowed and self.defers_by_default

    def deliver(
        self, dt: DraftTokens, reqs: list[Request], fed: Callable[[list[list[int]]], None] | None = None
    ) -> None:
        """dt's drafts of reqs (placeholders until read back, then assign_resolved); fed(drafts) runs first."""
        flat, counts, probs = dt.request_major(len(reqs))
        for req, k in zip(reqs, counts):
            req.spec_token_ids, req.spec_draft_probs = [PLACEHOLDER] * k, None
        greedy = [r.params.greedy for r in reqs]

        def finish(drafts: list[list[int]], dists: list[list[torch.Tensor]]) -> None:
            if fed is not None:
                fed(drafts)
            assign_resolved(reqs, drafts, dists, greedy)

        deferred = DeferredDrafts(flat, counts, probs, [r.request_id for r in reqs], finish)
        if self.defer_drafts:
            self._deferred = deferred
        else:
            deferred.resolve()

    def take_deferred(self) -> DeferredDrafts | None:
        d, self._deferred = self._deferred, None
        return d

    def resolve_deferred(self) -> None:
        """Read deferred drafts back now (tools and tests that inspect drafts right after propose)."""
        d = self.take_deferred()
        if d is not None:
            d.resolve()


def assign_resolved(
    reqs: list[Request], drafts: list[list[int]], probs: list[list[torch.Tensor]], greedy: list[bool]
) -> None:
    """Replace each request's placeholder drafts by the drafted ids (no more than the scheduler left) and set
    spec_draft_probs ([k, vocab]; None = one-hot)."""
    for req, tokens, rows, g in zip(reqs, drafts, probs, greedy):
        held = len(req.spec_token_ids)
        if not held or req.spec_token_ids[0] != PLACEHOLDER:
            continue
        req.spec_token_ids = tokens[:held]
        req.spec_draft_probs = None if g or not rows else torch.stack(rows[:held])
