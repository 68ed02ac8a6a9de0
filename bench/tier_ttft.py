"""TTFT of a long document asked repeatedly (RAG-like): cold vs a prefix hit from GPU blocks, from the
CPU tier and from the disk tier (issue 6; H200 targets: <= 10%, <= 25%, <= 50% of cold).

A prompt is a --doc-tokens document (stdlib source, token ids) followed by a short question that
differs on every repeat. TTFT = wall time of `LLM.generate(prompt_ids, max_tokens=1)` (the first
token is the only one), median over --repeats; the engine's own TTFT (first_token_time -
arrival_time) is kept in the JSON as well. Every engine runs a warm-up first (a cold document and
a hit), so kernel compilation is not timed. Cases:

- cold: a fresh document every repeat (nothing to hit), prefix caching on, no offload tiers.
- gpu: the same document every repeat, its blocks still in the GPU pool (same engine as cold).
- cpu: an engine with `kv_offload={"cpu_bytes": ...}`; the document was computed once (its blocks
  are stored in the CPU tier when they complete); before every repeat the GPU pool forgets its
  cached blocks (`engine.kv.reset_prefix_cache()`, as if other traffic had evicted them), so the
  prefix comes back from the CPU tier. `cold_cpu_on` is a fresh document in that engine: the cost
  of storing blocks on the way.
- disk: an engine with only a disk tier computes the document and shuts down (pending writes are
  flushed); a new engine on the same directory (a restart) answers the repeats, its GPU pool reset
  before each, so the prefix is read from the block files (the OS page cache likely holds them:
  a restart of the server, not of the machine). `cold_disk_on` as for the CPU tier.
The hit tokens per case (prefix-cache hits, per-tier offload hits) are recorded so a case that
did not hit where it should is visible. Ratios are against `cold`.

    python bench/tier_ttft.py                          # 8k document, 3 repeats, ~60 s on an H200
    python bench/tier_ttft.py --model smollm2-135m-instruct --doc-tokens 1024 --repeats 2   # CPU smoke
    python bench/tier_ttft.py --model qwen2.5-1.5b --load-format dummy   # timing without weights

Prints progress and a markdown table; writes $OUT/tier_ttft.json when OUT is set (else --json).
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_common import (Budget, add_common_args, close_llm, environment, log, make_llm, md_table, read_text,  # noqa: E402
                       shared_models, stdlib_root, write_json)

TARGETS = {"gpu": 0.10, "cpu": 0.25, "disk": 0.50}
_DOC_FILES = ("json/decoder.py", "textwrap.py", "difflib.py", "argparse.py", "typing.py", "inspect.py",
              "pathlib.py", "dataclasses.py", "functools.py", "collections/__init__.py")


def add_ttft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--doc-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft-cases", default="cold,gpu,cpu,disk")
    p.add_argument("--ttft-kv-dtype", default="auto")
    p.add_argument("--cpu-tier-gib", type=float, default=8.0)
    p.add_argument("--disk-tier-gib", type=float, default=8.0)
    p.add_argument("--disk-path", default=None, help="disk tier directory (default: a fresh temp dir, removed after)")
    p.add_argument("--eager", action="store_true",
                   help="no CUDA graphs (before the fourth session every run was eager: the question after "
                        "a hit then ran ~170 Triton launches from Python)")


def _graphs(args) -> dict:
    """Engine options of the timed engines: CUDA graphs as a server runs them (a short question after
    a prefix hit replays a prefill graph, runner/cuda_graph.py PREFILL_QUERY_LENS), sized for one request."""
    return {"enforce_eager": bool(getattr(args, "eager", False)), "max_num_seqs": 8}


class Docs:
    """Documents of exactly n tokens cut from stdlib source, and questions that differ per repeat.
    Without a tokenizer (random weights of a shape, for timing): seeded random token ids."""

    def __init__(self, tokenizer, n: int, count: int, vocab_size: int = 32000) -> None:
        self.tokenizer = tokenizer
        if tokenizer is None:
            rng = random.Random(0)
            self.vocab_size = vocab_size
            self.docs = [[rng.randrange(100, vocab_size - 100) for _ in range(n)] for _ in range(count)]
            return
        root = stdlib_root()
        # Any source text will do here (nothing is scored): the listed files, then the whole tree.
        files = [root / f for f in _DOC_FILES] + sorted(root.rglob("*.py"))
        stream: list[int] = []
        for f in files:
            if len(stream) >= n * count:
                break
            text = read_text(f)
            if text:
                stream.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(stream) < n * count:
            raise RuntimeError(f"not enough stdlib text for {count} documents of {n} tokens")
        self.docs = [stream[i * n:(i + 1) * n] for i in range(count)]

    def question(self, i: int) -> list[int]:
        if self.tokenizer is None:
            rng = random.Random(1000 + i)
            return [rng.randrange(100, self.vocab_size - 100) for _ in range(16)]
        text = f"\n\nQuestion {i}: which function above is the most complex, and why? Answer in one sentence."
        return self.tokenizer.encode(text, add_special_tokens=False)


def _hits(llm) -> dict[str, float]:
    st = llm.engine.stats
    out = {"prefix": float(llm.engine.kv.prefix_hits)}
    for tier in ("cpu", "disk"):
        out[tier] = st.get("kv_offload_hits_total", {"tier": tier}) or 0.0
    return out


def timed(llm, ids: list[int]) -> dict:
    """One request, max_tokens=1: wall seconds, the engine's TTFT and what it hit."""
    from specserve import SamplingParams

    before = _hits(llm)
    t = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1))[0]
    wall = time.perf_counter() - t
    after = _hits(llm)
    m = out.metrics
    engine_ttft = m.first_token_time - m.arrival_time if m and m.first_token_time else None
    return {"wall_s": wall, "engine_ttft_s": engine_ttft, "cached_tokens": out.num_cached_tokens,
            "hit_tokens": {k: after[k] - before[k] for k in after}}


