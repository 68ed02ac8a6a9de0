"""Perplexity on held-out Python with each KV cache dtype (issue 6), and the driver of all three
KV measurements in one process (`--tasks ppl,ttft,humaneval`: one model load for all).

Perplexity. Text: Python standard library files that the draft-head training data
(specserve/spec/train_data.py) never reads: it skips every folder in its `_SKIP_DIRS`, so Lib/test,
Lib/turtledemo and Lib/lib2to3 are held out. The files, in order: `kv_common.HELD_OUT_FILES`
(test_textwrap, test_statistics, test_heapq, test_bisect, test_fractions, test_shlex), then
turtledemo/*.py, lib2to3/*.py, test/test_*.py, until --ppl-tokens tokens; the script checks
against train_data's skip list and names the files it used in the JSON. (Held out from our own
training only: the model itself has probably seen CPython's sources.)
Each file is cut into windows of --ppl-window tokens (no special tokens added); each window is
one request with `prompt_logprobs=0, max_tokens=1`, all submitted at once. Perplexity =
exp(mean negative log-likelihood) over every scored token (each window's first token is not
scored), the same token set for every dtype.

Does the KV dtype show? Both attention backends write the step's K/V into the paged cache first
and then attend over the cache (torch_ref.py: write_kv then gather_kv; triton_backend.py:
reshape_and_cache(_quant) then paged_attention(_quant) over the block table): prefill reads K/V
back from the (quantized) cache, also for the tokens of the same chunk, so the score of every
token sees the KV format even when a window is one prefill chunk. The default token budget
(2048 on CUDA) chunks a 4096-token window anyway; --max-num-batched-tokens changes it.

    python bench/kv_quality.py                                # perplexity, bf16 / fp8 / nvfp4
    python bench/kv_quality.py --tasks ppl,ttft,humaneval     # all three (issue 6), ~200 s on an H200
    python bench/kv_quality.py --model smollm2-135m-instruct --ppl-tokens 1024 --ppl-window 512  # CPU smoke

Prints progress with timestamps and a markdown table last; writes $OUT/kv_quality.json when OUT
is set (else --json); with several tasks also each task's own JSON (humaneval_kv, tier_ttft).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_common import (Budget, add_common_args, close_llm, environment, generate_until, held_out_files,  # noqa: E402
                       log, make_llm, md_table, read_text, shared_models, stdlib_root, write_json)
from specserve import SamplingParams  # noqa: E402

TARGETS = {"fp8": 0.5, "nvfp4": 3.0}  # issue 6: perplexity increase over bf16, percent
TASK_SHARES = {"ppl": 1.0, "ttft": 1.0, "humaneval": 2.0}  # how a --time-budget-s is split


def add_ppl_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtypes", default="bfloat16,fp8,nvfp4")
    p.add_argument("--ppl-tokens", type=int, default=32768, help="tokens scored per dtype (about)")
    p.add_argument("--ppl-window", type=int, default=4096, help="tokens per request")
    p.add_argument("--num-files", type=int, default=0, help="at most this many files (0: as many as needed)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)


def heldout_windows(tokenizer, max_tokens: int, window: int, num_files: int = 0) -> tuple[list[list[int]], list[str]]:
    """Token windows of held-out files, in file order, until max_tokens; and the files used."""
    root = stdlib_root()
    windows, used, total = [], [], 0
    for f in held_out_files(root):
        if total >= max_tokens or (num_files and len(used) >= num_files):
            break
        text = read_text(f)
        if not text:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        used.append(str(f.relative_to(root)))
        for s in range(0, len(ids), window):
            piece = ids[s:s + window][:max_tokens - total]
            if len(piece) < 32:  # a tail too short to say much
                break
            windows.append(piece)
            total += len(piece)
            if total >= max_tokens:
                break
    return windows, used


def score_dtype(args, kv_dtype: str, windows: list[list[int]], budget: Budget) -> tuple[dict, list]:
    llm = None
    try:
        t = time.monotonic()
        llm = make_llm(args, kv_cache_dtype=kv_dtype, enforce_eager=True, enable_prefix_caching=False,
                       max_num_batched_tokens=args.max_num_batched_tokens)
        log(f"ppl {kv_dtype}: engine ready in {time.monotonic() - t:.1f}s; scoring {len(windows)} windows")
        t = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = generate_until(llm, [{"prompt_token_ids": w} for w in windows], params, budget, f"ppl-{kv_dtype}")
        secs = time.monotonic() - t
        per_token: list[float | None] = []
        for w, out in zip(windows, outs):
            if out is None or out.prompt_logprobs is None:
                per_token.extend([None] * (len(w) - 1))
                continue
            per_token.extend(e[tok].logprob for e, tok in zip(out.prompt_logprobs[1:], w[1:]))
        got = [x for x in per_token if x is not None]
        nll = -sum(got) / max(1, len(got))
        row = {"kv_dtype": kv_dtype, "tokens": len(got), "nll": nll, "ppl": math.exp(nll), "seconds": secs,
               "complete": len(got) == len(per_token),
               "cache_dtype": llm.engine.runner.spec.fmt.name}
        log(f"ppl {kv_dtype}: {row['ppl']:.4f} over {len(got)} tokens in {secs:.1f}s")
        return row, per_token
    finally:
        close_llm(llm)


def run_ppl(args, budget: Budget) -> dict:
    tokenizer = None
    rows, per_dtype = [], {}
    windows, files = [], []
    for kv_dtype in [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]:
        if budget.expired():
            rows.append({"kv_dtype": kv_dtype, "error": "skipped: time budget"})
            continue
        try:
            if tokenizer is None:
                tokenizer = _tokenizer(args)
                windows, files = heldout_windows(tokenizer, args.ppl_tokens, args.ppl_window, args.num_files)
                log(f"ppl: {sum(map(len, windows))} tokens in {len(windows)} windows from {len(files)} files: "
                    f"{', '.join(files)}")
            row, per_token = score_dtype(args, kv_dtype, windows, budget)
            rows.append(row)
            per_dtype[kv_dtype] = per_token
        except Exception as e:  # one configuration failing must not lose the others
            traceback.print_exc()
            rows.append({"kv_dtype": kv_dtype, "error": f"{type(e).__name__}: {e}"})
    _compare(rows, per_dtype)
    return {"task": "perplexity", "model": args.model, "files": files, "windows": len(windows),
            "window_tokens": args.ppl_window, "max_num_batched_tokens": args.max_num_batched_tokens,
            "targets_pct_over_bf16": TARGETS, "rows": rows}


def _tokenizer(args):
    """The model's tokenizer, from a small engine (the weights stay loaded for the next ones)."""
    llm = make_llm(args, enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    tok = llm.get_tokenizer()
    close_llm(llm)
    return tok


def _compare(rows: list[dict], per_dtype: dict[str, list]) -> None:
    """Perplexity change vs bf16 in percent, on the tokens both scored; mean |logprob difference|."""
    base_name = next((d for d in ("bfloat16", "auto", "float16", "float32") if d in per_dtype), None)
    if base_name is None:
        return
    base = per_dtype[base_name]
    for row in rows:
        other = per_dtype.get(row.get("kv_dtype"))
        if other is None:
            continue
        pairs = [(a, b) for a, b in zip(base, other) if a is not None and b is not None]
        if not pairs:
            continue
        nll_b = -sum(a for a, _ in pairs) / len(pairs)
        nll_o = -sum(b for _, b in pairs) / len(pairs)
        row["ppl_delta_pct"] = 100.0 * (math.exp(nll_o - nll_b) - 1.0)
        row["mean_abs_dlogprob"] = sum(abs(a - b) for a, b in pairs) / len(pairs)
        target = TARGETS.get(row["kv_dtype"])
        if target is not None:
            row["target_pct"] = target
            row["meets_target"] = row["ppl_delta_pct"] <= target


def ppl_table(result: dict) -> str:
    return md_table(result["rows"], [("kv_dtype", "KV dtype"), ("tokens", "tokens"), ("ppl", "perplexity"),
                                     ("ppl_delta_pct", "vs bf16 %"), ("target_pct", "target %"),
                                     ("meets_target", "ok"), ("mean_abs_dlogprob", "mean |dlogprob|"),
                                     ("seconds", "s"), ("error", "error")])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--tasks", default="ppl", help="comma list of ppl, ttft, humaneval (run in this order)")
    add_ppl_args(p)
    import humaneval_kv
    import tier_ttft

    humaneval_kv.add_he_args(p)
    tier_ttft.add_ttft_args(p)
    args = p.parse_args()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    runners = {"ppl": (run_ppl, ppl_table, "kv_quality"),
               "ttft": (tier_ttft.run_ttft, tier_ttft.ttft_table, "tier_ttft"),
               "humaneval": (humaneval_kv.run_humaneval, humaneval_kv.he_table, "humaneval_kv")}
    unknown = [t for t in tasks if t not in runners]
    if unknown:
        raise SystemExit(f"unknown tasks {unknown}; choose from {sorted(runners)}")
    budget = Budget(args.time_budget_s)
    log(f"tasks {tasks}, model {args.model}, budget {args.time_budget_s}s, {environment()}")
    results, tables = {}, []
    with shared_models():
        for i, task in enumerate(tasks):
            run, table, name = runners[task]
            shares = [TASK_SHARES[t] for t in tasks[i:]]
            sub = budget.sub(shares[0] / sum(shares))
            t = time.monotonic()
            try:
                results[task] = run(args, sub)
            except Exception as e:
                traceback.print_exc()
                results[task] = {"task": task, "error": f"{type(e).__name__}: {e}", "rows": []}
            results[task]["seconds"] = time.monotonic() - t
            log(f"{task} done in {results[task]['seconds']:.1f}s")
            tables.append(f"### {task} ({args.model})\n\n{table(results[task])}")
            if len(tasks) > 1 and name != "kv_quality":
                write_json(name, None, {**results[task], "env": environment()})
    combined = {"env": environment(), "model": args.model, "tasks": results}
    write_json("kv_quality", args.json, combined)
    print("\n" + "\n\n".join(tables), flush=True)


if __name__ == "__main__":
    main()
