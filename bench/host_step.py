"""Host (Python) time per step against batch size, on the CPU (issue 48).

Part 1, the batch build: B decoding requests (prompt --prompt-len tokens, some output), one token each;
times build_host_batch + to_device (the runner's host work) and SamplingMetadata.build for random rows
(the sampler's host work), best of --repeats, in ms per step. --profile N runs cProfile over the build
at batch N and prints the top functions.

Part 2 (--engine): a tiny random-weight model (tests/helpers/tiny_models.py), B requests decoding at
once; cProfile over Engine.step, grouped into schedule / build / forward / sample / update.

Part 3 (--engine-host): the same tiny model, B requests decoding at once; Scheduler.schedule and
Engine.update timed inside Engine.step (no profiler), in ms per step: the mean over --steps steps (a
block's worth: one step in 16 allocates a block), best of --rounds. update is timed offline
(stream_outputs False, as LLM.generate) and streaming (a RequestOutput per request per step, as the
server). With --before, the baseline checkout's table comes from the same run (A B A B, the best kept).

    PYTHONPATH=$PWD python bench/host_step.py --batches 1 64 256 1024 --repeats 20
    PYTHONPATH=$PWD python bench/host_step.py --before /path/to/baseline/checkout   # before/after, one run
    PYTHONPATH=$PWD python bench/host_step.py --profile 1024 --engine 256
    PYTHONPATH=$PWD python bench/host_step.py --engine-host --before /tmp/base   # schedule + update
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from specserve.runner.batch import build_host_batch
from specserve.sample.metadata import SamplingMetadata
from specserve.sampling_params import SamplingParams
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput

try:
    from specserve.runner.block_tables import BlockTables
except ImportError:  # a checkout from before the persistent block tables (the "before" column)
    BlockTables = None  # type: ignore[assignment,misc]

BLOCK_SIZE = 16
VOCAB = 32000


def decode_step(batch: int, prompt_len: int = 512, num_out: int = 64, seed: bool = False):
    """(SchedulerOutput of `batch` decoding requests, request_id -> block list, the requests)."""
    reqs, blocks, scheduled = [], {}, []
    for i in range(batch):
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256, seed=i if seed else None)
        req = Request(f"r{i}", [(7 * i + j) % VOCAB for j in range(prompt_len)], params, 256, eos_token_ids=(2,))
        req.append_output_tokens([(3 * i + j) % VOCAB for j in range(num_out)])
        req.num_computed_tokens = req.num_tokens - 1
        n_blocks = -(-req.num_tokens // BLOCK_SIZE)
        blocks[req.request_id] = [(i * 64 + b) % 100_000 for b in range(n_blocks)]
        reqs.append(req)
        scheduled.append(ScheduledRequest(req, 1, 0))
    sched = SchedulerOutput(scheduled, num_batched_tokens=batch)
    return sched, blocks, reqs


def make_builder(sched, block_ids_of, blocks: dict[str, list[int]]):
    """build(): one step's build_host_batch + to_device, with the runner's persistent block tables where
    this checkout has them; between calls 1/16 of the requests gain a block (a decode step's rate)."""
    kw = {"tables": BlockTables()} if BlockTables is not None else {}
    lists, step = list(blocks.values()), [0]

    def grow() -> None:
        step[0] += 1
        for blk in lists[step[0] % BLOCK_SIZE :: BLOCK_SIZE]:
            blk.append(blk[-1] + 1)

    def build() -> None:
        host = build_host_batch(sched, block_ids_of, BLOCK_SIZE, **kw)
        host.to_device(torch.device("cpu"))

    return grow, build


def meta_once(reqs) -> None:
    SamplingMetadata.build(
        [r.params for r in reqs],
        [r.prompt_token_ids for r in reqs],
        [r.output_token_ids for r in reqs],
        *([[None] * len(reqs)] if "generators" in inspect.signature(SamplingMetadata.build).parameters else []),
        VOCAB,
        torch.device("cpu"),
        # as Engine._sampling_meta builds them (before issue 48: always)
        [list(r.eos_token_ids) + (r.params.stop_token_ids or []) for r in reqs]
        if BlockTables is None or [r.params.min_tokens for r in reqs].count(0) != len(reqs)
        else None,
    )


def best_ms(fn, repeats: int, setup=lambda: None) -> float:
    fn()  # warm caches
    best = float("inf")
    for _ in range(repeats):
        setup()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def build_table(batches: list[int], repeats: int) -> list[dict]:
    rows = []
    for b in batches:
        sched, blocks, reqs = decode_step(b)
        grow, build = make_builder(sched, blocks.get, blocks)
        build_ms = best_ms(build, repeats, grow)
        meta = best_ms(partial(meta_once, reqs), repeats)
        rows.append({"batch": b, "build_ms": build_ms, "meta_ms": meta})
    return rows


def print_profile(fn, top: int = 15) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())


