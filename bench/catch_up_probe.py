"""Where a speculating engine's first catch-ups stall: eager forwards over a chunk of new tokens
after some context, timed the first and the second time each chunk size runs.

The H200 pair sweep (2026-11-30) measured the adaptive controller's first run at concurrency 1 at 373
tok/s against 802-855 for its later runs: its k = 4 proposals averaged 6.9 ms against 2.8 ms warm,
and they alone (the fixed-k policies never pause drafting) feed the draft model the tokens it skipped,
in eager forwards of every chunk size. This probe times such forwards directly, on the draft model
and the target, so a first-use cost (JIT, cuBLAS heuristics, allocator growth) shows as first >> second.

    python3 bench/catch_up_probe.py [--model M --draft D] [--contexts 200,600] [--sizes 3,5,...] [--old-warm-up]
    python3 bench/catch_up_probe.py --device cpu --model <tiny dir> --draft <tiny dir> --sizes 3,17 \
        --contexts 40,300 --max-model-len 512  # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve import LLM  # noqa: E402
from specserve.kv.manager import KVCacheManager  # noqa: E402
from specserve.runner.model_runner import ModelRunner  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
from specserve.scheduler.request import Request  # noqa: E402
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def chunk_after_context(runner: ModelRunner, context: int, new: int, tag: str) -> float:
    """Seconds of one forward of `new` tokens of a sequence whose first `context` tokens are in the KV
    (computed by a forward before, untimed), over a throwaway block table of the runner's pool."""
    total = context + new
    blocks = -(-total // runner.block_size) + 1
    kv = KVCacheManager(min(runner.num_blocks, blocks), runner.block_size, enable_prefix_caching=False)
    req = Request(f"probe-{tag}-{context}-{new}", [1] * total, SamplingParams(max_tokens=1), 1)
    kv.allocate_slots(req, total)
    ModelRunner.execute(runner, SchedulerOutput([ScheduledRequest(req, context, 0)], context), kv.block_ids)
    req.num_computed_tokens = context
    _sync(runner.device)
    start = time.perf_counter()
    ModelRunner.execute(runner, SchedulerOutput([ScheduledRequest(req, new, 0)], new), kv.block_ids)
    _sync(runner.device)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", default="200,600", help="600: past 2 x MIN_KEYS_PER_SPLIT (split-KV launches)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--sizes", default="3,5,8,9,10,12,16,17,24,33,64,128")
    p.add_argument("--old-warm-up", action="store_true",
                   help="start-up forwards as before 2026-11-30's ninth session: GEMV row counts only, fresh sequences")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.old_warm_up:
        import specserve.runner.warmup as warmup
        from specserve.model.layers.triton_gemv import gemv_max_m

        warmup.warm_start_up = lambda runner: warmup.warm_small_forwards(runner, gemv_max_m())
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 4}
    t = time.perf_counter()
    llm = LLM(model=args.model, progress=False, device=args.device, max_model_len=args.max_model_len, max_num_seqs=8,
              enable_prefix_caching=False, speculative_config=spec, kv_cache_memory_bytes=1 << 30)
    print(f"engine built in {time.perf_counter() - t:.1f} s", flush=True)
    runners = {"draft": llm.engine.spec.proposer.runner, "target": llm.engine.runner}
    rows = []
    for name, runner in runners.items():
        for context in (int(c) for c in args.contexts.split(",")):
            if context + max(sizes) >= args.max_model_len:
                continue
            for n in sizes:
                first = chunk_after_context(runner, context, n, f"{name}a")
                second = chunk_after_context(runner, context, n, f"{name}b")
                rows.append({"runner": name, "context": context, "new": n, "first_ms": first * 1e3,
                             "second_ms": second * 1e3})
                flag = "  <- first use" if first > 2 * second + 0.005 else ""
                print(f"{name:6} context {context:4} + {n:4} tokens: first {first * 1e3:8.2f} ms, "
                      f"second {second * 1e3:8.2f} ms{flag}", flush=True)
    # The same through the engine: the adaptive controller at concurrency 1, twice
    params = SamplingParams(temperature=0.0, max_tokens=min(256, args.max_model_len // 2), ignore_eos=True)
    prompt_len = min(150, args.max_model_len // 4)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 10 for j in range(prompt_len)]} for i in range(4)]
    for run in range(2):
        t = time.perf_counter()
        for pr in prompts:
            llm.generate([pr], params)
        s = time.perf_counter() - t
        rate = len(prompts) * params.max_tokens / s
        print(f"adaptive, concurrency 1, run {run + 1}: {rate:.1f} tok/s", flush=True)
        rows.append({"run": run + 1, "tokens_per_s": rate})
    Path(args.out, f"catch_up_probe{'_old' if args.old_warm_up else ''}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
