"""Throughput of speculation policies across concurrency: off, each fixed k, and the adaptive controller.

Offline (no server): for each policy one engine is built and warmed up; then for each concurrency c
it generates c requests at once (greedy, `--output-len` tokens each, ignore_eos), so the running
batch is c. Reported: output tokens/s, the n-gram acceptance measured in that run (from the
engine's spec_decode_* counters) and, for the adaptive controller, the k it chose per step.

    python bench/controller_sweep.py                                  # qwen2.5-1.5b shape, dummy weights
    python bench/controller_sweep.py --model /path/to/hf-dir --load-format auto --concurrency 1,8,64
    python bench/controller_sweep.py --model tiny-dir --device cpu --concurrency 1,4 --output-len 16  # smoke

Prompts are token ids (dummy shapes have no tokenizer) built from repeated spans, so n-gram lookup
finds matches in the prompt; with dummy weights the acceptance depends on how the random model's
greedy output repeats itself, and the table says what it measured. Prints a table last; writes JSON
to $OUT/controller_sweep.json when OUT is set (or to --json).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

# The repository root instead of bench/: bench/kernels.py would shadow the `kernels` package that
# transformers probes for.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from specserve import LLM, SamplingParams

SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b", help="dummy shape name, HF dir, catalog name or .gguf")
    p.add_argument("--load-format", default=None, help="default: dummy for shape names, else auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="K: fixed k runs 1..K; adaptive uses 0..K")
    p.add_argument("--ks", default=None, help="fixed k values to run (default 1..K)")
    p.add_argument("--policies", default="off,fixed,adaptive", help="subset of off,fixed,adaptive")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256, help="long enough for the controller to settle")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="fixed KV pool (CPU smoke runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="result path (default $OUT/controller_sweep.json when OUT is set)")
    return p.parse_args(argv)


def make_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[dict[str, list[int]]]:
    """Token-id prompts of `length`: random spans, each repeated a few times (n-gram lookup finds them)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        ids: list[int] = []
        while len(ids) < length:
            span = [rng.randrange(10, vocab_size) for _ in range(rng.randint(8, 24))]
            ids.extend(span * rng.randint(1, 3))
        prompts.append({"prompt_token_ids": ids[:length]})
    return prompts


def policies(args: argparse.Namespace) -> list[tuple[str, dict[str, Any] | None]]:
    wanted = set(args.policies.split(","))
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
             "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    out: list[tuple[str, dict[str, Any] | None]] = [("off", None)] if "off" in wanted else []
    if "fixed" in wanted:
        ks = [int(k) for k in args.ks.split(",")] if args.ks else range(1, args.num_speculative_tokens + 1)
        out += [(f"k={k}", {**ngram, "num_speculative_tokens": k, "adaptive": False}) for k in ks]
    if "adaptive" in wanted:
        out.append(("adaptive", {**ngram, "adaptive": True}))
    return out


def build_llm(args: argparse.Namespace, spec: dict[str, Any] | None, max_seqs: int) -> LLM:
    from specserve.model.shapes import SHAPES

    load_format = args.load_format or ("dummy" if args.model in SHAPES else "auto")
    kw: dict[str, Any] = {"load_format": load_format, "dtype": args.dtype, "device": args.device,
                          "max_model_len": args.max_model_len, "max_num_seqs": max_seqs, "seed": args.seed,
                          "speculative_config": spec, "gpu_memory_utilization": args.gpu_memory_utilization}
    if args.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    return LLM(model=args.model, progress=False, **kw)


def spec_counters(llm: LLM) -> dict[str, float]:
    values = {m.name.split(":", 1)[-1]: m.value for m in llm.get_metrics()}
    return {k: float(values.get(k, 0.0)) for k in SPEC_COUNTERS}


