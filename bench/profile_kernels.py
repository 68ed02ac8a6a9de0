"""Kernel-level breakdown of one batch-1 decode graph replay (torch profiler), per kernel name."""
from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from specserve import LLM, SamplingParams


def main(shape: str = "qwen2.5-1.5b", trace: str | None = None) -> None:
    """trace: also write a Chrome trace of 3 steps there (kernel order and gaps, for a per-layer view)."""
    llm = LLM(model=shape, load_format="dummy", max_model_len=4096, max_num_seqs=32, progress=False,
              gpu_memory_utilization=0.5)
    eng = llm.engine
    eng.add_request("p", {"prompt_token_ids": list(range(100, 228))},
                    SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    for _ in range(20):
        eng.step()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    if trace:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                eng.step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(trace)


if __name__ == "__main__":
    main(*sys.argv[1:3])
