"""Structured output cost: decode throughput with and without a JSON schema, and grammar compile time.

    python bench/structured_bench.py                       # SmolLM2-135M-Instruct if installed
    python bench/structured_bench.py --num-requests 4 --max-tokens 64 --no-spec

Model: `smollm2-135m-instruct` when the catalog has it installed; otherwise a tiny random model
with a byte-level BPE tokenizer built in-process (dummy shapes have no tokenizer, and structured
output needs one). Reported:
- compile: tokenizer-info build, a cold compile (empty cache) and a cached lookup of the schema;
- masks: one fill_next_token_bitmask on the model vocab, and masking a batch of logits rows;
- decode: for each mode (plain, n-gram speculation) and each of {free, json}, ms per engine step
  while the whole batch is decoding, output tokens/s over the decode phase, the time the engine
  waited for the mask worker (the overlap: ~0 means the masks were ready before the logits),
  and masks filled on the critical path.
Free requests use ignore_eos and the same max_tokens; json requests end when the schema does.
Writes JSON to $OUT/structured_bench.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The repository root instead of bench/: bench/kernels.py would shadow the `kernels` package that
# transformers probes for.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.sample import structured as structured_mod  # noqa: E402
from specserve.sample.grammar_cache import GrammarCache, parse_structured_outputs  # noqa: E402

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


class WaitTimer:
    """Time the engine thread spends waiting for the mask worker (patched into _wait)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = structured_mod.StructuredOutputs._wait

    def __enter__(self) -> WaitTimer:
        orig = self._orig

        def timed(st: Any) -> None:
            t = time.perf_counter()
            orig(st)
            self.seconds += time.perf_counter() - t

        structured_mod.StructuredOutputs._wait = staticmethod(timed)
        return self

    def __exit__(self, *exc: object) -> None:
        structured_mod.StructuredOutputs._wait = staticmethod(self._orig)


def decode_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, float]:
    """Step the engine by hand; decode-phase ms/step and tokens/s."""
    eng = llm.engine
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        eng.add_request(rid, {"prompt_token_ids": prompt}, p)
    num_tokens = dict.fromkeys(ids, 0)
    full_steps, full_seconds, decode_tokens, decode_seconds = 0, 0.0, 0, 0.0
    sync_before = eng.structured.num_sync_fills
    with WaitTimer() as waits:
        while eng.has_unfinished_requests():
            decoding = all(n > 0 for n in num_tokens.values())
            running = eng.num_unfinished_requests()
            t = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t
            new = 0
            for out in outs:
                count = len(out.outputs[0].token_ids)
                new += count - num_tokens.get(out.request_id, count)
                num_tokens[out.request_id] = count
            if decoding:
                decode_tokens += new
                decode_seconds += dt
                if running == len(ids):
                    full_steps += 1
                    full_seconds += dt
    return {"ms_per_step_full_batch": full_seconds / max(1, full_steps) * 1e3,
            "decode_tokens_per_s": decode_tokens / max(decode_seconds, 1e-9),
            "mean_output_tokens": sum(num_tokens.values()) / len(ids),
            "mask_wait_ms_total": waits.seconds * 1e3,
            "sync_mask_fills": eng.structured.num_sync_fills - sync_before}


def run_mode(model: str, spec: dict | None, args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(model=model, progress=False, speculative_config=spec, max_model_len=1024)
    prompts = [llm.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
               for i in range(args.num_requests)]
    free = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
            for i in range(args.num_requests)]
    schema = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens * 3,
                             structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
              for i in range(args.num_requests)]
    decode_run(llm, prompts[:2], free[:2])  # warm up
    decode_run(llm, prompts[:2], schema[:2])
    result = {"free": decode_run(llm, prompts, free), "json": decode_run(llm, prompts, schema)}
    outs = llm.generate(prompts[:1], schema[:1])
    result["sample_json"] = outs[0].outputs[0].text
    result["compile"] = bench_compile(llm)
    result["masks"] = bench_masks(llm, args.num_requests)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, described = resolve_model(args.model)
    report: dict[str, Any] = {"model": described, "num_requests": args.num_requests,
                              "torch_threads": torch.get_num_threads()}
    for mode, spec in (("plain", None), ("ngram", NGRAM)):
        if mode == "ngram" and args.no_spec:
            continue
        report[mode] = run_mode(model, spec, args)
    print(json.dumps(report, indent=2))
    print(f"\nmodel: {described}; batch {args.num_requests}")
    print(f"{'mode':6} {'kind':5} {'ms/step':>8} {'tok/s':>8} {'out tok':>8} {'wait ms':>8} {'sync':>5}")
    for mode in ("plain", "ngram"):
        for kind in ("free", "json"):
            r = report.get(mode, {}).get(kind)
            if r:
                print(f"{mode:6} {kind:5} {r['ms_per_step_full_batch']:8.2f} {r['decode_tokens_per_s']:8.1f} "
                      f"{r['mean_output_tokens']:8.1f} {r['mask_wait_ms_total']:8.2f} {r['sync_mask_fills']:5d}")
    c, m = report["plain"]["compile"], report["plain"]["masks"]
    print(f"compile: tokenizer info {c['tokenizer_info_ms']:.1f} ms, cold {c['compile_cold_ms']:.1f} ms, "
          f"cached {c['compile_cached_us']:.1f} us; masks: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "structured_bench.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
