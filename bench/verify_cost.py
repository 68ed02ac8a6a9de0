"""What a verify forward costs against a plain decode forward, per query length (CUDA only).

A speculative step at batch 1 is a target forward over k+1 positions plus the proposer's work; the
step pays only if that forward costs little more than a 1-position decode. This replays the
engine's own captured CUDA graphs (the target's, for query lengths 1..k+1, and the draft model's
q = 1 / 2 graphs) with a realistic context length and times them with CUDA events, then lists the
kernels per query length, q = 1, 2, 4, 5 and k+1 (torch profiler, per replay).

    python bench/verify_cost.py --target qwen2.5-1.5b --draft qwen2.5-0.5b --k 8 --context 400
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from specserve import LLM


def _prime(graphs, bs: int, q: int, context: int) -> None:
    """Batch metadata of bs sequences with `context` tokens each, q of them new; no KV written."""
    graphs._fill_dummy(bs, q)
    graphs.seq_lens[:bs] = context
    graphs.positions[:bs * q] = torch.arange(bs * q, device=graphs.device) % q + context - q


def time_replays(graphs, key: tuple[int, int], context: int, iters: int) -> float:
    """Mean ms per replay of the graph for key = (batch size, query length)."""
    bs, q = key
    _prime(graphs, bs, q, context)
    g = graphs.graphs[key]
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_times(graphs, key: tuple[int, int], context: int, iters: int = 20) -> dict[str, float]:
    """us per replay by kernel name (summed device time; with PDL kernels overlap)."""
    bs, q = key
    _prime(graphs, bs, q, context)
    g = graphs.graphs[key]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        if ev.device_type == DeviceType.CUDA:  # kernels and copies, not host-side events
            out[ev.key[:60]] += (getattr(ev, "device_time_total", None) or ev.cuda_time_total) / iters
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-1.5b")
    ap.add_argument("--draft", default="qwen2.5-0.5b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--k", type=int, default=8, help="the longest draft: target graphs for q = 1 .. k+1")
    ap.add_argument("--context", type=int, default=400, help="tokens each sequence already holds")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k, "adaptive": False}
    llm = LLM(model=args.target, load_format=args.load_format, max_model_len=2048, max_num_seqs=8,
              progress=False, speculative_config=spec, kv_cache_memory_bytes=1 << 30)
    target = llm.engine.runner.graphs
    draft = llm.engine.spec.proposer.runner.graphs
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    res: dict[str, dict] = {"target": {}, "draft": {}, "kernels": {}}
    print(f"{'model':7} {'bs':>3} {'q':>3} {'ms':>7} {'x q=1':>6}")
    for name, graphs in (("target", target), ("draft", draft)):
        for bs in sizes:
            base = None
            for q in sorted(graphs.sizes_by_q):
                key = (bs, q)
                if key not in graphs.graphs:
                    continue
                ms = time_replays(graphs, key, args.context, args.iters)
                base = base or ms
                res[name][f"{bs}x{q}"] = ms
                print(f"{name:7} {bs:3d} {q:3d} {ms:7.3f} {ms / base:6.2f}", flush=True)
    qs = [q for q in (1, 2, 4, 5, args.k + 1) if (1, q) in target.graphs]
    for q in dict.fromkeys(qs):
        res["kernels"][f"q{q}"] = kernel_times(target, (1, q), args.context)
    if len(res["kernels"]) > 1:
        cols = list(res["kernels"])
        last = res["kernels"][cols[-1]]
        names = set().union(*res["kernels"].values())
        print(f"\n{'kernel (target, bs 1), us per replay':60} " + " ".join(f"{c:>8}" for c in cols))
        for name in sorted(names, key=lambda n: -last.get(n, 0))[:30]:
            print(f"{name:60} " + " ".join(f"{res['kernels'][c].get(name, 0):8.1f}" for c in cols))
        print(f"{'total':60} " + " ".join(f"{sum(res['kernels'][c].values()):8.1f}" for c in cols))
    with open(os.path.join(args.out, "verify_cost.json"), "w") as f:
        json.dump({"args": vars(args), **res}, f, indent=1)


if __name__ == "__main__":
    main()
