"""Estimators over decayed windows of observations, for the adaptive controller (adaptive.py).

`LocalFits` (bucket_fits.py) keeps one `regression.DecayedRegression` (a step-cost fit) per
batch-size bucket; `StepCosts` is the controller's cost model built of them. What drafts get (acceptance
per position, fill, the per-bucket calibration) is acceptance.py's; its names stay importable from here.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from specserve.spec.acceptance import PositionRates, TokenCalibration
from specserve.spec.bucket_fits import LocalFits, PlainStepTimes, batch_bucket, between_measured, local_price
from specserve.spec.regression import DecayedRegression, non_decreasing
from specserve.spec.step_stats import ProposalStats, SpecStepStats

__all__ = ["LocalFits", "PositionRates", "StepCosts", "TokenCalibration", "batch_bucket"]


_DECODE = 0  # LocalFits key of plain decode steps (verify steps and proposals: their k)
# A bucket's plain decode step (always a CUDA graph, no drafts) costs within this factor of its fit
# unless the world changed; verify fits do not restart (graph replays and eager forwards alternate).
_DECODE_RESTART = 1.5
_CATCH_UP_EXTRA = 0.25  # a proposer whose first proposal after a pause costs 25% more catches up
_COLD_EXTRA_GUESS = 1.0  # until measured: a first proposal after a pause costs twice a warm one
_CATCH_UP_REACH = 2.0  # a catch-up fit prices token counts up to this many times the largest it saw
# A catch-up of this many tokens or more runs as forwards of thousands of tokens: its time is its tokens'
# (per-call costs are noise), so such catch-ups price larger ones per token (StepCosts.catch_up_seconds).
_LARGE_CATCH_UP = 4096
_LARGE_KEEP = 0.75  # what each new large catch-up leaves of the ones before it in the per-token price
PAUSE_S = 0.005  # unaccounted time between two observations beyond this (and the step's own): a pause
_ANCHOR_WEIGHT = 8.0  # clean decode steps (decayed) a bucket's fit needs before unmeasured k are priced against it
_GUESS_WEIGHT = 0.5  # what a k's proposal cost guessed from the fit over every batch size weighs against measured ones


class StepCosts:
    """What steps and proposals cost, as the adaptive controller (adaptive.py) measures them.

    Per batch-size bucket (LocalFits): a plain decode step, a verify step per k (linear in decode and
    prefill tokens), a warm proposal per k. Over every batch size, the cost model that prices a bucket
    or a k without data of its own: the same fits pooled (proposals over 1, k, k*B, B). And what a
    proposer pays to catch up after a pause (a draft model feeds every token it has not seen)."""

    def __init__(self, max_k: int, window: float, ridge: float, stale_after: float, arrivals_window: float) -> None:
        self.max_k, self._arrivals_window = max_k, arrivals_window

        def fit() -> DecayedRegression:  # features (1, decode tokens, prefill tokens)
            return DecayedRegression(3, window, (0.0, ridge, ridge), range_feature=1)

        self.verify_cost = fit()  # every verify step: the first guess for a k without a fit of its own
        self.verify_cost_by_k = [fit() for _ in range(max_k + 1)]
        self.decode_cost = fit()
        # features (1, k, k * B, B); a fit that has seen one batch size splits a per-forward cost between
        # "per call" and "per request" (no guess is safe both ways: exploration measures the new size)
        self.propose_cost = DecayedRegression(4, window, (0.0, ridge, ridge, ridge))
        self.local_cost = LocalFits(fit, stale_after)  # decode (key 0), verify steps (key k)
        self.local_propose = LocalFits(lambda: DecayedRegression(2, window, (0.0, ridge)), stale_after)  # (1, B)
        self.plain_steps = PlainStepTimes(2 * window, stale_after)  # bounds a bucket's decode price from above
        self._keep = 1.0 - 1.0 / window
        self.pure_decode_weight = 0.0  # decayed count of steps without drafts and without prompt chunks
        # What a cold proposal costs beyond a warm one, over (1, tokens the proposer has not seen). With the
        # range of token counts it saw: one far beyond is news, not an outlier to clip (on the H200 pair,
        # sixteenth session, small catch-ups took 10-16 ms, graph replays or one eager forward, and one at
        # 256 requests 374 ms: clipped to 5x the fit, it would have taught little).
        self.catch_up_cost = DecayedRegression(2, window, (0.0, ridge), range_feature=1)
        # The same per batch-size bucket (key 0), which prices a bucket once it has any: on the H200 pair
        # (seventeenth session) catching up took ~2.6 ms at 1 request, 1-10 ms at 2 and 10-16 ms at 4
        # whatever the token count (24-1,151), and the many feeds at 1 request had the pooled fit say 2-4 ms at 4.
        self.local_catch_up = LocalFits(lambda: DecayedRegression(2, window, (0.0, ridge), range_feature=1),
                                        stale_after)
        # What feeding new requests' prompts costs (over 1, tokens): a warm proposal right after prompt chunks
        # against this bucket's warm fit. Apart from catch_up_cost: a pause's catch-up says little about it.
        self.prompt_feed_cost = DecayedRegression(2, window, (0.0, ridge))
        self.cold_extra: float | None = None  # a first proposal after a pause costs (1 + this) x a warm one
        # Decayed (seconds, tokens) of catch-ups of _LARGE_CATCH_UP tokens or more: their cost per token.
        self._large_catch_ups = (0.0, 0.0)
        self._last_cold: tuple[int, float, float | None, int] | None = None  # (k, seconds, unseen, B) of a cold one
        self.unseen_tokens: float | None = None  # computed since the last proposal with drafts (None: never drafted)
        self._counted_batch = 0  # the batch size of the last step counted into unseen_tokens
        self._arrivals = 0.0  # decayed share of steps that computed a prompt chunk (new requests)
        # decayed over the same window: steps with prompt chunks, their prompt tokens, output tokens
        self._prompts = (0.0, 0.0, 0.0)
        self.after_prompt = False  # the last observed step computed a prompt chunk
        self.num_observed = 0
        self.clock: Callable[[], float] = time.perf_counter  # when observe() is called (finds pauses)
        self._observed_at: float | None = None
        # the last observed step's wall time beyond its own timers and proposal (None: the first one, or
        # right after steps apart): what the exploration budget also counts (Exploration._account)
        self.last_unexplained: float | None = None
        self._prev_timed = True  # the previous step ran overlapped with the one before (see _timed)
        self._prev_plain: bool | None = None  # the previous step had no drafts (None: none observed)
        self._ahead_seconds = 0.0  # the last observation's ahead_seconds (SpecStepStats)
        # Prompt pieces computed in steps apart since the last observed step (observe_apart): (tokens,
        # prompts they started); the next observed step counts them as its prompt chunks, not in its price.
        self._apart = (0, 0)  # (also: the next observed step's timer may cover a step apart's forward)

    # -- predictions --------------------------------------------------------------------------
    def decode_seconds(self, b: float) -> tuple[float, bool]:
        """A plain decode step of b requests, and whether this bucket measured it lately. Else the decode
        fit over every batch size; the verify fit until a clean decode step was seen."""
        x = (1.0, b, 0.0)
        local = self.local_cost.get(b, _DECODE)
        if local is not None:
            pooled = self.decode_cost if self.decode_cost.weight >= 1.0 else self.verify_cost
            t, trusted = max(local_price(local, b, pooled), 1e-9), self.local_cost.fresh(b, _DECODE, self.num_observed)
        else:
            order = (self.decode_cost, self.verify_cost)
            if self.pure_decode_weight < 1.0 and self.verify_cost.weight >= 1.0:
                order = (self.verify_cost, self.decode_cost)
            found = next((p for p in (m.predict_many([x]) for m in order) if p is not None), None)
            if found is None:
                return 1.0, False  # nothing measured: every k costs the same, the prior decides
            t, trusted = max(found[0], 1e-9), False
        bound = self.plain_steps.bound(b, self.num_observed)  # what plain steps here took, prompts and all
        return (t if bound is None else min(t, bound)), trusted

    def verify_seconds(self, b: float, num_tokens: list[float]) -> tuple[list[float], list[bool]]:
        """Verify steps for k = 1.. (num_tokens[k - 1] tokens), and whether each is priced on fresh data
        of this bucket. Else, as a guess: between the k this bucket measured below and above it
        (between_measured), or the k's fit over every batch size (a query length with a CUDA graph costs
        a fraction of an eager one), the fit over every k, the decode fit. Before any verify step was
        measured every k counts as priced (the prior decides: draft K and measure)."""
        nothing_measured = self.verify_cost.weight < 1.0
        own_prices: dict[int, float] = {}  # k -> this bucket's own price (the anchors of the guesses)
        for k, x in enumerate(num_tokens, start=1):
            local, own = self.local_cost.get(b, k), self.verify_cost_by_k[k]
            if local is not None:
                own_prices[k] = max(local_price(local, x, own if own.weight >= 1.0 else self.verify_cost), 1e-9)
        anchored = bool(own_prices) and self._anchored(b)
        if anchored:
            own_prices[0] = self.decode_seconds(b)[0]  # (its own bucket's: a plain step of b tokens)
        seconds, trusted = [], []
        for k, x in enumerate(num_tokens, start=1):
            if k in own_prices:
                seconds.append(own_prices[k])
                trusted.append(self.local_cost.fresh(b, k, self.num_observed))
                continue
            trusted.append(nothing_measured)
            between = (between_measured(own_prices, k, lambda j: b if j == 0 else num_tokens[j - 1])
                       if anchored else None)
            if between is not None:
                seconds.append(max(between, 1e-9))
                continue
            own = self.verify_cost_by_k[k]
            model = own if own.weight >= 1.0 else self.verify_cost if not nothing_measured else self.decode_cost
            t = model.predict_many([(1.0, x, 0.0)])
            seconds.append(max(t[0], 1e-9) if t is not None else 1.0)
        return seconds, trusted

    def propose_seconds(self, b: float) -> list[float]:
        """Warm proposals for k = 1..K: this bucket's own fit for k, else the fit over every batch size,
        made non-decreasing in k. Proposing k drafts does the work of proposing k - 1 and more (one more
        draft forward, or the same lookup), so a k priced below a smaller one is noise in fits that each
        took a few samples: on the H200 pair at 2 requests (sixteenth session) k = 8 / 9 / 10 were priced
        6.30 / 5.73 / 5.94 ms where its steps at 1-2 requests took 5.84 / 5.69 / 7.03 on average, and it
        rated 10 21% above 8. Pooled (weighted by each fit's samples), they are in order."""
        priced = [p or (0.0, _GUESS_WEIGHT) for p in self._warm_proposals(b)]
        return non_decreasing([max(t, 0.0) for t, _ in priced], [w for _, w in priced])

    def _warm_proposals(self, b: float) -> list[tuple[float, float] | None]:
        """(seconds, weight) of a warm proposal of k = 1..K at batch b: this bucket's own fit (weighing its
        samples); else, as a guess (_GUESS_WEIGHT), between the k this bucket measured below (or none
        drafted, 0 s) and above it (between_measured), or the fit over every batch size; None before any.
        (Each bucket fit is read once: while drafting, every step prices every k.)"""
        own: dict[int, tuple[float, float]] = {}
        for k in range(1, self.max_k + 1):
            local = self.local_propose.get(b, k)
            if local is not None:
                own[k] = (local.predict((1.0, b)), local.weight)
        line = {0: 0.0, **{k: t for k, (t, _) in own.items()}} if own and self._anchored(b) else None
        priced: list[tuple[float, float] | None] = []
        for k in range(1, self.max_k + 1):
            if k in own:
                priced.append(own[k])
                continue
            between = between_measured(line, k, float) if line is not None else None
            if between is not None:
                priced.append((between, _GUESS_WEIGHT))
                continue
            t = self.propose_cost.predict_many([(1.0, k, k * b, b)])
            priced.append(None if t is None else (t[0], _GUESS_WEIGHT))
        return priced

    def _anchored(self, b: float) -> bool:
        """Whether this bucket prices a k it has not measured between the k it has (between_measured): only
        once it measured a plain decode step lately on enough clean steps (what drafting has to beat, and
        the line's low end). On the H200 pair at 128 requests (twenty-ninth session), where nearly every
        step computes a prompt chunk, the bucket's decode fit held one clean step, of 6.6 ms, where full
        batches took 2.4-3.2: a line from there prices every k below the first measured one as dear as
        that, and no drafts cheaper than it is against them."""
        local = self.local_cost.get(b, _DECODE)
        return (local is not None and local.weight >= _ANCHOR_WEIGHT
                and self.local_cost.fresh(b, _DECODE, self.num_observed))

    def decode_age(self, b: float) -> int | None:
        """Observations since this bucket last measured a plain decode step (None: never)."""
        return self.local_cost.age(b, _DECODE, self.num_observed)

    def samples(self, b: float, k: int) -> int:
        """How many verify steps of k this bucket measured lately."""
        return self.local_cost.samples(b, k, self.num_observed)

    def catches_up(self) -> bool:
        """Whether the proposer pays extra after a step without drafts (a draft model feeding the tokens
        it skipped; n-gram lookups do not), as far as measured; unknown counts as yes."""
        return self.cold_extra is None or self.cold_extra > _CATCH_UP_EXTRA

    def catch_up_seconds(self, tokens: float | None, warm: float, b: float | None = None) -> float:
        """A cold proposal's cost beyond a warm one (`warm`) when the proposer has not seen `tokens`, at
        batch size b: that bucket's own fit where it has one, else the fit over every batch size. Far
        beyond the token counts a fit has seen, no less than the ratio of cold to warm proposals measured,
        nor (from _LARGE_CATCH_UP tokens) than large catch-ups took per token: where requests come and go
        a fit learns mostly from prompt feeds of a few hundred tokens, and extrapolated to a pause's
        catch-up it says ~0. On the H200 pair at 128 requests (twenty-first session) one of 44,880 tokens
        was priced 0.0 ms and took 177 ms."""
        ratio = (self.cold_extra if self.cold_extra is not None else _COLD_EXTRA_GUESS) * warm
        if tokens is None:
            return ratio
        # Beyond the fits' data, no less than what large catch-ups measured per token: on the H200 pair
        # (twenty-third session) catch-ups of 27k, 68k and 137k tokens took 26, 62 and 141 ms (~1 us a
        # token), and the last, at 256 requests, had been priced 24 ms.
        seconds, counted = self._large_catch_ups
        floor = max(ratio, tokens * seconds / counted) if counted > 0 and tokens >= _LARGE_CATCH_UP else ratio
        local = self.local_catch_up.get(b, 0) if b is not None else None
        if local is not None:
            fit, t = local, local.predict((1.0, tokens))
        else:
            fit, found = self.catch_up_cost, self.catch_up_cost.predict_many([(1.0, tokens)])
            if found is None:
                return floor
            t = found[0]
        t = max(t, 0.0)
        return t if tokens <= _CATCH_UP_REACH * fit.max_x else max(t, floor)

    def prompt_feed_seconds(self) -> float:
        """What feeding new requests' prompts to the proposer (a draft model catches up on them at its
        first proposal after each prompt chunk) costs per output token, at the arrival rate measured: a
        recurring cost of drafting where requests come and go, which the warm proposal fits leave out.
        0 until a proposal after prompt chunks was measured (drafting through an arrival measures it)."""
        steps, prompt, out = self._prompts
        t = self.prompt_feed_cost.predict_many([(1.0, prompt / steps)]) if steps > 1e-3 and out > 0.0 else None
        return 0.0 if t is None else steps * max(t[0], 0.0) / out

    def prompt_tokens_per_output(self) -> float:
        """Prompt tokens computed per output token, over the arrivals window: what the requests that replace
        finished ones ask of a step's token budget for each token the batch makes (0 before any)."""
        _, prompt, out = self._prompts
        return prompt / out if out > 0.0 else 0.0

    # -- observations -------------------------------------------------------------------------
    def observe(self, step: SpecStepStats, cold: bool, after_prompt: bool, unseen: float | None) -> None:
        """One finished step and the proposal it verified (cold, after_prompt, unseen: as when chosen)."""
        p = step.proposal
        self.num_observed += 1
        self._observe_step(step, p, *self._timed(step, p))
        if p is not None and p.num_seqs > 0 and p.num_speculative_tokens > 0:
            self._observe_proposal(p, cold, after_prompt, unseen)
        elif p is not None:
            self._record_unpaired_cold(self._last_cold)
            self._last_cold = None
        self._count_unseen(step, p)

    def observe_apart(self, prompt_tokens: int, new_prompts: int) -> None:
        """A step of prompt pieces alone (scheduler/scheduler.py prefill_apart), beside a decoding batch
        that waits: it verifies nothing, so it is no observation of its own. Its time is no later step's
        price, and the next step's timer may also cover its forward (asynchronous scheduling waits for it
        there; a synchronous step apart samples nothing, so its forward may still run when the next step
        starts): that step prices nothing. Its prompt tokens still count as the next step's prompt chunks
        (arrivals, and what a draft model has not seen), and each prompt it started as one arrival.

        On the H200 pair at concurrency 32 (twenty-first session) steps apart went unobserved: the decode
        steps after them carried their forwards, a decode step was priced 2.87 ms where it took ~2.1, and
        the controller drafted at 0.83 of no drafting."""
        tokens, started = self._apart
        self._apart = (tokens + prompt_tokens, started + new_prompts)
        # A choice made now follows prompt chunks: its proposal feeds them to a draft model first (kept
        # out of the bucket's warm fits), and the batch is filling (batch_growth.py). Left to the next
        # observed step, the flag would say what the step before the pieces did.
        self.after_prompt = True
        self._observed_at = self.clock()  # the next step's interval starts here
        self._prev_plain = None  # (so no host time of the interval is charged to the next step)
        self._ahead_seconds = 0.0  # (a proposal made before this is not in the next interval)

    def _timed(self, step: SpecStepStats, p: ProposalStats | None) -> tuple[bool, float]:
        """(whether a step without drafts was timed to its end, the host time since the last observation
        that no timer covered). The latter only if this step and the one before ran the same way (both
        drafting or both not), else 0: a switch's own cost, draining the overlapped step in flight, is
        no step's price.

        With asynchronous scheduling (engine/overlap.py) a step without drafts is timed while the
        forward of the next one runs, except the first one after a step that ran synchronously (one
        with a proposal of k > 0, the first after the engine idled): timed when its forward is
        launched, it looks several times cheaper than it is, and its forward's time lands in the
        unmeasured gap before the next step. So a plain decode step is a measurement only if the step
        before it was one too and neither follows a pause (time between observations that neither step
        nor proposal accounts for, beyond a step's worth: the engine had nothing to run)."""
        now = self.clock()
        since, self._observed_at = (None if self._observed_at is None else now - self._observed_at), now
        # An observation made late (step.ahead_seconds) comes after the next proposal's host work, which is
        # then in this interval and not in the next; this step's own proposal's was in the interval before.
        ahead, self._ahead_seconds = step.ahead_seconds - self._ahead_seconds, step.ahead_seconds
        unexplained = (0.0 if since is None
                       else since - step.step_seconds - (p.seconds if p is not None else 0.0) - ahead)
        paused = unexplained > max(PAUSE_S, step.step_seconds)
        self.last_unexplained = None if since is None else unexplained
        if paused and self.unseen_tokens is not None:
            self.unseen_tokens = 0.0  # the engine idled: nothing ran, so every request now running is new
        plain = step.plain
        same_way = not paused and self._prev_plain is plain
        if plain and same_way and since is not None and step.batch_size > 0:
            # (not the first plain step after drafting: timed at its launch, its forward lands in the next)
            self.plain_steps.add(step.batch_size, step.step_seconds + max(unexplained, 0.0), self.num_observed)
        timed, self._prev_timed, self._prev_plain = self._prev_timed and not paused, plain and not paused, plain
        return timed, (max(unexplained, 0.0) if same_way else 0.0)

    def _observe_step(self, step: SpecStepStats, p: ProposalStats | None, timed: bool, untimed: float) -> None:
        decode = step.batch_size + step.num_draft_tokens  # one token per request, plus its drafts
        prefill = max(step.num_batched_tokens - decode, 0)  # the rest: prompt chunks
        after_apart = self._apart[0] > 0  # (_count_unseen takes the pieces' tokens after this)
        after_prompt, self.after_prompt = self.after_prompt, prefill > 0 or after_apart
        if step.step_seconds <= 0 or step.num_batched_tokens <= 0 or after_apart:
            return
        x = (1.0, float(decode), float(prefill))
        if step.num_draft_tokens > 0:
            k = p.num_speculative_tokens if p is not None and p.num_speculative_tokens > 0 else self.max_k
            k = min(k, self.max_k)
            # A run of steps costs, per step, the interval between two observations: host work outside
            # the step's and the proposal's timers counts too. Overlapped steps hide some (the engine
            # loop, the controller's own choice): ~0.07 of a 1.24 ms step at the H200 pair's concurrency
            # 1 (timed 1.17 ms), enough to tie no drafts with k = 4, which measured 10% faster there.
            # Synchronous steps' timers left ~nothing out (fixed k = 4: 5.01 ms timed, 4.98 per TPOT).
            y = step.step_seconds + untimed
            self.verify_cost.add(x, y)
            self.verify_cost_by_k[k].add(x, y)
            self.local_cost.add(step.batch_size, k, x, y, self.num_observed)
        elif timed and not after_prompt:
            # Not a step right after one with prompt chunks: with asynchronous scheduling a plain step's
            # timer also waits for the step before it to finish on the GPU, and an eager prompt step's
            # tail can be several ms. A few such samples skew a bucket's decode fit for as long as it
            # stays fresh (on the H200 pair, nineteenth session, the fit at batch 17-32 said 4.76 ms where
            # a decode step took 1.92; that point's warm-up had just brought 32 new requests at once).
            y = step.step_seconds + untimed  # (see above)
            self.decode_cost.add(x, y)
            self.pure_decode_weight = self.pure_decode_weight * self._keep + (1.0 if prefill == 0 else 0.0)
            if prefill == 0:  # a bucket's decode fit: plain decode steps only (it cannot tell prompt chunks apart)
                self.local_cost.add(step.batch_size, _DECODE, x, y, self.num_observed, restart_ratio=_DECODE_RESTART)

    def _observe_proposal(self, p: ProposalStats, cold: bool, after_prompt: bool, unseen: float | None) -> None:
        """The fits over every batch size take every warm proposal; a bucket's own fit not those right
        after a prompt chunk either (a draft model then first feeds the new prompts: a one-off when a
        load starts, priced by the fit over every size where it is the rule). What catching up costs:
        a cold proposal against the warm one right after it (an exploration burst), a warm one after
        prompt chunks against this bucket's own fit; the latter is also what feeding a prompt costs
        (prompt_feed_cost: drafting's recurring price where requests come and go). Proposals are keyed
        by their depth, not the k chosen: near the output budget's end a k = 12 proposal ran 1-5 draft
        forwards (0.4-3 ms against 7-10), which, as k = 12 and weighted as relative errors, dragged its fits
        down and flattened the pooled fit's slope (on the H200 pair every k <= 10 was priced alike)."""
        k, b = min(p.depth, self.max_k), p.num_seqs
        last_cold, self._last_cold = self._last_cold, None
        if not cold and not after_prompt and last_cold is not None and last_cold[0] == k:
            self._add_cold_extra(last_cold[1], p.seconds)
            if last_cold[2]:
                self._add_catch_up(b, last_cold[2], max(last_cold[1] - p.seconds, 1e-6))
        else:
            self._record_unpaired_cold(last_cold)
            if not cold and after_prompt and unseen:
                local = self.local_propose.get(float(b), k)
                if local is not None:
                    fed = max(p.seconds - local.predict((1.0, float(b))), 1e-6)
                    self._add_catch_up(b, unseen, fed)
                    self.prompt_feed_cost.add((1.0, unseen), fed)
        if cold:  # (after a prompt chunk too: its unseen tokens hold the prompt; at high load every step has one)
            self._last_cold = (k, p.seconds, unseen, b)
        if not cold or not self.catches_up():
            self.propose_cost.add((1.0, k, k * b, b), p.seconds)
            if not after_prompt:
                self.local_propose.add(b, k, (1.0, float(b)), p.seconds, self.num_observed)

    def _record_unpaired_cold(self, cold: tuple[int, float, float | None, int] | None) -> None:
        """A cold proposal that no warm one of its k followed (drafting stopped again at once: an
        exploration, a catch-up that turned out dear): its catch-up against the warm fits' prediction
        for its k and batch, which is all there is to price it by. Dropped, the costliest catch-ups (the
        ones after which the controller stops drafting) would never be measured. The ratio of cold to
        warm takes it too: where every warm proposal follows a prompt chunk (many requests), no pair is
        clean, and a ratio measured once at the start (a first proposal that had nothing to catch up on,
        say) would otherwise say for good that the proposer does not catch up (catches_up), so no
        exploration would be charged its catch-up."""
        if cold is None or not cold[2]:
            return
        k, seconds, unseen, b = cold
        warm = self._warm_proposals(float(b))[k - 1]
        if warm is not None:
            self._add_catch_up(b, unseen, max(seconds - max(warm[0], 0.0), 1e-6))
            self._add_cold_extra(seconds, warm[0])

    def _add_cold_extra(self, cold_s: float, warm_s: float) -> None:
        extra = min(cold_s / warm_s - 1.0, 10.0) if warm_s > 1e-7 else 0.0
        self.cold_extra = extra if self.cold_extra is None else 0.5 * (self.cold_extra + extra)

    def _add_catch_up(self, b: int, unseen: float, seconds: float) -> None:
        self.catch_up_cost.add((1.0, unseen), seconds)
        self.local_catch_up.add(b, 0, (1.0, unseen), seconds, self.num_observed)
        if unseen >= _LARGE_CATCH_UP:
            s, n = self._large_catch_ups
            self._large_catch_ups = (s * _LARGE_KEEP + seconds, n * _LARGE_KEEP + unseen)

    def _count_unseen(self, step: SpecStepStats, p: ProposalStats | None) -> None:
        """Tokens a draft model would have to catch up on: those computed since it last drafted, less
        those of requests that finished since (the share of the batch replaced per step is estimated
        from how often a step computes a prompt chunk: new requests)."""
        (apart_tokens, apart_started), self._apart = self._apart, (0, 0)
        prefill = max(step.num_batched_tokens - step.batch_size - step.num_draft_tokens, 0)
        # a step's own prompt chunk is one arrival (or a chunk of one); pieces apart count the prompts they started
        arrived = 1.0 if prefill > 0 or apart_started > 0 else 0.0
        prefill += apart_tokens
        self._arrivals += (arrived - self._arrivals) / self._arrivals_window
        keep = 1.0 - 1.0 / self._arrivals_window
        steps, prompt, out = self._prompts
        self._prompts = (steps * keep + arrived, prompt * keep + prefill,
                         out * keep + step.batch_size + sum(step.accepted_per_pos))
        if p is not None and p.num_speculative_tokens > 0 and p.num_seqs > 0:
            # the proposal fed the proposer everything before this step; of this step, the next warm
            # proposal feeds the accepted tokens, not the prompt chunks
            self.unseen_tokens = float(prefill)
        elif self.unseen_tokens is not None:
            turnover = min(self._arrivals / max(step.batch_size, 1), 1.0)
            # A batch that shrank lost requests that nothing replaced, and their unseen tokens with them
            # (a share each). Counted on, a catch-up at 4 requests after a spell at 16 was priced as feeding
            # all 16 requests' tokens, 4x what it costs, and no exploration from k = 0 fit the budget again
            # (a simulated pair, tests/unit/test_adaptive_worlds.py: 600 choices of no drafts where K won).
            shrink = min(step.batch_size / self._counted_batch, 1.0) if self._counted_batch > 0 else 1.0
            self.unseen_tokens = (self.unseen_tokens * (1.0 - turnover) * shrink
                                  + step.num_batched_tokens + apart_tokens)
        self._counted_batch = step.batch_size
