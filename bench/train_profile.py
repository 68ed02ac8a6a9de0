"""Where a `train-draft` step's time goes: wall time and padded tokens per second, the GPU-busy
fraction (the profiler's kernel time over the wall time), then torch-profiler tables.

Random target weights of a shape name and random token sequences shaped like the self-distilled
data (a stdlib prompt + a 256-token answer), so it needs no upload; the step's cost does not
depend on the weights' values.

Usage: python bench/train_profile.py [--shape qwen2.5-1.5b] [--method eagle3] [--steps 12]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.spec import train


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _TokenCounter:
    """Counts the padded tokens of the steps (B * L of each batch: host-known shapes, no sync)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.stamps: list[float] = []  # host time at each step's start (no sync: the host's pace)
        self._target_batch = train.target_batch

    def __call__(self, *args, **kwargs):
        self.stamps.append(time.perf_counter())
        out = self._target_batch(*args, **kwargs)
        self.tokens += out[0].numel()
        return out


def _device_time_us(events) -> float:
    """Kernel time in the profile (what the table's "Self CUDA time total" sums)."""
    from torch.autograd import DeviceType

    total = 0.0
    for evt in events:
        if evt.device_type == DeviceType.CUDA and not getattr(evt, "is_user_annotation", False):
            total += getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
    return total


def _data(path: Path, num: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(num):
            n = rng.randint(300, 1024)
            ids = [rng.randrange(100, vocab - 100) for _ in range(n)]
            f.write(json.dumps({"token_ids": ids, "num_prompt_tokens": n - 256}) + "\n")


def _args(shape: str, method: str, out: Path, data: Path, steps: int, extra: list[str]) -> argparse.Namespace:
    return train._parser().parse_args(["--target", shape, "--method", method, "--out", str(out), "--data", str(data),
                                       "--steps", str(steps), "--load-format", "dummy", "--quiet",
                                       "--no-train-state", "--save-every", "100000", *extra])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--method", default="eagle3")
    p.add_argument("--steps", type=int, default=12, help="> 2: the timed run (a 2-step run is subtracted)")
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("extra", nargs="*", help="more train-draft flags (after --)")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    data = tmp / "data.jsonl"
    _data(data, 256, 151000 if "qwen" in a.shape else 32000, 0)
    from specserve import LLM

    llm = LLM(model=a.shape, load_format="dummy", max_model_len=1024, kv_cache_memory_bytes=1 << 22, max_num_seqs=1,
              enforce_eager=True, progress=False)
    loaded = llm.engine.loaded
    # Warm-up run (kernels compile, allocator grows), then a timed one, then a profiled one.
    counter = _TokenCounter()
    train.target_batch = counter
    train.run_training(_args(a.shape, a.method, tmp / "w", data, 2, a.extra), llm=llm)
    _sync()
    # A run's fixed cost (a new head, its init, the final save) is the same for 2 steps as for
    # --steps, so the difference of the two runs' wall times is --steps - 2 training steps.
    def timed(steps: int, name: str):
        counter.tokens = 0
        counter.stamps.clear()
        t = time.perf_counter()
        res = train.run_training(_args(a.shape, a.method, tmp / name, data, steps, a.extra), llm=llm)
        _sync()
        return time.perf_counter() - t, counter.tokens, res

    wall2, tokens2, _ = timed(2, "t2")
    wall, tokens, res = timed(a.steps, "t")
    stamps = counter.stamps
    # Steps 1-2 repeat the warm-up's batch shapes, later steps see new ones (a per-shape cost shows here).
    print("host ms between step starts (timed run):", [round((y - x) * 1e3) for x, y in zip(stamps, stamps[1:])])
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        print(f"allocator: {stats.get('num_alloc_retries', 0)} alloc retries (cudaFree + sync), "
              f"{stats.get('segment.all.allocated', 0)} segments cudaMalloc'ed in all")
    per_step = (wall - wall2) / (a.steps - 2)
    tokens_per_step = (tokens - tokens2) / (a.steps - 2)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0
    print(f"{a.shape} {a.method}: {per_step * 1000:.1f} ms per step (runs of {a.steps} and 2 steps: "
          f"{wall:.2f} / {wall2:.2f} s), {tokens_per_step:.0f} padded tokens per step, "
          f"{tokens_per_step / per_step:.0f} padded tokens/s, {res.num_sequences} sequences, peak {peak:.1f} GiB")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train.run_training(_args(a.shape, a.method, tmp / "p", data, a.profile_steps, a.extra), llm=llm)
        _sync()
    train.target_batch = counter._target_batch
    table = prof.key_averages()
    if torch.cuda.is_available():
        gpu_per_step = _device_time_us(table) / 1e3 / a.profile_steps
        print(f"GPU time {gpu_per_step:.1f} ms per step (profiled run) -> GPU busy {gpu_per_step / (per_step * 1e3):.0%} "
              "of the timed run's wall time")
    del loaded
    print(table.table(sort_by="cuda_time_total", row_limit=35, max_name_column_width=60))
    print(table.table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    sys.exit(main())
