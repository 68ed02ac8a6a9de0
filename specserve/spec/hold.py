"""The adaptive controller's hold (spec/adaptive.py's AdaptiveController takes these methods): where
k = 0 is the best and every k > 0 is priced far below it (AdaptiveSettings.hold_margin), the choices up
to the next exploration slot repeat k = 0 without pricing. They are the same choices: no rule that could
draft applies there. At high load the host bounds the step; on the H200's host choose and observe took
0.13-0.17 ms per step with every choice priced, 0.10-0.12 with the hold (bench/spec_host_cost.py, 64 and
256 requests); ~0.09 with the hold once the fits solved only when read (twenty-fifth session, 128 and 256)."""
from __future__ import annotations

from typing import NamedTuple

from specserve.spec.adaptive_settings import ControllerEstimates
from specserve.spec.bucket_fits import batch_bucket

HOLD_CHOICES = 8  # a hold repeats k = 0 for at most this many choices
HOLD_SHRINK = 15 / 16  # ... at a batch no smaller than this share of the one it was priced at


class Hold(NamedTuple):
    """A choice of k = 0 with drafting far behind, repeated without pricing (see AdaptiveController.choose)."""

    bucket: int
    batch_size: int
    since: int  # num_choices when it was priced
    drafting_version: int
    epoch: int


class HoldMixin:
    """Mixed into AdaptiveController: when a choice starts a hold, and whether the next one keeps it (over
    the controller's settings, choice counters, burst, drafting version and acceptance epoch)."""

    def _hold_from(self, est: ControllerEstimates, k: int, exploring: bool, bucket: int) -> Hold | None:
        """A hold on this choice if it was k = 0 as the best, not exploring nor in a burst, on a fresh
        decode price, with every k > 0 (measured or guessed) at most 1 - hold_margin of no drafts' rate.
        Then no k is promising (which takes a rate above no drafts'), no decode probe or catch-up rule
        applies (those need a best k > 0), and what could change that (a drafting step, acceptance
        fading, another load) ends the hold (_holds)."""
        margin = self.settings.hold_margin
        if (margin is None or k != 0 or est.best_k != 0 or exploring or self._burst_left > 0
                or not est.decode_trusted):
            return None
        if max(est.tokens_per_s[1:]) >= (1.0 - margin) * est.tokens_per_s[0]:
            return None
        return Hold(bucket, est.batch_size, self.num_choices, self._drafting_version, self.epoch())

    def _holds(self, hold: Hold, batch_size: int) -> bool:
        """Whether the next choice repeats the hold's k = 0: the same batch bucket and not much smaller
        a batch (drafting gains on smaller ones), nothing learnt about drafting since, the same acceptance
        epoch, at most HOLD_CHOICES choices on, and not an exploration slot (those price as usual)."""
        every = self.settings.explore_every
        nxt = self.num_choices + 1
        return (batch_bucket(batch_size) == hold.bucket and batch_size >= HOLD_SHRINK * hold.batch_size
                and self._drafting_version == hold.drafting_version and self.epoch() == hold.epoch
                and nxt - hold.since <= HOLD_CHOICES and not (every and nxt % every == 0))
