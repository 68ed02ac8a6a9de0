"""KV cache dtypes: perplexity on held-out Python and KV capacity, per --kv-dtypes, in one run.

Perplexity. Text: Python standard library files under Lib/test, Lib/turtledemo and Lib/lib2to3,
folders that the draft-head training data (specserve train-draft) never reads. The files, in order:
HELD_OUT_FILES, then turtledemo/*.py, lib2to3/*.py, test/test_*.py, until --ppl-tokens tokens; the
JSON names the files used. (Held out from specserve's own training only: the model itself has
probably seen CPython's sources.) Each file is cut into windows of --ppl-window tokens; each window
is one request with `prompt_logprobs=0, max_tokens=1`, all submitted at once. Perplexity =
exp(mean negative log-likelihood) over every scored token; the change against the first dtype of
--kv-dtypes (the baseline, bf16 by default) is computed on the tokens both scored. Both attention
backends write a step's K/V into the paged cache before attending over it, so every scored token
sees the KV format, prefill included.

Greedy agreement (--agreement-tokens N, 0 skips it): AGREEMENT_CHATS answered greedily with each
dtype; per prompt, the tokens that match the first dtype's output before the first difference.

Capacity: the tokens the KV pool holds with each dtype at the same pool size (--kv-cache-gib), from
the engine's `cache_config_info` metric (blocks x block size).

    python bench/kv_quality.py                                 # Qwen2.5-Coder-1.5B, bf16 / fp8 / nvfp4
    python bench/kv_quality.py --model smollm2-135m-instruct --kv-dtypes float32,fp8,nvfp4 \\
        --ppl-tokens 4096 --ppl-window 512 --kv-cache-gib 0.25     # CPU (the embedded model)

Prints progress with timestamps, writes --json (default $OUT/kv_quality.json when OUT is set) and
prints a short markdown table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from specserve import LLM, SamplingParams

# The explicit list comes first so the token set is the same on every machine with that Python; the
# globs fill up when it runs short.
HELD_OUT_FILES = (
    "test/test_textwrap.py",
    "test/test_statistics.py",
    "test/test_heapq.py",
    "test/test_bisect.py",
    "test/test_fractions.py",
    "test/test_shlex.py",
)
HELD_OUT_GLOBS = ("turtledemo/*.py", "lib2to3/*.py", "test/test_*.py")
AGREEMENT_CHATS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying focused while studying.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about the ocean.",
    "How do I reverse a list in Python?",
    "What are the main differences between a cat and a dog as pets?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
]
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


def stdlib_root() -> Path:
    """The standard library's directory; $SPECSERVE_STDLIB_ROOT points at a copy of its tree (some
    distributions ship Python without test/, turtledemo/ or lib2to3/)."""
    return Path(os.environ.get("SPECSERVE_STDLIB_ROOT") or sysconfig.get_paths()["stdlib"])


def held_out_files(root: Path) -> list[Path]:
    """The held-out files in a fixed order: the explicit list, then the globs (sorted)."""
    out = [root / rel for rel in HELD_OUT_FILES if (root / rel).is_file()]
    for pattern in HELD_OUT_GLOBS:
        out += [f for f in sorted(root.glob(pattern)) if f not in out]
    return out


def heldout_windows(tokenizer: Any, max_tokens: int, window: int) -> tuple[list[list[int]], list[str]]:
    """Token windows of held-out files, in file order, until max_tokens; and the files used."""
    root = stdlib_root()
    windows: list[list[int]] = []
    used: list[str] = []
    total = 0
    for f in held_out_files(root):
        if total >= max_tokens:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        used.append(str(f.relative_to(root)))
        for s in range(0, len(ids), window):
            piece = ids[s : s + window][: max_tokens - total]
            if len(piece) < 32:  # a tail too short to say much
                break
            windows.append(piece)
            total += len(piece)
            if total >= max_tokens:
                break
    return windows, used


def make_llm(args: argparse.Namespace, **kw: Any) -> LLM:
    if args.kv_cache_gib:
        kw.setdefault("kv_cache_memory_bytes", int(args.kv_cache_gib * (1 << 30)))
    return LLM(
        model=args.model,
        progress=False,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        **kw,
    )


def close_llm(llm: LLM) -> None:
    llm.engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cache_info(llm: LLM) -> dict[str, str]:
    """The labels of `specserve:cache_config_info`: cache_dtype, block_size, num_gpu_blocks, ..."""
    return next((m.labels for m in llm.get_metrics() if m.name.endswith("cache_config_info")), {})


def agreement(a: list[int], b: list[int]) -> int:
    """Number of leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def score_dtype(args: argparse.Namespace, kv_dtype: str, windows: list[list[int]]) -> tuple[dict, list, list]:
    """One engine with this KV dtype: the log-likelihood of every scored token, the greedy answers to
    AGREEMENT_CHATS (token ids) and the pool's capacity."""
    t = time.monotonic()
    llm = make_llm(args, kv_cache_dtype=kv_dtype, enforce_eager=True, enable_prefix_caching=False)
    try:
        info = cache_info(llm)
        log(f"{kv_dtype}: engine ready in {time.monotonic() - t:.1f}s; scoring {len(windows)} windows")
        t = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": w} for w in windows], params)
        secs = time.monotonic() - t
        per_token: list[float] = []
        for w, out in zip(windows, outs):
            assert out.prompt_logprobs is not None  # asked for with prompt_logprobs=0
            # Each window's first token has no context: it is not scored.
            per_token.extend(e[tok].logprob for e, tok in zip(out.prompt_logprobs[1:], w[1:]))
        answers: list[list[int]] = []
        if args.agreement_tokens:
            greedy = SamplingParams(temperature=0.0, max_tokens=args.agreement_tokens, ignore_eos=True)
            chats = [[{"role": "user", "content": c}] for c in AGREEMENT_CHATS]
            answers = [list(o.outputs[0].token_ids) for o in llm.chat(chats, greedy)]
        nll = -sum(per_token) / max(1, len(per_token))
        blocks = int(info.get("num_gpu_blocks", 0))
        row = {
            "kv_dtype": kv_dtype,
            "cache_dtype": info.get("cache_dtype"),
            "tokens": len(per_token),
            "nll": nll,
            "ppl": math.exp(nll),
            "seconds": round(secs, 2),
            "kv_capacity_tokens": blocks * int(info.get("block_size", 0)),
        }
        log(
            f"{kv_dtype}: perplexity {row['ppl']:.4f} over {len(per_token)} tokens in {secs:.1f}s; "
            f"the pool holds {row['kv_capacity_tokens']} tokens"
        )
        return row, per_token, answers
    finally:
        close_llm(llm)