def _reset_gpu(llm) -> None:
    if not llm.engine.kv.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache refused: blocks still in use")


def _summary(case: str, samples: list[dict]) -> dict:
    walls = [s["wall_s"] for s in samples]
    return {"case": case, "ttft_ms": 1000 * statistics.median(walls), "min_ms": 1000 * min(walls),
            "max_ms": 1000 * max(walls), "repeats": len(walls),
            "cached_tokens": statistics.median(s["cached_tokens"] for s in samples),
            "cpu_hit_tokens": statistics.median(s["hit_tokens"]["cpu"] for s in samples),
            "disk_hit_tokens": statistics.median(s["hit_tokens"]["disk"] for s in samples), "samples": samples}


def _warm(llm, docs: Docs, tier: bool) -> None:
    """Compile kernels for this engine's paths: a cold document, then a hit (from a tier if any)."""
    timed(llm, docs.docs[0] + docs.question(900))
    if tier:
        _reset_gpu(llm)
    timed(llm, docs.docs[0] + docs.question(901))


def case_gpu_pool(args, docs: Docs, rep: int, cases: set[str]) -> list[dict]:
    llm = make_llm(args, kv_cache_dtype=args.ttft_kv_dtype, **_graphs(args))
    try:
        _warm(llm, docs, tier=False)
        rows = []
        if "cold" in cases:
            rows.append(_summary("cold", [timed(llm, docs.docs[2 + r] + docs.question(r)) for r in range(rep)]))
        if "gpu" in cases:
            timed(llm, docs.docs[1] + docs.question(100))  # the document's first visit
            rows.append(_summary("gpu", [timed(llm, docs.docs[1] + docs.question(r)) for r in range(rep)]))
        return rows
    finally:
        close_llm(llm)


def _tier_hits(llm, docs: Docs, rep: int) -> list[dict]:
    """The asked document, `rep` times, each after the GPU pool forgot it: a hit from the tiers."""
    samples = []
    for r in range(rep):
        _reset_gpu(llm)
        samples.append(timed(llm, docs.docs[1] + docs.question(r)))
    return samples


def case_cpu_tier(args, docs: Docs, rep: int) -> list[dict]:
    llm = make_llm(args, kv_cache_dtype=args.ttft_kv_dtype, **_graphs(args),
                   kv_offload={"cpu_bytes": int(args.cpu_tier_gib * (1 << 30))})
    try:
        _warm(llm, docs, tier=True)
        cold = [timed(llm, docs.docs[2 + rep + r] + docs.question(r)) for r in range(rep)]
        timed(llm, docs.docs[1] + docs.question(100))  # computed once: stored in the CPU tier
        return [_summary("cold_cpu_on", cold), _summary("cpu", _tier_hits(llm, docs, rep))]
    finally:
        close_llm(llm)


