"""Where a speculative decoding cycle's time goes at batch 1 (CUDA).

For no speculation, a draft model and EAGLE-3 / P-EAGLE heads (random weights are enough: this times
the work, not the acceptance), per engine step:
  * wall ms: plain stepping, nothing instrumented;
  * GPU busy ms: CUDA kernel time from torch.profiler over the same steps (wall - busy = GPU idle);
  * verify ms and propose ms: the target's forward + sampling and the proposer's work, each
    bracketed by torch.cuda.synchronize (so they include their GPU time; a separate pass).

    python bench/spec_profile.py --target qwen2.5-1.5b --draft qwen2.5-0.5b --load-format dummy
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

from specserve import LLM, SamplingParams


def _engine(args, spec: dict | None) -> LLM:
    # An absolute KV budget: engines built one after another in this process see each other's memory.
    return LLM(model=args.target, load_format=args.load_format, max_model_len=2048, max_num_seqs=4,
               progress=False, speculative_config=spec, kv_cache_memory_bytes=1 << 30)


def _start(llm: LLM, n: int) -> None:
    eng = llm.engine
    eng.add_request(f"p{time.monotonic_ns()}", {"prompt_token_ids": list(range(1000, 1128))},
                    SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    for _ in range(3):
        eng.step()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, acc: list[float]):
    def wrapped(*a, **kw):
        _sync()
        t = time.perf_counter()
        out = fn(*a, **kw)
        _sync()
        acc.append(time.perf_counter() - t)
        return out
    return wrapped


def measure(llm: LLM, steps: int, cprofile: bool = False) -> dict:
    eng = llm.engine
    _start(llm, 4 * steps + 64)
    for _ in range(steps // 2):  # warm up
        eng.step()
    _sync()
    t, before = time.perf_counter(), eng.stats.get("generation_tokens_total")
    for _ in range(steps):
        eng.step()
    _sync()
    wall = (time.perf_counter() - t) / steps
    tokens = (eng.stats.get("generation_tokens_total") - before) / steps
    from torch.profiler import ProfilerActivity, profile

    busy = float("nan")
    if torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            _sync()
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / steps  # us -> s
    res = {"wall_ms": wall * 1e3, "tokens_per_step": tokens, "gpu_busy_ms": busy * 1e3}
    verify: list[float] = []
    propose: list[float] = []
    eng.runner.execute = _timed(eng.runner.execute, verify)
    if eng.spec is not None:
        eng.spec.proposer.propose = _timed(eng.spec.proposer.propose, propose)
    for _ in range(steps):
        eng.step()
    res["target_forward_ms"] = 1e3 * sum(verify) / steps
    res["propose_ms"] = 1e3 * sum(propose) / steps
    if cprofile:  # host functions of the plain steps, by own time
        import cProfile
        import pstats

        eng.runner.execute = type(eng.runner).execute.__get__(eng.runner)
        if eng.spec is not None:
            eng.spec.proposer.propose = type(eng.spec.proposer).propose.__get__(eng.spec.proposer)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            eng.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    eng.abort_request(list(eng.groups))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-1.5b")
    ap.add_argument("--draft", default="qwen2.5-0.5b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", default="none,draft_model,eagle3,p-eagle")
    ap.add_argument("--cprofile", default="", help="comma list of configs whose host time to profile")
    ap.add_argument("--eagle-step-graphs", default=None, choices=("auto", "static", "eager"),
                    help="EagleProposer.step_graphs for the head configs (default: the class default)")
    args = ap.parse_args()
    from specserve.spec.eagle_head import make_random_head_dir

    if args.eagle_step_graphs:
        from specserve.spec.eagle import EagleProposer

        EagleProposer.step_graphs = args.eagle_step_graphs
    tmp = tempfile.mkdtemp()
    fmt = args.load_format
    heads = {"eagle3": make_random_head_dir(args.target, f"{tmp}/e3", "eagle3", load_format=fmt),
             "p-eagle": make_random_head_dir(args.target, f"{tmp}/pe", "eagle3", num_mask_slots=args.k - 1,
                                            load_format=fmt)}
    base = {"num_speculative_tokens": args.k, "adaptive": False}
    configs = {"none": None,
               "draft_model": {**base, "method": "draft_model", "model": args.draft},
               "eagle3": {**base, "method": "eagle3", "model": str(heads["eagle3"])},
               "p-eagle": {**base, "method": "eagle3", "model": str(heads["p-eagle"]), "parallel_drafting": True}}
    results = {}
    for name, spec in configs.items():
        if name not in args.configs.split(","):
            continue
        llm = _engine(args, spec)
        results[name] = measure(llm, args.steps, name in args.cprofile.split(","))
        print(name, json.dumps({k: round(v, 3) for k, v in results[name].items()}), flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "spec_profile.json"), "w") as f:
        json.dump({"args": vars(args), "k": args.k, "results": results}, f, indent=1)
    print(f"\n{'config':12} {'wall ms':>8} {'GPU busy':>8} {'idle %':>6} {'target fwd':>10} {'propose':>8}  (k={args.k})")
    for name, r in results.items():
        idle = 100 * (1 - r["gpu_busy_ms"] / r["wall_ms"])
        print(f"{name:12} {r['wall_ms']:8.3f} {r['gpu_busy_ms']:8.3f} {idle:5.1f}% {r['target_forward_ms']:10.3f} "
              f"{r['propose_ms']:8.3f}")


if __name__ == "__main__":
    main()