def compare(rows: list[dict], per_dtype: dict[str, list[float]], answers: dict[str, list[list[int]]]) -> None:
    """Against the first dtype scored (the baseline): perplexity change in percent, mean |logprob
    difference| per token, greedy agreement per prompt and its mean, capacity as a multiple."""
    if not rows or rows[0]["kv_dtype"] not in per_dtype:
        return
    base_row, base = rows[0], per_dtype[rows[0]["kv_dtype"]]
    for row in rows[1:]:
        if answers.get(row["kv_dtype"]):
            row["agreement"] = [
                agreement(a, b) for a, b in zip(answers[base_row["kv_dtype"]], answers[row["kv_dtype"]])
            ]
            row["mean_agreement"] = sum(row["agreement"]) / len(row["agreement"])
        other = per_dtype.get(row["kv_dtype"])
        if other is None:
            continue
        row["ppl_delta_pct"] = 100.0 * (math.exp(sum(base) / len(base) - sum(other) / len(other)) - 1.0)
        row["mean_abs_dlogprob"] = sum(abs(a - b) for a, b in zip(base, other)) / len(base)
        if base_row["kv_capacity_tokens"]:
            row["capacity_x"] = row["kv_capacity_tokens"] / base_row["kv_capacity_tokens"]


def md_table(rows: list[dict]) -> str:
    cols = [
        ("kv_dtype", "KV dtype"),
        ("tokens", "tokens"),
        ("ppl", "perplexity"),
        ("ppl_delta_pct", "vs base %"),
        ("mean_abs_dlogprob", "mean |dlogprob|"),
        ("mean_agreement", "greedy agreement"),
        ("kv_capacity_tokens", "KV tokens"),
        ("capacity_x", "x base"),
        ("error", "error"),
    ]

    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(k)) for k, _ in cols) + " |" for r in rows])


def run(args: argparse.Namespace) -> dict:
    llm = make_llm(args, enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    tokenizer = llm.get_tokenizer()
    close_llm(llm)
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: perplexity needs one")
    windows, files = heldout_windows(tokenizer, args.ppl_tokens, args.ppl_window)
    log(f"{sum(map(len, windows))} tokens in {len(windows)} windows from {len(files)} files: {', '.join(files)}")
    rows: list[dict] = []
    per_dtype: dict[str, list[float]] = {}
    answers: dict[str, list[list[int]]] = {}
    for kv_dtype in args.kv_dtypes:
        try:
            row, per_dtype[kv_dtype], answers[kv_dtype] = score_dtype(args, kv_dtype, windows)
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - one dtype failing must not lose the others' numbers
            traceback.print_exc()
            rows.append({"kv_dtype": kv_dtype, "error": f"{type(e).__name__}: {e}"})
    compare(rows, per_dtype, answers)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "model": args.model,
        "device": device,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "files": files,
        "windows": len(windows),
        "window_tokens": args.ppl_window,
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="catalog name, .gguf file or HF dir")
    p.add_argument("--kv-dtypes", default="bfloat16,fp8,nvfp4", help="comma list; the first is the baseline")
    p.add_argument("--ppl-tokens", type=int, default=32768, help="tokens scored per dtype (about)")
    p.add_argument("--ppl-window", type=int, default=4096, help="tokens per request")
    p.add_argument("--agreement-tokens", type=int, default=64, help="greedy tokens per prompt (0: skip)")
    p.add_argument("--dtype", default="auto", help="weights / activations dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    p.add_argument("--kv-cache-gib", type=float, default=8.0, help="KV pool per engine (the same for every dtype)")
    p.add_argument("--json", default=None, help="result path (default $OUT/kv_quality.json when OUT is set)")
    args = p.parse_args(argv)
    args.kv_dtypes = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]
    if not args.kv_dtypes:
        p.error("--kv-dtypes: at least one dtype")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log(f"model {args.model}, KV dtypes {args.kv_dtypes}")
    result = run(args)
    path = Path(args.json) if args.json else None
    if path is None and os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "kv_quality.json"
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
        log(f"wrote {path}")
    print(f"\n### KV dtypes ({args.model}, {result['device']})\n\n{md_table(result['rows'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
