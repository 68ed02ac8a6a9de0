"""Structured output cost: decode throughput with and without a JSON schema, and grammar compile time.

    python bench/structured_bench.py                       # SmolLM2-135M-Instruct if installed
    python bench/structured_bench.py --num-requests 4 --max-tokens 64 --no-spec

Model: `smollm2-135m-instruct` when the catalog has it installed; otherwise a tiny random model
with a byte-level BPE tokenizer built in-process (dummy shapes have no tokenizer, and structured
output needs one). Reported:
- compile: tokenizer-info build, a cold compile (empty cache) and a cached lookup of the schema;
- masks: one fill_next_token_bitmask on the model vocab, and masking a batch of logits rows;
- decode: for each mode (plain, n-gram speculation) and each of {free, json}, ms per engine step
  while the whole batch is decoding, output tokens/s over the decode phase, the engine-thread ms
  per step spent in structured output (apply + advance + prepare: its whole cost on the critical
  path), the time the engine waited for the mask worker (the overlap: ~0 means the masks were
  ready before the logits), and masks filled on the critical path. Medians of --repeats
  interleaved runs (a shared CPU is noisy; the structured ms/step is the steadier number).
Free requests use ignore_eos and the same max_tokens; json requests end when the schema does.
Writes JSON to $OUT/structured_bench.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# The repository root instead of bench/: bench/kernels.py would shadow the `kernels` package that
# transformers probes for.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch

from specserve import LLM, SamplingParams
from specserve.sample import structured as structured_mod
from specserve.sample.grammar_cache import GrammarCache, parse_structured_outputs

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"]}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
QUESTIONS = ["Describe a fictional person as JSON.", "Invent a character who lives in Paris.",
             "Give me a JSON profile of a chef.", "Make up a person who likes chess.",
             "Describe a retired teacher.", "Describe a young programmer.", "Invent a painter.",
             "Describe a sailor as JSON."]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--no-spec", action="store_true", help="skip the n-gram speculation mode")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each kind; medians reported")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (1 gives steadier numbers on a shared CPU)")
    return p.parse_args(argv)


def resolve_model(name: str) -> tuple[str, str]:
    """(model argument for LLM, description)."""
    from specserve.model.catalog import model_path

    try:
        path = model_path(name)
    except (KeyError, ValueError):
        path = None
    if path is not None:
        return name, name
    from tests.helpers.tiny_models import make_tiny_model_dir

    tiny = make_tiny_model_dir(Path(tempfile.mkdtemp()), arch="llama", seed=1)
    return str(tiny), f"tiny random llama (384-token BPE; {name} not installed)"


def bench_compile(llm: LLM) -> dict[str, float]:
    eng = llm.engine
    spec = parse_structured_outputs({"json": SCHEMA})
    cache = GrammarCache(eng.tokenizer, eng.vocab_size, eng.eos_token_ids)
    t0 = time.perf_counter()
    cache._get_compiler()  # tokenizer info: once per engine
    t1 = time.perf_counter()
    cache.get(spec)
    t2 = time.perf_counter()
    for _ in range(100):
        cache.get(spec)
    t3 = time.perf_counter()
    return {"tokenizer_info_ms": (t1 - t0) * 1e3, "compile_cold_ms": (t2 - t1) * 1e3,
            "compile_cached_us": (t3 - t2) / 100 * 1e6}


def bench_masks(llm: LLM, batch: int) -> dict[str, float]:
    import xgrammar as xgr

    eng = llm.engine
    compiled = GrammarCache(eng.tokenizer, eng.vocab_size, eng.eos_token_ids).get(
        parse_structured_outputs({"json": SCHEMA}))
    matcher = xgr.GrammarMatcher(compiled)
    words = (eng.vocab_size + 31) // 32
    bitmask = torch.full((batch, words), -1, dtype=torch.int32)
    for token in eng.tokenizer.encode('{"name": "Ada', add_special_tokens=False):
        matcher.accept_token(token)  # inside a string: the widest masks
    t0 = time.perf_counter()
    for _ in range(200):
        matcher.fill_next_token_bitmask(bitmask, 0)
    t1 = time.perf_counter()
    logits = torch.randn(batch, eng.vocab_size)
    for _ in range(50):
        structured_mod.apply_token_bitmask(logits, bitmask, list(range(batch)))
    t2 = time.perf_counter()
    return {"fill_one_row_us": (t1 - t0) / 200 * 1e6, f"apply_{batch}_rows_us": (t2 - t1) / 50 * 1e6}


class MethodTimers:
    """Engine-thread seconds spent in StructuredOutputs methods (patched for the run): the
    overhead structured output adds to a step, and in `_wait` the time blocked on the worker."""

    NAMES = ("apply", "advance", "prepare", "_wait")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self._orig = {n: structured_mod.StructuredOutputs.__dict__[n] for n in self.NAMES}
        self._owner = threading.get_ident()

    def __enter__(self) -> MethodTimers:
        for name, orig in self._orig.items():
            fn = orig.__func__ if isinstance(orig, staticmethod) else orig

            def timed(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    if threading.get_ident() == self._owner:
                        self.seconds[_name] += time.perf_counter() - t

            setattr(structured_mod.StructuredOutputs, name,
                    staticmethod(timed) if isinstance(orig, staticmethod) else timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, orig in self._orig.items():
            setattr(structured_mod.StructuredOutputs, name, orig)


def decode_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, float]:
    """Step the engine by hand; decode-phase ms/step and tokens/s."""
    eng = llm.engine
    reqs = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        rid = f"bench-{time.monotonic_ns()}-{i}"
        eng.add_request(rid, {"prompt_token_ids": prompt}, p)
        reqs.append(eng.groups[rid].children[0])  # Request objects outlive their groups
    full_steps, full_seconds, decode_tokens, decode_seconds = 0, 0.0, 0, 0.0
    sync_before = eng.structured.num_sync_fills
    num_steps = 0
    with MethodTimers() as timers:
        while eng.has_unfinished_requests():
            before = [r.num_output_tokens for r in reqs]
            running = sum(not r.is_finished for r in reqs)
            t = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t
            num_steps += 1
            if all(before):  # every request is past its prefill: a decode step
                decode_tokens += sum(r.num_output_tokens for r in reqs) - sum(before)
                decode_seconds += dt
                if running == len(reqs):
                    full_steps += 1
                    full_seconds += dt
    num_tokens = [r.num_output_tokens for r in reqs]
    return {"ms_per_step_full_batch": full_seconds / max(1, full_steps) * 1e3,
            "decode_tokens_per_s": decode_tokens / max(decode_seconds, 1e-9),
            "mean_output_tokens": sum(num_tokens) / len(reqs),
            "structured_ms_per_step": sum(timers.seconds.values()) / max(1, num_steps) * 1e3,
            "mask_wait_ms_total": timers.seconds["_wait"] * 1e3,
            "sync_mask_fills": eng.structured.num_sync_fills - sync_before}


def run_mode(model: str, spec: dict | None, args: argparse.Namespace) -> dict[str, Any]:
    # The tiny fallback model has 512 positions; SmolLM2 needs no more than 1024 here.
    max_model_len = 1024 if model == args.model else 512
    llm = LLM(model=model, progress=False, speculative_config=spec, max_model_len=max_model_len)
    prompts = [llm.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
               for i in range(args.num_requests)]
    free = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
            for i in range(args.num_requests)]
    schema = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens * 3,
                             structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
              for i in range(args.num_requests)]
    decode_run(llm, prompts[:2], free[:2])  # warm up
    decode_run(llm, prompts[:2], schema[:2])
    runs: dict[str, list[dict[str, float]]] = {"free": [], "json": []}
    for _ in range(args.repeats):  # interleaved, so load from elsewhere hits both kinds alike
        runs["free"].append(decode_run(llm, prompts, free))
        runs["json"].append(decode_run(llm, prompts, schema))
    result: dict[str, Any] = {kind: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
                              for kind, rs in runs.items()}
    outs = llm.generate(prompts[:1], schema[:1])
    result["sample_json"] = outs[0].outputs[0].text
    result["compile"] = bench_compile(llm)
    result["masks"] = bench_masks(llm, args.num_requests)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, described = resolve_model(args.model)
    report: dict[str, Any] = {"model": described, "num_requests": args.num_requests,
                              "torch_threads": torch.get_num_threads()}
    for mode, spec in (("plain", None), ("ngram", NGRAM)):
        if mode == "ngram" and args.no_spec:
            continue
        report[mode] = run_mode(model, spec, args)
    print(json.dumps(report, indent=2))
    print(f"\nmodel: {described}; batch {args.num_requests}")
    print(f"{'mode':6} {'kind':5} {'ms/step':>8} {'tok/s':>8} {'out tok':>8} {'so ms/step':>10} "
          f"{'wait ms':>8} {'sync':>5}")
    for mode in ("plain", "ngram"):
        for kind in ("free", "json"):
            r = report.get(mode, {}).get(kind)
            if r:
                print(f"{mode:6} {kind:5} {r['ms_per_step_full_batch']:8.2f} {r['decode_tokens_per_s']:8.1f} "
                      f"{r['mean_output_tokens']:8.1f} {r['structured_ms_per_step']:10.3f} "
                      f"{r['mask_wait_ms_total']:8.2f} {r['sync_mask_fills']:5.0f}")
    c, m = report["plain"]["compile"], report["plain"]["masks"]
    print(f"compile: tokenizer info {c['tokenizer_info_ms']:.1f} ms, cold {c['compile_cold_ms']:.1f} ms, "
          f"cached {c['compile_cached_us']:.1f} us; masks: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "structured_bench.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
