"""List the host<->GPU synchronizations inside decode steps (CUDA only).

With asynchronous scheduling a decode step should contain none besides its event waits; any other
(a .tolist(), a copy from pageable memory) makes the host wait for the forward in flight and
brings back the GPU idle time the overlap removes. Uses torch.cuda.set_sync_debug_mode and prints
each distinct call site once.

    python bench/host_syncs.py --model qwen2.5-1.5b --load-format dummy --steps 20

`--spec eagle3|p-eagle|draft_model` lists those of speculative steps instead (a random-weight head, or
`--draft`; `--k` drafts per step): with drafts left on the device (spec/draft_tokens.py) the only
waits should be the drafts' and the sampled tokens' events.
"""
from __future__ import annotations

import argparse
import traceback
import warnings

import torch

from specserve import LLM, SamplingParams


def _spec_config(args) -> dict | None:
    if args.spec == "none":
        return None
    cfg = {"num_speculative_tokens": args.k, "adaptive": False}
    if args.spec == "draft_model":
        return {**cfg, "method": "draft_model", "model": args.draft}
    import tempfile

    from specserve.spec.eagle_head import make_random_head_dir

    slots = {"num_mask_slots": args.k - 1} if args.spec == "p-eagle" else {}
    head = make_random_head_dir(args.model, f"{tempfile.mkdtemp()}/head", "eagle3", load_format=args.load_format,
                                **slots)
    return {**cfg, "method": "eagle3", "model": str(head), "parallel_drafting": args.spec == "p-eagle"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--spec", choices=["none", "eagle3", "p-eagle", "draft_model"], default="none")
    ap.add_argument("--draft", default="qwen2.5-0.5b")
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    llm = LLM(model=args.model, load_format=args.load_format, max_model_len=2048, max_num_seqs=8,
              gpu_memory_utilization=0.5, progress=False, speculative_config=_spec_config(args))
    eng = llm.engine
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 40, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"r{i}", {"prompt_token_ids": list(range(100 + i, 228 + i))}, params)
    for _ in range(10):  # prefill and a few decode steps: compile, warm the allocators
        eng.step()
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack()[:-2][-8:])
        sites[stack] = sites.get(stack, 0) + 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(args.steps):
        eng.step()
    torch.cuda.set_sync_debug_mode("default")
    print(f"async_scheduling={eng.async_scheduling}: {sum(sites.values())} synchronizing calls in "
          f"{args.steps} steps, {len(sites)} call sites")
    for stack, n in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"--- {n}x\n{stack}")


if __name__ == "__main__":
    main()
