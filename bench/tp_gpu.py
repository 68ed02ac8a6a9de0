"""Tensor parallelism on GPUs: TP 1 vs TP 2 (vs 4 where 4 GPUs exist) on a dummy shape.

Measures, per tensor_parallel_size:
  - greedy token ids of a few random prompts (dummy weights come from `seed`; every rank builds the
    same full weights and slices them, so TP N computes the same function as TP 1, up to the
    rounding of the bf16 all-reduce: the table reports exact matches and common prefixes);
  - batch-1 decode ms/step (end to end through Engine.step, timed after the prefill);
  - batch-256 decode ms/step, and offline throughput with 256 concurrent requests;
and, on 2 GPUs, the all-reduce of one decode token's hidden state ([1, hidden] bf16), eager and
inside a CUDA graph (the way the decode graphs run it), beside [256, hidden].

Each measurement runs in its own process with a time limit, so a hang or a crash costs that part
only; the table comes last. usage:
  python bench/tp_gpu.py [--tp 1 2] [--shape llama-3.1-8b] [--budget-s 400] [--out DIR]
  python bench/tp_gpu.py --dry-run      # CPU + gloo, a shrunken shape: checks this script
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

TINY = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _sync(dry: bool) -> None:
    if not dry:
        torch.cuda.synchronize()


def decode_ms(llm, batch: int, prompt_len: int, new_tokens: int, dry: bool) -> float:
    """ms per decode step with `batch` sequences, timed after every prefill finished."""
    from specserve import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, prompt_len, eng.vocab_size, seed=batch)):
        eng.add_request(f"d{batch}-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
        eng.step()
    _sync(dry)
    t, steps = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    _sync(dry)
    return (time.perf_counter() - t) / max(1, steps) * 1e3


def throughput(llm, num: int, prompt_len: int, out_len: int, dry: bool) -> float:
    """Output tokens/s with `num` requests submitted at once (prefill included)."""
    from specserve import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    _sync(dry)
    t = time.perf_counter()
    for i, p in enumerate(_prompts(num, prompt_len, eng.vocab_size, seed=7)):
        eng.add_request(f"t{i}", {"prompt_token_ids": p}, params)
    while eng.has_unfinished_requests():
        eng.step()
    _sync(dry)
    return num * out_len / (time.perf_counter() - t)


def part_engine(args: argparse.Namespace) -> dict:
    from specserve import LLM, SamplingParams

    kw = dict(model=args.shape, load_format="dummy", tensor_parallel_size=args.tp, max_model_len=args.max_model_len,
              max_num_seqs=256, max_num_batched_tokens=8192, enforce_eager=args.eager, progress=False, seed=0)
    if args.dry_run:
        kw.update(device="cpu", hf_overrides=TINY, kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=1024)
    else:
        kw.update(gpu_memory_utilization=0.85)
    res: dict = {"tp": args.tp, "eager": args.eager}
    t = time.perf_counter()
    llm = LLM(**kw)
    res["init_s"] = time.perf_counter() - t
    res["num_blocks"] = llm.engine.kv.num_blocks
    n_new = 8 if args.dry_run else 32
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(8, 32, llm.engine.vocab_size, seed=1)],
                        SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True))
    res["greedy"] = [o.outputs[0].token_ids for o in outs]
    print(json.dumps(res), flush=True)  # what is measured so far survives a later crash
    steps = 16 if args.dry_run else 256
    decode_ms(llm, 1, 128, 8, args.dry_run)  # warm up
    res["b1_ms"] = decode_ms(llm, 1, 128, steps, args.dry_run)
    print(json.dumps(res), flush=True)
    big = 8 if args.dry_run else 256
    res["b256_ms"] = decode_ms(llm, big, 128, steps // 4, args.dry_run)
    res["tput_256_tok_s"] = throughput(llm, big, 128, 8 if args.dry_run else 128, args.dry_run)
    print(json.dumps(res), flush=True)
    if args.tp > 1:
        t = time.perf_counter()
        llm.engine.runner.close()
        res["close_s"] = time.perf_counter() - t
    return res


def _allreduce_rank(rank: int, port: int, dry: bool, out_path: str) -> None:
    from specserve.distributed.parallel_state import init_tp_group

    device = torch.device("cpu") if dry else torch.device("cuda", rank)
    if not dry:
        torch.cuda.set_device(device)
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False,
                                       timeout=datetime.timedelta(seconds=60))
    group = init_tp_group(store, rank, 2, device, datetime.timedelta(seconds=60))
    res = {}
    for rows in (1, 256):
        # zeros: the graph below sums in place 100 times; the values do not change the timing
        x = torch.zeros(rows, 4096, dtype=torch.bfloat16 if not dry else torch.float32, device=device)
        iters = 20 if dry else 2000
        for _ in range(10):
            group.all_reduce(x)
        _sync(dry)
        t = time.perf_counter()
        for _ in range(iters):
            group.all_reduce(x)
        _sync(dry)
        res[f"eager_us_{rows}x4096"] = (time.perf_counter() - t) / iters * 1e6
        if dry:
            continue
        graph, n = torch.cuda.CUDAGraph(), 100
        with torch.cuda.graph(graph):
            for _ in range(n):
                group.all_reduce(x)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        res[f"graph_us_{rows}x4096"] = start.elapsed_time(end) * 1e3 / (10 * n)
        graph.reset()  # before the communicator goes (pytorch#115388)
    if rank == 0:
        Path(out_path).write_text(json.dumps(res))
    group.barrier()
    os._exit(0)  # no destroy_process_group: nothing to wait for, and it can hang on NCCL teardown


def part_allreduce(args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    store = torch.distributed.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    out_path = os.path.join(args.out, "allreduce.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_allreduce_rank, args=(r, store.port, args.dry_run, out_path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"all-reduce ranks exited with {[p.exitcode for p in procs]}")
    return json.loads(Path(out_path).read_text())


def run_part(name: str, extra: list[str], limit_s: float, args: argparse.Namespace) -> dict:
    """Run one part in a child process; its last JSON line is the result."""
    cmd = [sys.executable, __file__, "--part", name, "--out", args.out, "--shape", args.shape,
           "--max-model-len", str(args.max_model_len)] + extra + (["--dry-run"] if args.dry_run else [])
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, limit_s))
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timed out after {limit_s:.0f} s", "timeout"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    res = json.loads(lines[-1]) if lines else {}
    res["part_s"] = round(time.perf_counter() - t, 1)
    if rc != 0:
        res["error"] = f"rc={rc}: {(err or '')[-1500:]}"
        print(f"--- part {name} {extra} failed ({rc}):\n{(err or '')[-3000:]}", flush=True)
    print(f"part {name} {extra}: {json.dumps({k: v for k, v in res.items() if k != 'greedy'})}", flush=True)
    return res


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def print_table(results: dict, tps: list[int], num_gpus: int) -> None:
    ar = results.get("allreduce", {})
    if ar:
        print("\nall-reduce, bf16, 2 ranks (us per call): " + ", ".join(
            f"{k} {v:.1f}" for k, v in ar.items() if k.startswith(("eager", "graph"))))
    base = results.get("tp1", {})
    print("\n| TP | CUDA graphs | init s | b1 ms/step | b1 speedup | b256 ms/step | tput 256 req tok/s | "
          "greedy == TP1 | mean common prefix |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in [f"tp{t}" for t in tps] + ["tp2_eager"]:
        r = results.get(key)
        if r is None:
            continue
        nan = float("nan")
        b1 = r.get("b1_ms", nan)
        speed = base.get("b1_ms", nan) / b1 if b1 == b1 else nan
        greedy, ref = r.get("greedy"), base.get("greedy")
        eq = pre = "-"
        if greedy and ref and key != "tp1":
            eq = f"{sum(a == b for a, b in zip(greedy, ref))}/{len(ref)}"
            pre = f"{sum(_common_prefix(a, b) for a, b in zip(greedy, ref)) / len(ref):.1f}/{len(ref[0])}"
        graphs = "no" if r.get("eager") else "yes"
        print(f"| {r.get('tp', key)} | {graphs} | {r.get('init_s', nan):.1f} | {b1:.3f} | {speed:.2f}x | "
              f"{r.get('b256_ms', nan):.3f} | {r.get('tput_256_tok_s', nan):.0f} | {eq} | {pre} |"
              + (f" error: {r['error'][:200]!r}" if "error" in r else ""))
    for t in (2, 4):
        if t > num_gpus and not results.get("dry_run"):
            print(f"TP {t}: not run (needs {t} GPUs; this machine has {num_gpus}).")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("engine", "allreduce"))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget of the whole run")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--dry-run", action="store_true", help="CPU + gloo, shrunken shape")
    args = ap.parse_args()
    if args.part == "engine":
        args.tp = args.tp[0]
        print(json.dumps(part_engine(args)), flush=True)
        return
    if args.part == "allreduce":
        print(json.dumps(part_allreduce(args)), flush=True)
        return
    start = time.monotonic()

    def left() -> float:
        return args.budget_s - (time.monotonic() - start)

    num_gpus = torch.cuda.device_count()
    results: dict = {"dry_run": args.dry_run, "num_gpus": num_gpus, "torch": torch.__version__}
    if num_gpus:
        results["device"] = torch.cuda.get_device_name()
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
        print(topo.stdout, flush=True)
    tps = [t for t in args.tp if args.dry_run or t <= num_gpus]
    if args.dry_run or num_gpus >= 2:
        results["allreduce"] = run_part("allreduce", [], min(60.0, left() - 200), args)
    # The new code first (TP > 1), then the TP 1 baseline it is compared with.
    for i, tp in enumerate(sorted(tps, reverse=True)):
        reserve = 130.0 * (len(tps) - 1 - i)  # keep room for the parts still to come
        results[f"tp{tp}"] = run_part("engine", ["--tp", str(tp)], left() - reserve - 5, args)
    broken = results.get("tp2", {}).get("error")
    if broken and "b1_ms" not in results["tp2"] and left() > 60:
        results["tp2_eager"] = run_part("engine", ["--tp", "2", "--eager"], left() - 5, args)
    Path(args.out, "tp_gpu.json").write_text(json.dumps(results, indent=1))
    print_table(results, tps, num_gpus)


if __name__ == "__main__":
    main()