def case_disk_tier(args, docs: Docs, rep: int) -> list[dict]:
    path = args.disk_path or tempfile.mkdtemp(prefix="specserve-ttft-kv-")
    disk = {"disk_path": path, "disk_bytes": int(args.disk_tier_gib * (1 << 30))}
    try:
        first = make_llm(args, kv_cache_dtype=args.ttft_kv_dtype, **_graphs(args), kv_offload=disk)
        try:
            # Warmed like the other engines (cold_cpu_on's included): the first request of an engine
            # is not what `cold_disk_on` compares.
            _warm(first, docs, tier=False)
            cold = [timed(first, docs.docs[2 + 2 * rep + r] + docs.question(r)) for r in range(rep)]
            for d in (0, 1):  # warm-up document and the asked one: every block must reach the disk
                _store_all(first, docs.docs[d], path)
        finally:
            close_llm(first)  # shutdown flushes pending writes
        log(f"ttft disk: {len(list(Path(path).glob('*.kvb')))} block files in {path}; restarting")
        llm = make_llm(args, kv_cache_dtype=args.ttft_kv_dtype, **_graphs(args), kv_offload=disk)
        try:
            timed(llm, docs.docs[0] + docs.question(901))  # warm the load path
            return [_summary("cold_disk_on", cold), _summary("disk", _tier_hits(llm, docs, rep))]
        finally:
            close_llm(llm)
    finally:
        if args.disk_path is None:
            shutil.rmtree(path, ignore_errors=True)


def _store_all(llm, doc: list[int], path: str, tries: int = 3) -> None:
    """Compute doc until all its full blocks are files: the disk tier drops writes when its queue is
    full, and a recompute re-queues only the missing blocks."""
    bs = llm.engine.kv.block_size
    store = llm.engine.kv.offloader.store
    for _ in range(tries):
        store.flush()
        before = len(list(Path(path).glob("*.kvb")))
        _reset_gpu(llm)
        timed(llm, doc + [doc[0]])  # one more token, so that every block of doc is full and stored
        store.flush()
        added = len(list(Path(path).glob("*.kvb"))) - before
        if added == 0 or added >= len(doc) // bs:
            return


def run_ttft(args, budget: Budget) -> dict:
    cases = {c.strip() for c in args.ttft_cases.split(",") if c.strip()}
    rep = max(1, args.repeats)
    rows: list[dict] = []
    docs = None
    steps = [("gpu_pool", lambda: case_gpu_pool(args, docs, rep, cases), bool(cases & {"cold", "gpu"})),
             ("cpu", lambda: case_cpu_tier(args, docs, rep), "cpu" in cases),
             ("disk", lambda: case_disk_tier(args, docs, rep), "disk" in cases)]
    for name, step, wanted in steps:
        if not wanted:
            continue
        if budget.expired():
            rows.append({"case": name, "error": "skipped: time budget"})
            continue
        try:
            if docs is None:
                tok, vocab = _tokenizer(args)
                docs = Docs(tok, args.doc_tokens, 2 + 3 * rep, vocab)
            t = time.monotonic()
            rows.extend(step())
            log(f"ttft {name}: done in {time.monotonic() - t:.1f}s: "
                + ", ".join(f"{r['case']} {r['ttft_ms']:.1f} ms" for r in rows if "ttft_ms" in r))
        except Exception as e:
            traceback.print_exc()
            rows.append({"case": name, "error": f"{type(e).__name__}: {e}"})
    cold = next((r["ttft_ms"] for r in rows if r.get("case") == "cold" and "ttft_ms" in r), None)
    for r in rows:
        if cold and "ttft_ms" in r:
            r["vs_cold"] = r["ttft_ms"] / cold
            if r["case"] in TARGETS:
                r["target"] = TARGETS[r["case"]]
                r["meets_target"] = r["vs_cold"] <= TARGETS[r["case"]]
    return {"task": "ttft", "model": args.model, "doc_tokens": args.doc_tokens, "repeats": rep,
            "kv_cache_dtype": args.ttft_kv_dtype, "rows": rows}


def _tokenizer(args):
    """(tokenizer or None, vocabulary size)."""
    llm = make_llm(args, enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    tok = llm.engine.tokenizer
    vocab = llm.engine.vocab_size
    close_llm(llm)
    return tok, vocab


def ttft_table(result: dict) -> str:
    return md_table([{k: v for k, v in r.items() if k != "samples"} for r in result.get("rows", [])],
                    [("case", "case"), ("ttft_ms", "TTFT ms (median)"), ("min_ms", "min"), ("max_ms", "max"),
                     ("vs_cold", "vs cold"), ("target", "target"), ("meets_target", "ok"),
                     ("cached_tokens", "cached tok"), ("cpu_hit_tokens", "cpu-tier tok"),
                     ("disk_hit_tokens", "disk-tier tok"), ("error", "error")])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    add_ttft_args(p)
    args = p.parse_args()
    log(f"ttft, model {args.model}, budget {args.time_budget_s}s, {environment()}")
    with shared_models():
        result = run_ttft(args, Budget(args.time_budget_s))
    write_json("tier_ttft", args.json, {**result, "env": environment()})
    print("\n" + ttft_table(result), flush=True)


if __name__ == "__main__":
    main()
