"""Where a speculating engine's first catch-ups stall: eager forwards over a chunk of new tokens
after some context, timed the first and the second time each chunk size runs.

The H200 pair sweep (2026-11-30) measured the adaptive controller's first run at concurrency 1 at 373
tok/s against 802-855 for its later runs: its k = 4 proposals averaged 6.9 ms against 2.8 ms warm,
and they alone (the fixed-k policies never pause drafting) feed the draft model the tokens it skipped,
in eager forwards of every chunk size. This probe times such forwards directly, on the draft model
and the target, for one or several sequences at once (`--batches`: a catch-up after a pause feeds
every running request), so a first-use cost (JIT, cuBLAS heuristics, allocator growth) shows as
first >> second; every Triton compile after start-up is logged with its kernel and constexprs, also
through adaptive engine runs at concurrency 1 and 4.

    python3 bench/catch_up_probe.py [--model M --draft D] [--contexts 200,600] [--sizes 3,5,...] [--batches 1,4]
        [--old-warm-up] [--no-engine-runs] [--load-format dummy]
    SPECSERVE_CATCH_UP_GRAPHS=0 python3 bench/catch_up_probe.py ...  # the draft without catch-up graphs (A/B)
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve import LLM  # noqa: E402
from specserve.kv.manager import KVCacheManager  # noqa: E402
from specserve.runner.model_runner import ModelRunner  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
from specserve.scheduler.request import Request  # noqa: E402
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402

from compile_log import log_compiles  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def chunk_after_context(runner: ModelRunner, context: int, new: int, tag: str, batch: int = 1) -> float:
    """Seconds of one forward of `new` tokens of each of `batch` sequences whose first `context` tokens
    (context + 7 * i for sequence i, so lengths differ) are in the KV (computed by a forward before,
    untimed), over a throwaway block table of the runner's pool."""
    contexts = [context + 7 * i for i in range(batch)]
    blocks = sum(-(-(c + new) // runner.block_size) + 1 for c in contexts)
    kv = KVCacheManager(min(runner.num_blocks, blocks), runner.block_size, enable_prefix_caching=False)
    reqs = []
    for i, c in enumerate(contexts):
        req = Request(f"probe-{tag}-{context}-{new}-{i}", [1] * (c + new), SamplingParams(max_tokens=1), 1)
        kv.allocate_slots(req, c + new)
        reqs.append(req)
    ModelRunner.execute(runner, SchedulerOutput([ScheduledRequest(r, c, 0) for r, c in zip(reqs, contexts)],
                                                sum(contexts)), kv.block_ids)
    for r, c in zip(reqs, contexts):
        r.num_computed_tokens = c
    _sync(runner.device)
    start = time.perf_counter()
    ModelRunner.execute(runner, SchedulerOutput([ScheduledRequest(r, new, 0) for r in reqs], new * batch), kv.block_ids)
    _sync(runner.device)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--load-format", default="auto", help="dummy: random weights of a shape name (qwen2.5-1.5b)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", default="200,600", help="600: past 2 x MIN_KEYS_PER_SPLIT (split-KV launches)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--sizes", default="3,5,8,9,10,12,16,17,24,33,64,128")
    p.add_argument("--old-warm-up", action="store_true",
                   help="start-up forwards as before 2026-11-30's ninth session: GEMV row counts only, fresh sequences")
    p.add_argument("--batches", default="1", help="sequences per chunk forward (a catch-up of several requests)")
    p.add_argument("--no-engine-runs", action="store_true", help="skip the adaptive engine runs at the end")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.old_warm_up:
        import specserve.runner.warmup as warmup
        from specserve.model.layers.triton_gemv import gemv_max_m

        warmup.warm_start_up = lambda runner: warmup.warm_small_forwards(runner, gemv_max_m())
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 4}
    t = time.perf_counter()
    llm = LLM(model=args.model, progress=False, device=args.device, max_model_len=args.max_model_len,
              max_num_seqs=max(8, *(int(b) for b in args.batches.split(","))), load_format=args.load_format,
              enable_prefix_caching=False, speculative_config=spec, kv_cache_memory_bytes=1 << 30)
    print(f"engine built in {time.perf_counter() - t:.1f} s", flush=True)
    runners = {"draft": llm.engine.spec.proposer.runner, "target": llm.engine.runner}
    compiles: list[str] = []  # every Triton compile from here on: a stall's kernel

    def report(kernel: str) -> None:
        compiles.append(kernel)
        print(f"    compile: {kernel}", flush=True)

    log_compiles(report)
    rows = []
    for name, runner in runners.items():
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                if context + 7 * batch + max(sizes) >= args.max_model_len:
                    continue
                for n in sizes:
                    before = len(compiles)
                    first = chunk_after_context(runner, context, n, f"{name}a", batch)
                    second = chunk_after_context(runner, context, n, f"{name}b", batch)
                    rows.append({"runner": name, "batch": batch, "context": context, "new": n,
                                 "first_ms": first * 1e3, "second_ms": second * 1e3,
                                 "compiles": compiles[before:]})
                    flag = "  <- first use" if first > 2 * second + 0.005 else ""
                    print(f"{name:6} batch {batch} context {context:4} + {n:4} tokens: first {first * 1e3:8.2f} ms, "
                          f"second {second * 1e3:8.2f} ms{flag}", flush=True)
    if args.no_engine_runs:
        Path(args.out, "catch_up_probe.json").write_text(json.dumps(rows, indent=1))
        return
    # The same through the engine: the adaptive controller at concurrency 1, twice
    params = SamplingParams(temperature=0.0, max_tokens=min(256, args.max_model_len // 2), ignore_eos=True)
    prompt_len = min(150, args.max_model_len // 4)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 10 for j in range(prompt_len)]} for i in range(4)]
    for run in range(2):
        for together in (False, True):  # concurrency 1, then all four at once (catch-ups of 4 sequences)
            before = len(compiles)
            t = time.perf_counter()
            for group in ([prompts] if together else [[pr] for pr in prompts]):
                llm.generate(group, params)
            s = time.perf_counter() - t
            rate = len(prompts) * params.max_tokens / s
            c = len(prompts) if together else 1
            print(f"adaptive, concurrency {c}, run {run + 1}: {rate:.1f} tok/s, "
                  f"{len(compiles) - before} compiles", flush=True)
            rows.append({"run": run + 1, "concurrency": c, "tokens_per_s": rate, "compiles": compiles[before:]})
    Path(args.out, f"catch_up_probe{'_old' if args.old_warm_up else ''}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
