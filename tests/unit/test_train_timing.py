"""spec/train_timing.StepTimes: a training run's seconds per step, by batch shape."""
from __future__ import annotations

import torch

from specserve.spec import train_timing
from specserve.spec.train_timing import StepTimes


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
