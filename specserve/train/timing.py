"""Where a training run's seconds go, by batch shape: wall time between step starts (host) and GPU
time per step (CUDA events, read once at the end, so no step waits for them). A step never syncs, so
wall time near GPU time means the GPU bounds the run, and wall time well above it means the host
does (or a sync in the loop)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

# Padded-length buckets of the summary (a batch's longest sequence; attention cost grows with it).
LENGTH_BUCKETS = (256, 512, 1024, 2048)


@dataclass
class StepTimes:
    device: torch.device
    walls: list[float] = field(default_factory=list)  # seconds from each step's start to the next one's
    shapes: list[tuple[int, int]] = field(default_factory=list)  # (sequences, padded length) per step
    _events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    # Per step, (phase, event) at the end of each marked phase (CUDA only): GPU time by phase.
    _phases: list[list[tuple[str, torch.cuda.Event]]] = field(default_factory=list)
    _last: float | None = None  # the last step's start
    _last_end: float | None = None  # the last step's end (its work queued)
    _open: torch.cuda.Event | None = None

    def start(self, num_seqs: int, max_len: int) -> None:
        now = time.monotonic()
        if self._last is not None:
            self.walls.append(now - self._last)
        self._last = now
        self.shapes.append((num_seqs, max_len))
        if self.device.type == "cuda":
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
            self._phases.append([])

    def mark(self, phase: str) -> None:
        """The step's work queued so far ends `phase` (the phases of a step follow one another)."""
        if self._open is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._phases[-1].append((phase, ev))

    def end(self) -> None:
        self._last_end = time.monotonic()
        if self._open is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self._events.append((self._open, done))
            self._open = None

    def summary(self) -> dict:
        """Seconds per step: quantiles, the first steps, and per padded-length bucket (steps, mean
        sequences, mean wall, mean GPU)."""
        if self._last is not None:  # the last step: to its end (not to this call, after a checkpoint)
            end = self._last_end if self._last_end is not None and self._last_end >= self._last else time.monotonic()
            self.walls.append(end - self._last)
            self._last = None
        if not self.walls:
            return {}
        gpu: list[float | None] = [None] * len(self.walls)
        if self._events:
            torch.cuda.synchronize(self.device)
            gpu = [a.elapsed_time(b) / 1e3 for a, b in self._events] + [None] * (len(self.walls) - len(self._events))
        q = statistics.quantiles(self.walls, n=10) if len(self.walls) > 1 else [self.walls[0]] * 9
        out: dict = {"steps": len(self.walls), "wall_s_p50": round(q[4], 4), "wall_s_p90": round(q[8], 4),
                     "wall_s_max": round(max(self.walls), 3), "first_steps_s": [round(w, 3) for w in self.walls[:5]]}
        known = [g for g in gpu if g is not None]
        if known:
            out["gpu_s_mean"] = round(sum(known) / len(known), 4)
            out["gpu_s_by_phase"] = self._by_phase()
        buckets: dict[str, list[int]] = {}
        for i, (_, length) in enumerate(self.shapes[:len(self.walls)]):
            name = next((f"<={b}" for b in LENGTH_BUCKETS if length <= b), f">{LENGTH_BUCKETS[-1]}")
            buckets.setdefault(name, []).append(i)
        out["by_length"] = {
            name: {"steps": len(ix), "seqs": round(sum(self.shapes[i][0] for i in ix) / len(ix), 1),
                   "wall_s": round(sum(self.walls[i] for i in ix) / len(ix), 4),
                   **({"gpu_s": round(sum(gpu[i] for i in ix if gpu[i] is not None) / max(1, sum(
                       gpu[i] is not None for i in ix)), 4)} if known else {})}
            for name, ix in sorted(buckets.items(), key=lambda kv: int(kv[0].lstrip("<=>")))}
        return out

    def _by_phase(self) -> dict[str, float]:
        """Mean GPU seconds per step of each marked phase (from the step's start or the previous mark)."""
        sums: dict[str, float] = {}
        counted = 0
        for (begin, _), marks in zip(self._events, self._phases):
            prev = begin
            for phase, ev in marks:
                sums[phase] = sums.get(phase, 0.0) + prev.elapsed_time(ev) / 1e3
                prev = ev
            counted += 1
        return {k: round(v / max(1, counted), 4) for k, v in sums.items()}
