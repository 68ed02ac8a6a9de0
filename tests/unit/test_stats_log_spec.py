"""The periodic stats log line with speculation: it reports the acceptance rate and vLLM's mean
acceptance length, 1 + accepted / drafts (each verify step emits its accepted drafts plus one
target token), over the interval since the last line (not since start), and says nothing about
speculation while nothing was drafted."""

from __future__ import annotations

import logging
import re

import pytest

from specserve.metrics.log import StatsLogger
from specserve.metrics.stats import StatsCollector

_SPEC = re.compile(r", Spec decode: acceptance rate (\d+\.\d)%, mean acceptance length (\d+\.\d\d)$")


class _Clock:
    """A settable clock, so throughputs and intervals do not depend on the test's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _logger() -> tuple[StatsCollector, StatsLogger, _Clock]:
    stats, clock = StatsCollector(), _Clock()
    return stats, StatsLogger(stats, clock=clock), clock


def _step(stats: StatsCollector, drafts: int, draft_tokens: int, accepted: int, generated: int) -> None:
    """What the engine and SpecDecoder add over an interval (counters only grow)."""
    stats.inc("generation_tokens_total", generated)
    stats.inc("spec_decode_num_drafts_total", drafts)
    stats.inc("spec_decode_num_draft_tokens_total", draft_tokens)
    stats.inc("spec_decode_num_accepted_tokens_total", accepted)


def _spec_part(line: str | None) -> tuple[float, float]:
    """(acceptance rate %, mean acceptance length) from the line's tail; fails if absent."""
    assert line is not None
    match = _SPEC.search(line)
    assert match, line
    return float(match.group(1)), float(match.group(2))


def test_mean_acceptance_length_is_one_plus_accepted_per_draft() -> None:
    stats, logger, clock = _logger()
    # 10 drafts of 3 tokens, 25 of 30 accepted: each draft emits its accepted tokens plus the
    # target's own, 35 tokens in 10 steps, so 3.5 tokens per step (vLLM: 1 + 25 / 10).
    _step(stats, drafts=10, draft_tokens=30, accepted=25, generated=35)
    clock.now = 5.0
    line = logger.line()
    assert line is not None and line.startswith(
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 7.0 tokens/s"
    )
    assert line.endswith(", Spec decode: acceptance rate 83.3%, mean acceptance length 3.50")
    assert _spec_part(line) == (83.3, 3.5)


def test_mean_acceptance_length_is_per_interval_not_cumulative() -> None:
    stats, logger, clock = _logger()
    _step(stats, drafts=10, draft_tokens=30, accepted=25, generated=35)
    clock.now = 10.0
    assert _spec_part(logger.line()) == (83.3, 3.5)
    # The next interval drafts badly: 4 drafts, 2 of 12 tokens accepted. Cumulative figures would
    # be 27/42 = 64.3% and 1 + 27/14 = 2.93; the interval's are 16.7% and 1.50.
    _step(stats, drafts=4, draft_tokens=12, accepted=2, generated=6)
    clock.now = 20.0
    assert _spec_part(logger.line()) == (16.7, 1.5)
    # Nothing accepted at all: every step emitted only the target's token.
    _step(stats, drafts=8, draft_tokens=8, accepted=0, generated=8)
    clock.now = 30.0
    assert _spec_part(logger.line()) == (0.0, 1.0)
    # Everything accepted, k = 4: five tokens per step.
    _step(stats, drafts=3, draft_tokens=12, accepted=12, generated=15)
    clock.now = 40.0
    assert _spec_part(logger.line()) == (100.0, 5.0)


def test_no_spec_part_without_drafts() -> None:
    stats, logger, clock = _logger()
    # Speculation off: only generation counters move.
    stats.inc("prompt_tokens_total", 40)
    stats.inc("generation_tokens_total", 20)
    stats.set("num_requests_running", 1)
    clock.now = 10.0
    line = logger.line()
    assert line is not None and "Avg generation throughput: 2.0 tokens/s" in line
    assert "Spec" not in line and "acceptance" not in line
    # Speculation on, but an interval without drafts (k = 0 chosen, or only prefills) after one with
    # them: the earlier interval's figures are not repeated, and there is no 0/0 to print.
    stats.inc("spec_decode_num_accepted_tokens_per_pos_total", 0, {"position": "0"})  # SpecDecoder's init
    _step(stats, drafts=2, draft_tokens=4, accepted=4, generated=6)
    clock.now = 20.0
    assert _spec_part(logger.line()) == (100.0, 3.0)
    stats.inc("generation_tokens_total", 5)
    clock.now = 30.0
    line = logger.line()
    assert line is not None and "Avg generation throughput: 0.5 tokens/s" in line
    assert "Spec" not in line and "acceptance" not in line


def test_idle_after_speculation_says_nothing() -> None:
    stats, logger, clock = _logger()
    stats.set("num_requests_running", 1)
    _step(stats, drafts=5, draft_tokens=10, accepted=5, generated=10)
    clock.now = 10.0
    assert _spec_part(logger.line()) == (50.0, 2.0)
    stats.set("num_requests_running", 0)
    clock.now = 20.0
    line = logger.line()  # the first idle interval is reported once, without stale spec figures
    assert line is not None and "Spec" not in line
    clock.now = 30.0
    assert logger.line() is None


def test_maybe_log_writes_the_spec_line(caplog: pytest.LogCaptureFixture) -> None:
    stats, clock = StatsCollector(), _Clock()
    logger = StatsLogger(stats, logger=logging.getLogger("specserve.stats.test"), clock=clock)
    _step(stats, drafts=10, draft_tokens=30, accepted=25, generated=35)
    clock.now = 1.0
    with caplog.at_level(logging.INFO, logger="specserve.stats.test"):
        logger.maybe_log()
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert _spec_part(caplog.records[0].getMessage()) == (83.3, 3.5)


def test_line_from_a_real_speculating_engine(tiny_llama_dir) -> None:
    """The counters SpecDecoder really writes give the line its figures: a model drafting for
    itself has every draft accepted, so the rate is 100% and the length is above 1."""
    from specserve import LLM, SamplingParams

    k = 3
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={
            "method": "draft_model",
            "model": str(tiny_llama_dir),
            "num_speculative_tokens": k,
            "adaptive": False,
        },
    )
    clock = _Clock()
    logger = StatsLogger(llm.engine.stats, clock=clock)
    llm.generate(["alpha beta gamma"], SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True))
    clock.now = 1.0
    stats = llm.engine.stats
    drafts = stats.get("spec_decode_num_drafts_total")
    accepted = stats.get("spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted == stats.get("spec_decode_num_draft_tokens_total")
    rate, length = _spec_part(logger.line())
    assert rate == 100.0 and length == round(1 + accepted / drafts, 2) and 1 < length <= k + 1