def engine_profile(batch: int, steps: int) -> None:
    """cProfile over Engine.step with `batch` requests decoding at once on a tiny random model."""
    import tempfile
    from pathlib import Path

    from specserve import LLM
    from tests.helpers.tiny_models import make_tiny_model_dir

    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model_dir(Path(d) / "m", max_position_embeddings=1024)
        llm = LLM(model=str(path), progress=False, max_num_seqs=batch, max_num_batched_tokens=max(512, batch))
        eng = llm.engine
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=2 * steps + 64, ignore_eos=True, seed=0)
        for i in range(batch):
            eng.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + j) % 300 + 5 for j in range(64)]}, params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
            eng.step()  # prefill out of the way
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = (time.perf_counter() - t) / steps * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            eng.step()
        prof.disable()
    stats = pstats.Stats(prof)
    parts = {  # (file, function): Engine.step's phases; build is inside execute, with the forward
        "schedule": ("scheduler.py", "schedule"),
        "execute": ("engine.py", "execute"),
        "  build": ("batch.py", "build_host_batch"),
        "sample": ("engine.py", "_sample"),
        "  metadata": ("metadata.py", "build"),
        "update": ("engine.py", "update"),
    }
    print(f"engine step at batch {batch}: {wall:.2f} ms/step without the profiler; under it, per phase:")
    for label, (file, func) in parts.items():
        cum = sum(v[3] for k, v in stats.stats.items() if k[0].endswith(file) and k[2] == func)  # type: ignore[attr-defined]
        print(f"  {label:11s} {cum / steps * 1e3:8.2f} ms/step")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
    print(out.getvalue())


def _timed(clock: dict[str, float], name: str, fn):
    """fn, adding its wall time to clock[name]."""

    def call(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        clock[name] += time.perf_counter() - t
        return out

    return call


def engine_host_table(batches: list[int], steps: int, rounds: int) -> list[dict]:
    """Per batch: schedule / update (offline) / update (streaming) host ms per step (see Part 3)."""
    import tempfile
    from pathlib import Path

    from specserve import LLM
    from tests.helpers.tiny_models import make_tiny_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model_dir(Path(d) / "m", max_position_embeddings=2048)
        for batch in batches:
            kw = dict(max_num_seqs=batch, max_num_batched_tokens=17 * batch, kv_cache_memory_bytes=1 << 28)
            llm = LLM(model=str(path), progress=False, **kw)
            eng = llm.engine
            total_steps = 2 * rounds * steps + 8
            params = SamplingParams(temperature=0.0, max_tokens=total_steps + 32, ignore_eos=True)
            for i in range(batch):  # none ends while timed (ignore_eos; max_tokens past the steps)
                eng.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + j) % 300 + 5 for j in range(16)]}, params)
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
                eng.step()  # prefill out of the way
            clock = {"schedule": 0.0, "update": 0.0}
            sched_fn, update_fn = eng.scheduler.schedule, eng.update
            eng.scheduler.schedule = _timed(clock, "schedule", sched_fn)
            eng.update = _timed(clock, "update", update_fn)
            best = {"schedule_ms": float("inf"), "update_ms": float("inf"), "update_stream_ms": float("inf")}
            for _ in range(rounds):
                for stream, key in ((False, "update_ms"), (True, "update_stream_ms")):
                    eng.stream_outputs = stream
                    clock["schedule"] = clock["update"] = 0.0
                    for _ in range(steps):
                        eng.step()
                    best[key] = min(best[key], clock["update"] / steps * 1e3)
                    best["schedule_ms"] = min(best["schedule_ms"], clock["schedule"] / steps * 1e3)
            running = len(eng.scheduler.running)
            assert running == batch, f"{batch - running} requests finished early: the timing is not at batch {batch}"
            rows.append({"batch": batch, **best})
            eng.shutdown()
    return rows


