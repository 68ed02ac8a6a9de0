"""Where a speculative decoding cycle's time goes at batch 1 (CUDA, or the host alone on the CPU).

For no speculation, a draft model and EAGLE-3 / P-EAGLE heads (random weights are enough: this times
the work, not the acceptance), per engine step:
  * wall ms: plain stepping, nothing instrumented;
  * GPU busy ms: CUDA kernel time from torch.profiler over the same steps (wall - busy = GPU idle);
  * verify ms and propose ms: the target's forward + sampling and the proposer's work, each
    bracketed by torch.cuda.synchronize (so they include their GPU time; a separate pass).

    python bench/spec_profile.py --target qwen2.5-1.5b --draft qwen2.5-0.5b --load-format dummy

Host cost of a propose (`--ops`): with a tiny model on the CPU compute is negligible, so the
propose time is Python + torch dispatch, and the torch ops it runs are what the GPU path launches
(each costs ~5-20 us of host time there). Ops are counted per propose by region: `fwd` runs
inside a forward that a CUDA graph replays when graphs are on (HeadStepGraphs, the P-EAGLE
forward, the draft model's forwards), `head` inside an EAGLE head forward run eagerly, `glue`
everything else (inputs, metadata, sampling, read-back):

    python bench/spec_profile.py --device cpu --target tiny --draft tiny --ops --steps 40 \
        [--eagle-step-graphs static [--emulate-replay]] [--configs none,ngram,draft_model,eagle3,p-eagle]

`--ops` also times and counts the verify part of each step (`Engine._sample`: the sampling
metadata, the rejection sampler or the plain sampler, the read-back), for `none` too (the plain
sampler, the floor); `--temperature 0.8` runs seeded random sampling instead of greedy.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specserve import LLM, SamplingParams


def _engine(args, spec: dict | None) -> LLM:
    # An absolute KV budget: engines built one after another in this process see each other's memory.
    return LLM(model=args.target, load_format=args.load_format, max_model_len=args.max_model_len, max_num_seqs=4,
               progress=False, speculative_config=spec, kv_cache_memory_bytes=args.kv_bytes, device=args.device)


def _start(llm: LLM, n: int, temperature: float = 0.0) -> None:
    eng = llm.engine
    prompt = [(1000 + i) % eng.vocab_size for i in range(128)]
    eng.add_request(f"p{time.monotonic_ns()}", {"prompt_token_ids": prompt},
                    SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                                   seed=0 if temperature > 0 else None))
    for _ in range(3):
        eng.step()


class OpCounter(TorchDispatchMode):
    """Counts the torch ops dispatched, by region: `graph` inside a graphed forward, else the
    innermost labelled call running; and by name outside `graph`."""

    def __init__(self) -> None:
        super().__init__()
        self.regions: Counter[str] = Counter()
        self.names: Counter[str] = Counter()
        self.stack = ["glue"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        region = "graph" if "graph" in self.stack else self.stack[-1]
        self.regions[region] += 1
        if region != "graph":
            self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def label(self, obj, attr: str, region: str):
        """Run obj.attr inside `region`; returns an undo function."""
        def enter() -> None:
            self.stack.append(region)

        return _wrap(obj, attr, enter, lambda: self.stack.pop())


def _wrap(obj, attr: str, before, after):
    """Call before() and after() around obj.attr; returns an undo function."""
    fn = getattr(obj, attr)
    had = attr in vars(obj)

    def wrapped(*a, **kw):
        before()
        try:
            return fn(*a, **kw)
        finally:
            after()

    setattr(obj, attr, wrapped)
    return (lambda: setattr(obj, attr, fn)) if had else (lambda: delattr(obj, attr))


def _labels(proposer) -> list[tuple[object, str, str]]:
    """The proposer's forwards: `graph` where a CUDA graph replays them (when graphs are on),
    `head` an EAGLE head's eager forward; none for n-gram lookup."""
    if proposer is None or not hasattr(proposer, "runner") and not hasattr(proposer, "head"):
        return []
    if not hasattr(proposer, "head"):  # the draft model: its decode / catch-up forwards run as graphs
        return [(proposer.runner.model, "forward", "graph"), (proposer.runner.model, "compute_logits", "graph")]
    return [(proposer.head, "forward", "head")] + [(cls, "_forward", "graph") for cls in _graph_classes()]


