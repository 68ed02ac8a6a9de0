"""The adaptive controller's rules for a batch that changes size (spec/adaptive.py's AdaptiveController
takes these methods): whether it is filling, and whether a proposer that catches up (a draft model)
should start drafting now or wait for the batch to settle.

A fill is a burst of arrivals: new requests' prompt chunks, a batch larger than a few choices before, and
(where the engine reports it) a queue of requests about to join. A batch size measured or priced in a fill
is gone a step later, and each drafting step on the way feeds the new prompts to the draft model.
"""
from __future__ import annotations

from specserve.spec.adaptive_settings import ControllerEstimates

# The batch fills while prompt chunks come and it grew within this many choices: a prompt split over two
# steps, or arrivals a step apart, leave a choice or two with the batch as before in the middle of a fill.
FILL_CHOICES = 4
# The arrivals rule (BatchGrowth._arrivals_due): queued requests, as a share of the batch and at least,
# that make a growing batch a fill. A share, so that a request or two joining a large batch is no fill;
# growing, so that a queue the batch cannot take in (the KV cache full, say) holds nothing back beyond a
# few choices after each replacement.
ARRIVALS_SHARE = 0.25
ARRIVALS_MIN = 2


class BatchGrowth:
    """Mixed into AdaptiveController, over its choice counter, settings, cost model and these fields:
    `_prev_batch` (the batch size of the previous choice), `_grew_at` (the last choice whose batch was
    larger than the one before), `_bucket_since` (the choice since which the batch bucket is the same) and
    `arriving` (requests queued to join the batch at the next choice, at most the free seats; the engine
    sets it before each choice through SpecDecoder.set_arriving), and `output_room` (the running requests'
    output rooms, or None: spec/output_room.py)."""

    def _note_batch(self, batch_size: int) -> None:
        """After a choice: its batch size, and whether the batch grew."""
        if batch_size > self._prev_batch:
            self._grew_at = self.num_choices
        self._prev_batch = batch_size

    def _batch_grew(self, batch_size: int) -> bool:
        """Whether the batch grew at this choice (of `batch_size`) or within FILL_CHOICES before it."""
        return batch_size > self._prev_batch or self.num_choices - self._grew_at < FILL_CHOICES

    def _arrivals_due(self, batch_size: int) -> bool:
        """Whether to draft nothing now because the batch is filling: a proposer that catches up (a draft
        model), a batch that grew (_batch_grew), and more requests queued to join it (`arriving`) than
        ARRIVALS_SHARE of it (two at least). A choice priced at the batch of the moment says to draft where
        that batch would pay for it, but the batch is gone a step later, and each drafting step on the way
        feeds the new requests' prompts to the draft model. On the H200 pair at 64 requests (twenty-eighth
        session) parts started at k = 0 and, at 4, 16 and 31 requests of a fill, drafted at k = 9-11 (priced
        10-18% above no drafts there) in steps of 28-42 ms, most with 1,700-1,900 prompt tokens: ~0.18 s of
        the 0.30 s by which its parts outlasted those of no drafts, and the point at 0.92 of them. Once the
        queue has joined, the choice is priced at the batch that stays."""
        queued = self.arriving
        if queued < ARRIVALS_MIN or queued < ARRIVALS_SHARE * batch_size or not self.catches_up():
            return False
        return self._batch_grew(batch_size)

    def _not_worth_a_catch_up(self, est: ControllerEstimates) -> bool:
        """Whether to stay at k = 0 although drafting is predicted to be faster: starting to draft costs
        a proposer that catches up (a draft model) a one-off catch-up, repaid only if the batch stays
        about this size long enough. How long is unknown; the guess is as long as it already has (a
        batch that just changed, say requests finishing one after another, is likely to change again), and
        no longer than its requests have left to their max_tokens, on average."""
        best = est.best_k
        if best == 0 or self.last_choice != 0 or not self.catches_up():
            return False
        rate0 = est.tokens_per_s[0]
        saved = est.batch_size * est.expected_tokens[best] / rate0 - est.step_seconds[best]  # per step
        catch_up = self.costs.catch_up_seconds(self.costs.unseen_tokens, est.propose_seconds[best],
                                                  est.batch_size)
        steady = max(self.num_choices - self._bucket_since, self.settings.explore_every)
        rooms = self.output_room() if self.output_room is not None else None
        if rooms:
            # nor beyond the steps the batch's requests have left (their output rooms, at the best k's
            # pace): a wave of requests that end together is repaid over its rest only (output_room.py)
            steady = min(steady, (sum(rooms) / len(rooms) + 1.0) / est.expected_tokens[best])
        return saved * steady < catch_up