def print_engine_host(args) -> None:
    keys = ("schedule_ms", "update_ms", "update_stream_ms")
    if not args.before:
        print("| batch | schedule | update (offline) | update (streaming) | (ms per step) |")
        print("|---:|---:|---:|---:|---|")
        for r in engine_host_table(args.batches, args.steps, args.rounds):
            print(f"| {r['batch']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " | |")
        return
    env = dict(os.environ, PYTHONPATH=args.before)
    cmd = [
        sys.executable,
        __file__,
        "--engine-host",
        "--json",
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
    ]
    cmd += ["--batches", *map(str, args.batches)]

    def before() -> list[dict]:
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    # each side already keeps its best of --rounds: two alternations are enough against load drift
    best = best_alternating(before, lambda: engine_host_table(args.batches, args.steps, args.rounds), 2)
    print("| batch | schedule before | after | update offline before | after | update streaming before | after |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in args.batches:
        x, y = best["before"][b], best["after"][b]
        print(f"| {b} | " + " | ".join(f"{x[k]:.3f} | {y[k]:.3f}" for k in keys) + " |")


def best_alternating(
    before: Callable[[], list[dict]], after: Callable[[], list[dict]], rounds: int
) -> dict[str, dict[int, dict]]:
    """A B A B (`rounds` times) against the machine's load drifting: per side and batch, the minimum of every
    timing over the rounds."""
    best: dict[str, dict[int, dict]] = {"before": {}, "after": {}}
    for _ in range(rounds):
        for side, run in (("before", before), ("after", after)):
            for r in run():
                old = best[side].get(r["batch"])
                best[side][r["batch"]] = r if old is None else {k: min(old[k], r[k]) for k in r}
    return best


def before_table(checkout: str, batches: list[int], repeats: int) -> list[dict]:
    """build_table in a subprocess importing specserve from `checkout` (an older tree: the baseline)."""
    env = dict(os.environ, PYTHONPATH=checkout)
    cmd = [sys.executable, __file__, "--json", "--repeats", str(repeats), "--batches", *map(str, batches)]
    return json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--before", help="a checkout of the baseline tree: its table in the same run (A B A B)")
    ap.add_argument("--rounds", type=int, default=2, help="with --before: alternations; the best of each kept")
    ap.add_argument("--json", action="store_true", help="print the build table as JSON only")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the build at this batch")
    ap.add_argument("--engine", type=int, default=0, help="cProfile Engine.step at this batch")
    ap.add_argument("--engine-host", action="store_true", help="time schedule and update per step (Part 3)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.engine_host:
        if args.json:
            print(json.dumps(engine_host_table(args.batches, args.steps, args.rounds)))
        else:
            print_engine_host(args)
        return
    if args.json:
        print(json.dumps(build_table(args.batches, args.repeats)))
        return
    if args.before:
        best = best_alternating(
            lambda: before_table(args.before, args.batches, args.repeats),
            lambda: build_table(args.batches, args.repeats),
            args.rounds,
        )
        print("| batch | build before | build after | metadata before | metadata after | (ms per step) |")
        print("|---:|---:|---:|---:|---:|---|")
        for b in args.batches:
            x, y = best["before"][b], best["after"][b]
            print(f"| {b} | {x['build_ms']:.3f} | {y['build_ms']:.3f} | {x['meta_ms']:.3f} | {y['meta_ms']:.3f} | |")
    else:
        print("| batch | build ms/step | build us/request | sampling metadata ms/step |")
        print("|---:|---:|---:|---:|")
        for r in build_table(args.batches, args.repeats):
            b = r["batch"]
            print(f"| {b} | {r['build_ms']:.3f} | {r['build_ms'] * 1e3 / b:.2f} | {r['meta_ms']:.3f} |")
    if args.profile:
        sched, blocks, reqs = decode_step(args.profile)
        grow, build = make_builder(sched, blocks.get, blocks)
        build()
        grow()
        print_profile(build)
        print_profile(partial(meta_once, reqs))
    if args.engine:
        engine_profile(args.engine, args.steps)


if __name__ == "__main__":
    main()