def record_choices(llm: LLM) -> list[int] | None:
    """Wrap the adaptive controller's choose() to keep the k it picks (None for other policies)."""
    spec = llm.engine.spec
    if spec is None or not hasattr(spec.controller, "estimate"):
        return None
    ctrl, seen = spec.controller, []
    choose = ctrl.choose

    def recording(batch_size: int) -> int:
        k = choose(batch_size)
        seen.append(k)
        return k

    ctrl.choose = recording
    return seen


def run_one(llm: LLM, prompts: list[dict[str, list[int]]], output_len: int,
            choices: list[int] | None) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = spec_counters(llm)
    if choices is not None:
        choices.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    delta = {k: v - before[k] for k, v in spec_counters(llm).items()}
    drafts, drafted, accepted = (delta[k] for k in SPEC_COUNTERS)
    row: dict[str, Any] = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                           "acceptance_rate": accepted / drafted if drafted else None,
                           "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
    if choices:
        row["chosen_k"] = dict(sorted(Counter(choices).items()))
        row["mean_chosen_k"] = sum(choices) / len(choices)
    return row


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(c) for c in args.concurrency.split(",")]
    result: dict[str, Any] = {"config": vars(args), "concurrency": levels, "runs": {}}
    for name, spec in policies(args):
        llm = build_llm(args, spec, max(levels))
        vocab = llm.engine.vocab_size
        llm.generate(make_prompts(min(max(levels), 8), 32, vocab, args.seed + 99),  # warm-up: JIT, graphs
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        choices = record_choices(llm)
        rows = {}
        for c in levels:
            rows[c] = run_one(llm, make_prompts(c, args.input_len, vocab, args.seed + c), args.output_len, choices)
            print(f"{name:>9} c={c:<4} {rows[c]['tokens_per_s']:10.1f} tok/s  "
                  f"accept={rows[c]['acceptance_rate']}  k={rows[c].get('mean_chosen_k')}", flush=True)
        result["runs"][name] = rows
        llm.engine.shutdown()
        del llm
        gc.collect()
        _empty_cuda_cache()
    return result


def _empty_cuda_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def format_table(result: dict[str, Any]) -> str:
    names = list(result["runs"])
    fixed = [n for n in names if n.startswith("k=")]
    head = f"{'conc':>5} " + " ".join(f"{n:>9}" for n in names)
    extra = []
    if "adaptive" in names and fixed:
        extra.append("best fixed")
        head += f" {'best fixed':>12} {'adapt/best':>10}"
    if "adaptive" in names and "off" in names:
        head += f" {'adapt/off':>9} {'adapt k':>7}"
    lines = ["Output tokens/s by policy (ngram), greedy, ignore_eos", head]
    for c in result["concurrency"]:
        tps = {n: result["runs"][n][c]["tokens_per_s"] for n in names}
        line = f"{c:>5} " + " ".join(f"{tps[n]:9.1f}" for n in names)
        if extra:
            best = max(fixed, key=tps.__getitem__)
            line += f" {best + ' ' + format(tps[best], '.0f'):>12} {tps['adaptive'] / tps[best]:10.2f}"
        if "adaptive" in names and "off" in names:
            k = result["runs"]["adaptive"][c].get("mean_chosen_k")
            line += f" {tps['adaptive'] / tps['off']:9.2f} {k if k is None else format(k, '.2f'):>7}"
        lines.append(line)
    accept = [n for n in names if n != "off"]
    lines.append("Acceptance rate (accepted / drafted) by policy")
    lines.append(f"{'conc':>5} " + " ".join(f"{n:>9}" for n in accept))
    for c in result["concurrency"]:
        vals = [result["runs"][n][c]["acceptance_rate"] for n in accept]
        lines.append(f"{c:>5} " + " ".join(f"{'-':>9}" if v is None else f"{v:9.2f}" for v in vals))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = sweep(args)
    path = args.json or (str(Path(os.environ["OUT"]) / "controller_sweep.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(result, indent=1, default=str))
        print(f"JSON: {path}")
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