def _graph_classes() -> list[type]:
    """The head's static-buffer forwards (those of older commits too: A/B runs)."""
    from specserve.spec import eagle_graph

    try:
        from specserve.spec import eagle_first
    except ImportError:
        return [eagle_graph.HeadStepGraphs]
    return [eagle_graph.HeadStepGraphs, eagle_first.FirstForwardGraphs]


def emulate_replay() -> None:
    """On the CPU: each static-buffer head forward computes once per batch size, then returns those
    outputs as a replay would, without the work; propose then costs what the host pays with graphs
    on (minus the replays themselves). The drafts are wrong; verification keeps the output exact."""
    for cls in _graph_classes():
        forward = cls._forward

        def replayed(self, bs, _forward=forward):
            done = self.__dict__.setdefault("_emulated", {})
            if bs not in done:
                done[bs] = _forward(self, bs)
            return done[bs]

        cls._forward = replayed


def measure_host(llm: LLM, steps: int, cprofile: bool = False, temperature: float = 0.0) -> dict:
    """Per step: host microseconds (nothing else instrumented) and torch ops by region of the
    proposer's propose, and of the verify part (`Engine._sample`: sampling metadata, the
    rejection sampler or the plain sampler, reading the tokens back)."""
    eng = llm.engine
    proposer = eng.spec.proposer if eng.spec is not None else None
    _start(llm, 4 * steps + 64, temperature)
    probes = ([(proposer, "propose")] if proposer is not None else []) + [(eng, "_sample")]
    times: dict[str, list[float]] = {attr: [] for _, attr in probes}
    undo = [_wrap_call(obj, attr, _timer(times[attr])) for obj, attr in probes]
    for _ in range(steps // 2):  # warm up
        eng.step()
    for t in times.values():
        t.clear()
    drafts_before = eng.stats.get("spec_decode_num_draft_tokens_total")
    # Time spent in forwards a CUDA graph replays (when graphs are on): the CPU's static path runs
    # them eagerly, so `propose_us - graph_us` is the host time that a replay does not remove.
    in_graph = [0.0, 0.0]

    def start() -> None:
        in_graph[1] = time.perf_counter()

    def stop() -> None:
        in_graph[0] += time.perf_counter() - in_graph[1]

    graph_undo = [_wrap(o, a, start, stop) for o, a, r in _labels(proposer) if r == "graph"]
    for _ in range(steps):
        eng.step()
    graph_s = in_graph[0]
    drafts = (eng.stats.get("spec_decode_num_draft_tokens_total") - drafts_before) / steps
    for u in reversed(graph_undo + undo):
        u()
    counters = {attr: OpCounter() for _, attr in probes}
    calls = Counter()

    def counting(attr):
        def call(fn, *a, **kw):
            calls[attr] += 1
            with counters[attr]:
                return fn(*a, **kw)
        return call

    undo = [_wrap_call(obj, attr, counting(attr)) for obj, attr in probes]
    undo += [counters["propose"].label(*x) for x in _labels(proposer)] if proposer is not None else []
    for _ in range(steps):
        eng.step()
    for u in reversed(undo):
        u()
    if cprofile:  # host functions of propose and verify alone, by own time
        import cProfile
        import pstats

        prof = cProfile.Profile()

        def profiled(fn, *a, **kw):
            prof.enable()
            try:
                return fn(*a, **kw)
            finally:
                prof.disable()

        undo = [_wrap_call(obj, attr, profiled) for obj, attr in probes]
        for _ in range(steps):
            eng.step()
        for u in reversed(undo):
            u()
        print(f"propose and verify only, {steps} steps:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    eng.abort_request(list(eng.groups))
    res = {"drafts_per_step": drafts}
    for _, attr in probes:
        name = {"_sample": "verify"}.get(attr, attr)
        t = sorted(times[attr])
        n = max(1, calls[attr])
        c = counters[attr]
        res |= {f"{name}_us_median": 1e6 * t[len(t) // 2], f"{name}_us_mean": 1e6 * sum(t) / len(t),
                f"ops_per_{name}": sum(c.regions.values()) / n}
        if name == "propose":
            res |= {"graph_us_mean": 1e6 * graph_s / len(t),
                    **{f"ops_{r}": v / n for r, v in sorted(c.regions.items())}}
        res[f"{name}_top_ops"] = ", ".join(f"{k} {v / n:.1f}" for k, v in c.names.most_common(14))
    return res


def _wrap_call(obj, attr: str, around):
    """obj.attr(*a) runs as around(original, *a); returns an undo function."""
    fn = getattr(obj, attr)
    had = attr in vars(obj)
    setattr(obj, attr, lambda *a, **kw: around(fn, *a, **kw))
    return (lambda: setattr(obj, attr, fn)) if had else (lambda: delattr(obj, attr))


def _timer(acc: list[float]):
    def call(fn, *a, **kw):
        _sync()
        t = time.perf_counter()
        out = fn(*a, **kw)
        _sync()
        acc.append(time.perf_counter() - t)
        return out
    return call


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(llm: LLM, steps: int, cprofile: bool = False, temperature: float = 0.0, kernels: int = 0) -> dict:
    eng = llm.engine
    _start(llm, 4 * steps + 64, temperature)
    for _ in range(steps // 2):  # warm up
        eng.step()
    _sync()
    t, before = time.perf_counter(), eng.stats.get("generation_tokens_total")
    for _ in range(steps):
        eng.step()
    _sync()
    wall = (time.perf_counter() - t) / steps
    tokens = (eng.stats.get("generation_tokens_total") - before) / steps
    from torch.profiler import ProfilerActivity, profile

    busy = float("nan")
    if eng.device.type == "cuda":
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            _sync()
        averages = prof.key_averages()
        busy = sum(e.self_device_time_total for e in averages) / 1e6 / steps  # us -> s
        top = sorted((e for e in averages if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
        # Per step: us of device time and launches, by kernel (with PDL, overlapping kernels both count).
        kernel_rows = [(e.key[:70], e.self_device_time_total / steps, e.count / steps) for e in top[:kernels]]
    res = {"wall_ms": wall * 1e3, "tokens_per_step": tokens, "gpu_busy_ms": busy * 1e3}
    if kernels and eng.device.type == "cuda":
        res["kernels"] = kernel_rows
    verify: list[float] = []
    propose: list[float] = []
    undo = [_wrap_call(eng.runner, "execute", _timer(verify))]
    if eng.spec is not None:
        undo.append(_wrap_call(eng.spec.proposer, "propose", _timer(propose)))
    for _ in range(steps):
        eng.step()
    for u in undo:
        u()
    res["target_forward_ms"] = 1e3 * sum(verify) / steps
    res["propose_ms"] = 1e3 * sum(propose) / steps
    if cprofile:  # host functions of the plain steps, by own time
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            eng.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    eng.abort_request(list(eng.groups))
    return res


def _tiny(tmp: str, args) -> None:
    """--target / --draft tiny: the tests' tiny random llama (hidden 64, 2 layers; the draft 1 layer)."""
    from tests.helpers.tiny_models import make_tiny_model_dir

    if args.target == "tiny":
        args.target = str(make_tiny_model_dir(f"{tmp}/tiny", arch="llama", seed=1))
    if args.draft == "tiny":
        args.draft = str(make_tiny_model_dir(f"{tmp}/tiny-draft", arch="llama", seed=11, num_layers=1))
    args.load_format = "auto"
    args.max_model_len = min(args.max_model_len, 512)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-1.5b", help="a model, or `tiny` (a tiny random llama)")
    ap.add_argument("--draft", default="qwen2.5-0.5b", help="a model, or `tiny`")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-bytes", type=int, default=1 << 30)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", default="none,draft_model,eagle3,p-eagle", help="of none, ngram, draft_model, "
                    "eagle3, p-eagle")
    ap.add_argument("--temperature", type=float, default=0.0, help="of the request (> 0: seeded random sampling)")
    ap.add_argument("--cprofile", default="", help="comma list of configs whose host time to profile "
                    "(with --ops: propose and verify alone, else whole steps)")
    ap.add_argument("--ops", action="store_true", help="also host time and torch ops per propose and per verify "
                    "(Engine._sample: metadata, rejection or plain sampler, read-back)")
    ap.add_argument("--eagle-step-graphs", default=None, choices=("auto", "static", "eager"),
                    help="EagleProposer.step_graphs for the head configs (default: the class default)")
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="the random heads' draft vocabulary (train-draft's default; 0 = the target's whole one)")
    ap.add_argument("--kernels", type=int, default=0, help="CUDA: list each config's N costliest kernels per step")
    ap.add_argument("--emulate-replay", action="store_true",
                    help="CPU, with --eagle-step-graphs static: static head forwards return cached outputs")
    args = ap.parse_args()
    if args.emulate_replay:
        emulate_replay()
    from specserve.spec.eagle_head import make_random_head_dir

    if args.eagle_step_graphs:
        from specserve.spec.eagle import EagleProposer

        EagleProposer.step_graphs = args.eagle_step_graphs
    if args.device == "cpu":
        torch.set_num_threads(1)  # host cost, not intra-op parallelism (and the cores may be shared)
    tmp = tempfile.mkdtemp()
    if "tiny" in (args.target, args.draft):
        _tiny(tmp, args)
    fmt = args.load_format
    # A reduced draft vocabulary as train-draft gives the real heads (its first N ids: only the width
    # matters for timing); 0 = the full vocabulary.
    d2t = list(range(args.draft_vocab)) if args.draft_vocab else None

    def head(out: str, **kw):
        try:
            return make_random_head_dir(args.target, out, "eagle3", load_format=fmt, d2t=d2t, **kw)
        except ValueError:  # a target with a smaller vocabulary (`tiny`): its whole one
            return make_random_head_dir(args.target, out, "eagle3", load_format=fmt, **kw)

    heads = {"eagle3": head(f"{tmp}/e3"), "p-eagle": head(f"{tmp}/pe", num_mask_slots=args.k - 1)}
    base = {"num_speculative_tokens": args.k, "adaptive": False}
    configs = {"none": None,
               "ngram": {**base, "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
               "draft_model": {**base, "method": "draft_model", "model": args.draft},
               "eagle3": {**base, "method": "eagle3", "model": str(heads["eagle3"])},
               "p-eagle": {**base, "method": "eagle3", "model": str(heads["p-eagle"]), "parallel_drafting": True}}
    results = {}
    for name, spec in configs.items():
        if name not in args.configs.split(","):
            continue
        llm = _engine(args, spec)
        prof = name in args.cprofile.split(",")
        results[name] = measure(llm, args.steps, prof and not args.ops, args.temperature, args.kernels)
        if args.ops:
            results[name] |= measure_host(llm, args.steps, prof, args.temperature)
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                for k, v in results[name].items() if k != "kernels"}), flush=True)
        for kname, us, count in results[name].get("kernels", []):
            print(f"    {kname:70} {us:8.1f} us {count:6.1f} launches per step")
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "spec_profile.json"), "w") as f:
        json.dump({"args": vars(args), "k": args.k, "results": results}, f, indent=1)
    print(f"\n{'config':12} {'wall ms':>8} {'GPU busy':>8} {'idle %':>6} {'target fwd':>10} {'propose':>8}  (k={args.k})")
    for name, r in results.items():
        idle = 100 * (1 - r["gpu_busy_ms"] / r["wall_ms"])
        print(f"{name:12} {r['wall_ms']:8.3f} {r['gpu_busy_ms']:8.3f} {idle:5.1f}% {r['target_forward_ms']:10.3f} "
              f"{r['propose_ms']:8.3f}")
    if args.ops:
        print(f"\n{'config':12} {'drafts':>6} {'verify us':>9} {'ops':>5} {'propose us':>10} {'in graph':>8} {'ops':>6} "
              f"{'glue':>6} {'head':>6} {'graph':>6}  (per step; graph: replayed when graphs are on)")
        for name, r in results.items():
            if "ops_per_verify" in r:
                print(f"{name:12} {r['drafts_per_step']:6.2f} {r['verify_us_mean']:9.0f} {r['ops_per_verify']:5.0f} "
                      f"{r.get('propose_us_mean', 0):10.0f} {r.get('graph_us_mean', 0):8.0f} "
                      f"{r.get('ops_per_propose', 0):6.0f} {r.get('ops_glue', 0):6.0f} {r.get('ops_head', 0):6.0f} "
                      f"{r.get('ops_graph', 0):6.0f}")


if __name__ == "__main__":
    main()
