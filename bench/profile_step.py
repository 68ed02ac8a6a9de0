"""Where a batch-1 decode step's time goes: cProfile of Engine.step plus CUDA-graph replay time."""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from specserve import LLM, SamplingParams


def main(shape: str = "qwen2.5-1.5b", steps: int = 300) -> None:
    llm = LLM(model=shape, load_format="dummy", max_model_len=4096, max_num_seqs=256, progress=False,
              gpu_memory_utilization=0.5)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 50, ignore_eos=True)
    eng.add_request("p", {"prompt_token_ids": list(range(100, 228))}, params)
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    # Graph replay alone, same batch shape.
    g = eng.runner.graphs
    key = (1, 1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        g.graphs[key].replay()
    end.record()
    torch.cuda.synchronize()
    print(f"graph replay alone: {start.elapsed_time(end) / 100:.3f} ms")
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    torch.cuda.synchronize()
    print(f"engine step: {(time.perf_counter() - t) / steps * 1e3:.3f} ms (under cProfile)")
    t = time.perf_counter()
    for _ in range(30):
        eng.step()
    torch.cuda.synchronize()
    print(f"engine step: {(time.perf_counter() - t) / 30 * 1e3:.3f} ms (no profiler)")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main(*sys.argv[1:2])
