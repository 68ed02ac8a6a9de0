"""spec/train_timing.StepTimes: a training run's seconds per step, by batch shape."""
from __future__ import annotations

import torch

from specserve.train import timing as train_timing
from specserve.train.timing import StepTimes


def test_step_times_by_length(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(train_timing.time, "monotonic", lambda: clock[0])
    times = StepTimes(torch.device("cpu"))
    # (sequences, padded length, seconds the step takes): short batches fast, long ones slow.
    steps = [(32, 200, 0.1), (16, 500, 0.2), (32, 250, 0.1), (4, 2000, 0.8), (16, 400, 0.3)]
    for seqs, length, seconds in steps:
        times.start(seqs, length)
        clock[0] += seconds
        times.end()
    clock[0] += 30.0  # a checkpoint after the last step is not part of it
    out = times.summary()
    assert out["steps"] == 5 and out["first_steps_s"] == [0.1, 0.2, 0.1, 0.8, 0.3]
    assert out["wall_s_max"] == 0.8 and "gpu_s_mean" not in out  # no CUDA events on the CPU
    assert out["by_length"] == {"<=256": {"steps": 2, "seqs": 32.0, "wall_s": 0.1},
                                "<=512": {"steps": 2, "seqs": 16.0, "wall_s": 0.25},
                                "<=2048": {"steps": 1, "seqs": 4.0, "wall_s": 0.8}}
    assert list(out["by_length"]) == ["<=256", "<=512", "<=2048"]  # ordered by length
    assert StepTimes(torch.device("cpu")).summary() == {}


class _Event:
    """A recorded CUDA event's stand-in: elapsed_time as torch.cuda.Event gives it (ms)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, later: "_Event") -> float:
        return later.ms - self.ms


def test_gpu_time_by_phase() -> None:
    times = StepTimes(torch.device("cpu"))
    # Two steps: target 100 / 140 ms, head forward 20 / 20, backward 50 / 70 (ms of GPU time).
    for start, marks in ((0.0, (100.0, 120.0, 170.0)), (500.0, (640.0, 660.0, 730.0))):
        times._events.append((_Event(start), _Event(marks[-1])))
        times._phases.append([(name, _Event(ms)) for name, ms in zip(("target", "head_forward", "backward"), marks)])
    assert times._by_phase() == {"target": 0.12, "head_forward": 0.02, "backward": 0.06}
