"""The adaptive controller's exploration (spec/adaptive.py's AdaptiveController takes these methods):
which k to measure besides the best one, for how many steps, and whether the budget allows it.

Every `explore_every`-th choice tries another k on a fixed schedule (no randomness), so
costs and the acceptance of positions just beyond the best k stay measured: a neighbour of the best
(from k = 0, alternately 1 and K); a k predicted to beat the best where it has no fresh data of its
own bucket is tried at once (every few choices) instead. A neighbour predicted to cost more than
`explore_max_loss` of the throughput only every `explore_backoff`-th time. Exploring from k = 0 lasts
`explore_burst` steps (the first pays a draft model's catch-up, the next gives a warm proposal to learn
from), longer while its warm steps clearly beat no drafts; a draft model starts exploring a bucket only
once a plain decode step there was measured (what drafting has to beat), and not while the batch fills
(a burst of arrivals: the batch size measured is gone a step later). Exploring is paid from a
budget: the time it measurably lost (an exploring step's wall time minus the time the best k would have
taken for the tokens it produced; and the step after it, where a switch moved time between the two:
_account) stays under `explore_budget` of the time observed, over a moving window, counting what the
next exploration is expected to lose: its steps as priced now (a predicted gain offsets) plus, for a
proposer that catches up, the catch-up when drafting starts or resumes. A k
that a bucket measured only once or twice lately (maybe a fluke: JIT, an eager first run), or the first
look at drafting in a bucket, is explored on the benefit of the doubt (capped by the budget itself, not
by what exploring elsewhere cost; unless it starts with a catch-up, which is measured apart); so is
drafting from k = 0 while a catch-up was measured fewer than three times (charged at most a warm
proposal for it). With an expensive draft model or useless drafts the controller so stays within about
that fraction of no speculation; where exploring costs nothing it explores on every slot.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.spec.adaptive_settings import ControllerEstimates
from specserve.spec.estimators import PAUSE_S
from specserve.spec.step_stats import ProposalStats, SpecStepStats

if TYPE_CHECKING:  # the controller's pending choice (adaptive.py imports this module)
    from specserve.spec.adaptive import _Choice

PROMISING_GAP = 3  # choices between explorations of a promising k outside the schedule
_DOUBT_SAMPLES = 3  # a k measured fewer times than this at a bucket (lately) is explored as a guess


class Exploration:
    """Mixed into AdaptiveController: its exploration methods, over the controller's state (settings,
    costs, the choice counters, the burst in progress, the budget's decayed sums)."""

    def _candidate(self, est: ControllerEstimates) -> int:
        """The k to explore now, or the best k: a promising one at once (every few choices), else a
        neighbour on the schedule's slots."""
        s = self.settings
        promising = self._promising(est)
        if promising is not None and self.num_choices - self._last_promising >= PROMISING_GAP:
            # predicted to beat the best where this bucket has no fresh data (the load just changed,
            # say): measure it now rather than at the next slot
            self._last_promising = self.num_choices
            return promising
        if s.explore_every and self.num_choices % s.explore_every == 0:
            return self._neighbour(est, self.num_choices // s.explore_every, promising)
        return est.best_k

    def _start_burst(self, k: int, steps: int, exploring: bool) -> None:
        self._burst_k, self._burst_left, self._burst_exploring, self._burst_extra = k, steps - 1, exploring, 0
        self._burst_loss = self._burst_cycle = 0.0  # over its warm steps (see _extend_burst)

    def _burst_steps(self, candidate: int) -> int:
        """Steps an exploration lasts: from k = 0, a cold proposal then a warm one; to k = 0 from drafting,
        two (the first step without drafts is no measurement); else one."""
        if candidate == 0:
            return max(self.settings.explore_burst, 2) if self.last_choice != 0 else 1
        return max(self.settings.explore_burst, 1) if self.last_choice == 0 else 1

    def _may_explore(self, k: int, steps: int, est: ControllerEstimates) -> bool:
        """Whether exploring k now is worth measuring (not while the batch fills) and the budget has room
        for it. What it will cost: its steps as priced now
        (each step's time minus the time the best k takes for its tokens; a predicted gain offsets and,
        where nothing else is paid, is always worth measuring: once measured, the k is no longer a
        guess), plus, for a proposer that catches up after a pause (a draft model), one catch-up when
        drafting starts (k > 0 after k = 0: every token it has not seen) or resumes (after k = 0)."""
        s = self.settings
        b, best = est.batch_size, est.best_k
        filling = self._batch_grew(b)  # (batch_growth.py)
        if k > 0 and best == 0 and self.costs.after_prompt and filling and self.catches_up():
            # Not while the batch fills (prompt chunks of new requests, and more requests than a few
            # choices before): the batch size it would measure is gone a step later, the catch-up also
            # feeds the new prompts, and its warm proposal is kept out of the bucket's fits. On the H200
            # pair (twenty-third session) most explorations at 256 requests started so, at 10-55 requests
            # in a part's first steps (steps of 1,500-1,800 prompt tokens), with proposals of 15-40 ms. A
            # choice whose batch had not grown since the one before may still be in a fill (twenty-fifth,
            # 64 requests: an exploration at 38 of a wave's 64, proposals of 28 and 24 ms, ~0.1 s of a part;
            # with the memory, none at 64 in the next run).
            return False
        if s.explore_budget is None or self.observed_seconds <= 0:
            return True  # no cap; or nothing measured yet, so no price to judge it by
        best_rate = est.tokens_per_s[best]
        step_loss = est.step_seconds[k] - b * est.expected_tokens[k] / best_rate if best_rate > 0 else 0.0
        # Doubt: this bucket measured k far from paying only once or twice lately (maybe a fluke: JIT,
        # an eager first run, a pause), or no k > 0 at all (drafting here is priced on guesses from other
        # batch sizes, and they do not say it is far from paying). Then give k the benefit of the doubt
        # (at most a step's worth lost) and do not hold its measurement back by what exploring elsewhere
        # cost (the budget itself still caps it): a few such explorations per bucket and period.
        measured = self.costs.samples(b, k) if k > 0 else _DOUBT_SAMPLES
        near = est.tokens_per_s[k] >= (1.0 - s.explore_max_loss) * best_rate
        fluke = 0 < measured < _DOUBT_SAMPLES and not near
        doubt = fluke or (measured == 0 and near and len(est.trusted) == 1)
        cold_start = k > 0 and best == 0 and self.catches_up()
        # So is a catch-up priced on fewer than a few measurements (the first ones may have run into JIT
        # or warm-up): priced that high, no exploration from k = 0 fits the budget, so none measures it
        # again. Charge it at most a warm proposal (the guess before any was measured) meanwhile.
        catch_up_doubt = cold_start and self.costs.catch_up_cost.weight < _DOUBT_SAMPLES
        if doubt:
            step_loss = min(step_loss, est.step_seconds[best])
        expected = steps * step_loss
        catching_up = False  # the exploration starts with a catch-up priced on its own measurements
        if self.catches_up():
            if cold_start and self.costs.unseen_tokens != 0:
                catch_up = self.costs.catch_up_seconds(self.costs.unseen_tokens, est.propose_seconds[k], b)
                expected += min(catch_up, est.propose_seconds[k]) if catch_up_doubt else catch_up
                catching_up = not catch_up_doubt
            elif k == 0 and best > 0:
                expected += self.costs.catch_up_seconds(float(b * steps), est.propose_seconds[best], b)
        if expected <= 0:
            return True  # predicted to gain: past losses do not matter
        # A fluke is doubt about k's step price, not about a catch-up measured apart: an exploration that
        # pays one is held to what exploring already spent. On the H200 pair at 256 requests (thirtieth
        # session) k = 12, measured once at 129-256 requests, was explored from k = 0 76 choices after that
        # measurement, with a catch-up of 55,533 tokens (a 150 ms proposal): with the first, ~0.38 s of a
        # 9.8 s point. (A first look at drafting in a bucket keeps its doubt: it measures what no data says.)
        spent = 0.0 if (doubt and not (fluke and catching_up)) or catch_up_doubt else self.exploration_loss_seconds
        # the time the budget is a share of: what was observed over the window, or, while the window is
        # still filling, what it will hold at the best k's pace (a young controller explores too)
        window_seconds = self.observed_seconds
        if self.costs.num_observed < s.budget_window:
            window_seconds = max(window_seconds, s.budget_window * est.step_seconds[best])
        return spent + expected <= s.explore_budget * window_seconds

    def _promising(self, est: ControllerEstimates) -> int | None:
        """The k predicted to beat the best by more than the switch margin where this bucket has no fresh
        data (so it may not be chosen on the prediction alone), if any."""
        rates, bar = est.tokens_per_s, (1.0 + self.settings.switch_margin) * est.tokens_per_s[est.best_k]
        untrusted = [k for k in range(1, self.max_k + 1) if k not in est.trusted and rates[k] > bar]
        return max(untrusted, key=rates.__getitem__) if untrusted else None

    def _neighbour(self, est: ControllerEstimates, slot: int, promising: int | None) -> int:
        """The k to try at exploration slot `slot`: `promising` (see _promising), if any; else alternately
        above and below the best k, and from k = 0 alternately 1 and K (verify costs are not smooth in k:
        K may replay a CUDA graph where 1 runs eagerly, so "1 does not pay" does not mean "nothing
        pays")."""
        best, s = est.best_k, self.settings
        if promising is not None:
            return promising
        step = 1 if slot % 2 == 1 else -1
        if not 0 <= best + step <= self.max_k:
            step = -step
        k = min(max(best + step, 0), self.max_k)
        if best == 0 and slot % 2 == 0:
            k = self.max_k
        costly = est.tokens_per_s[k] < (1.0 - s.explore_max_loss) * est.tokens_per_s[best]
        if costly and (slot // 2) % s.explore_backoff != 0:
            return best  # measured often enough: this neighbour is far from paying
        return k

    def _extend_burst(self, choice: _Choice, loss: float, cycle: float) -> None:
        """An exploration from k = 0 whose warm steps so far clearly beat no drafts goes on for another
        step (up to `explore_every` more): the catch-up is paid, measuring more costs nothing, and a
        belief built while not drafting (acceptance measured long ago, costs from another batch size)
        is corrected in one exploration instead of one step per budget period."""
        if choice.k == 0 or choice.best_k != 0 or choice.cold:
            return
        s = self.settings
        self._burst_loss, self._burst_cycle = self._burst_loss + loss, self._burst_cycle + cycle
        if (self._burst_loss < -s.switch_margin * self._burst_cycle and self._burst_exploring
                and self._burst_k == choice.k and self._burst_left == 0 and self._burst_extra < s.explore_every):
            self._burst_left, self._burst_extra = 1, self._burst_extra + 1

    def _account(self, step: SpecStepStats, p: ProposalStats | None, choice: _Choice | None) -> None:
        """Exploration budget: all the time observed, and what exploring lost against the best k, in wall
        time: a step's timers and proposal plus what the interval since the last observation held beyond
        them (StepCosts.last_unexplained), where no pause intervened. With asynchronous scheduling a switch
        between drafting and not is no step's price on the timers, but it is exploring's cost: the first
        step that drafts after steps without drafts waits for the last one's forward (its interval holds
        two forwards), and the first one without drafts after drafting is timed at its launch (its
        interval holds none). So the step that follows an exploration the other way is booked too. On
        the H200 with the 8B shape and n-gram at 16 requests (thirty-first session) the timers booked
        28 ms lost over a point's 84 exploring steps, wall time 168 ms of its 5.3 s: the booked share
        stood at 0.58% against the 1% budget, which never bound, and drafting cost 3.7% of the point."""
        cycle = max(step.step_seconds, 0.0) + (p.seconds if p is not None else 0.0)
        extra = self.costs.last_unexplained
        bound = max(PAUSE_S, cycle)  # (decode_seconds only where it could matter: it is not free)
        if extra is not None and extra > bound and extra > bound + self.costs.decode_seconds(step.batch_size)[0]:
            extra = None  # more than a step, its proposal and one forward in flight: a pause, not a price
        wall = cycle if extra is None else max(cycle + extra, 0.0)
        keep = self._budget_keep
        self.observed_seconds = self.observed_seconds * keep + wall
        self.exploration_loss_seconds *= keep
        plain = step.plain
        exploring = choice is not None and choice.exploring
        # (the step after an exploration offsets what the exploration's interval held: only if that was booked)
        after, self._explored_plain = self._explored_plain, (plain if exploring and extra is not None else None)
        if not exploring and (after is None or after == plain):
            return
        # against the best k as priced now, with this step's data in: a best priced wrong before (a batch
        # size the fits had not seen) must not be booked as exploration's loss
        best_rate = self.estimate(step.batch_size).tokens_per_s[choice.best_k if exploring else self.best_k]
        if best_rate <= 0:
            return
        tokens = step.batch_size + sum(step.accepted_per_pos)
        self.exploration_loss_seconds += wall - tokens / best_rate
        if exploring:  # (an exploration goes on by what its steps' timers say: _extend_burst)
            self._extend_burst(choice, cycle - tokens / best_rate, cycle)
