"""Mixed CUDA graphs on a real model (H200): the same greedy tokens with and without them, and what a
step that carries a new prompt beside decoding requests costs either way.

One engine per setting, built in turn in this process: SPECSERVE_MIXED_GRAPHS=1, 0, then 1 again (the
twenty-second session's run, on then off only, saw the other steps 15% slower with the graphs on: an
order effect, or a cost of the graphs?). Each serves
the same schedule: `--decoding` HumanEval chat prompts decode, and one more prompt arrives every
`--every` steps until `--arrivals` have come, greedy, `--max-tokens` each. Prints, per setting, the
forwards of the target that replayed a mixed graph, replayed another graph or ran eagerly, the mean
wall time of the steps that carried a prompt chunk and of those that did not, and how many requests
gave the same tokens in both settings (with the first differing position of those that did not).

usage: python bench/mixed_graph_check.py [--model qwen2.5-coder-1.5b-instruct] [--decoding 16]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections import Counter
from pathlib import Path

import torch

from specserve import LLM, SamplingParams


def serve(args: argparse.Namespace, prompts: list[list[int]], mixed: bool) -> dict:
    from specserve.runner.cuda_graph import CudaGraphRunner

    os.environ["SPECSERVE_MIXED_GRAPHS"] = "1" if mixed else "0"
    llm = LLM(model=args.model, progress=False, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
              kv_cache_memory_bytes=args.kv_gib << 30, max_model_len=4096)
    eng = llm.engine
    eng.stream_outputs = False
    forwards: Counter = Counter()
    kind = ["none"]  # the last target forward's kind, for the step that issued it
    original = CudaGraphRunner.graph_for

    def spy(self, batch):
        found = original(self, batch)
        if self is eng.runner.graphs:
            forwards["eager" if found is None else "mixed" if len(found[1]) > 2 else "graph"] += 1
            kind[0] = ("eager" if batch.num_tokens <= 1024 else "eager > 1024 tokens") if found is None else (
                "mixed" if len(found[1]) > 2 else "graph")
        return found

    CudaGraphRunner.graph_for = spy
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    try:
        for rnd in range(2):  # a warm-up round (compiles, first replays), then the timed one
            done: dict[str, list[int]] = {}
            for i in range(args.decoding):
                eng.add_request(f"{rnd}d{i}", {"prompt_token_ids": prompts[i]}, params)
            arrived, with_prompt, without = 0, [], []
            by_kind: dict[str, list[float]] = {}
            for step in range(100_000):
                if step and step % args.every == 0 and arrived < args.arrivals:
                    eng.add_request(f"{rnd}a{arrived}", {"prompt_token_ids": prompts[args.decoding + arrived]}, params)
                    arrived += 1
                prompt_step = any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.waiting) or any(
                    r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running)
                sync()
                kind[0] = "none"
                t0 = time.perf_counter()
                for out in eng.step():
                    done[out.request_id[1:]] = list(out.outputs[0].token_ids)
                sync()
                (with_prompt if prompt_step else without).append(time.perf_counter() - t0)
                by_kind.setdefault(kind[0], []).append(time.perf_counter() - t0)
                if arrived == args.arrivals and not eng.has_unfinished_requests():
                    break
            if rnd == 0:
                forwards.clear()
    finally:
        CudaGraphRunner.graph_for = original
    eng.kv.check_integrity()
    result = {"mixed": mixed, "forwards": dict(forwards), "tokens": done,
              "prompt_step_ms": 1e3 * sum(with_prompt) / max(len(with_prompt), 1), "prompt_steps": len(with_prompt),
              "other_step_ms": 1e3 * sum(without) / max(len(without), 1), "other_steps": len(without),
              # a step's wall time by the kind of the target forward it issued: do graphs slow the others?
              "ms_by_forward": {k: [round(1e3 * sum(v) / len(v), 3), len(v)] for k, v in sorted(by_kind.items())}}
    del llm, eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--decoding", type=int, default=16)
    p.add_argument("--arrivals", type=int, default=12)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-gib", type=int, default=4)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = p.parse_args()
    import controller_sweep  # bench/: the sweep's HumanEval chat prompts

    mode = controller_sweep.MODES["pair"]
    ns = argparse.Namespace(humaneval=None)
    prompts = controller_sweep.chat_prompts(args.model, ns, {**mode, "model": args.model})
    runs = [serve(args, prompts, True), serve(args, prompts, False), serve(args, prompts, True)]
    a, b = runs[0]["tokens"], runs[1]["tokens"]
    diff = {}
    for rid in sorted(a):
        if a[rid] != b.get(rid):
            other = b.get(rid, [])
            diff[rid] = next((i for i, (x, y) in enumerate(zip(a[rid], other)) if x != y), min(len(a[rid]), len(other)))
    print("| mixed graphs | forwards (mixed / other graph / eager) | step with a prompt, ms (n) | other step, ms (n) |")
    print("| --- | --- | --- | --- |")
    for r in runs:
        f = r["forwards"]
        print(f"| {'on' if r['mixed'] else 'off'} | {f.get('mixed', 0)} / {f.get('graph', 0)} / {f.get('eager', 0)} | "
              f"{r['prompt_step_ms']:.2f} ({r['prompt_steps']}) | {r['other_step_ms']:.2f} ({r['other_steps']}) |")
    for r in runs:
        print(f"mixed graphs {'on' if r['mixed'] else 'off'}: step ms (n) by the target forward it issued: "
              f"{r['ms_by_forward']}")
    print(f"same greedy tokens: {len(a) - len(diff)} of {len(a)} requests; first differing position: {diff}")
    again = runs[2]["tokens"]
    print(f"mixed graphs on, twice: {sum(again.get(r) == a[r] for r in a)} of {len(a)} requests the same")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "mixed_graph_check.json").write_text(json.dumps(
        {"runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs], "differ": diff}, indent=1))


if __name__ == "__main__":
    main()
