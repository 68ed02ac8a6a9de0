"""Tune and time the small-batch GEMV (model/layers/triton_gemv.py) against cuBLAS on this GPU.

For every linear of the given model shapes (qkv, o, gate_up, down) and rows M in --ms, it times
cuBLAS (F.linear) and each GEMV tile config (BLOCK_N, BLOCK_K, num_warps) inside a CUDA graph of
--calls back-to-back calls (as a decode step replays them), keeps the fastest, and writes the
table the engine reads: specserve/model/layers/gemv_configs/<device>.json (--write), with
[0, 0, 0] where cuBLAS won. Then it times the fused variants as the model calls them (norm +
projection, gate_up + activation) against their unfused pair. Prints a table (us per
call, GB/s of weight read, % of the copy bandwidth --peak-gbs) and writes $OUT/gemv_tune.json.

    python bench/gemv_tune.py --shapes qwen2.5-1.5b,llama-3.1-8b --write
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.model.layers import ops, triton_gemv, triton_ops  # noqa: E402
from specserve.model.shapes import SHAPES  # noqa: E402

BLOCK_NS = (2, 4, 8, 16, 32)
BLOCK_KS = (256, 512, 1024)
WARPS = (4, 8)


def linears(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the model's fused projections."""
    c = SHAPES[shape]
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv, h, inter = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["hidden_size"], \
        c["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def graph_us(fn, calls: int, reps: int = 5) -> float:
    """Median us per call of `fn` replayed `calls` times inside one CUDA graph."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def tune(n: int, k: int, m: int, calls: int) -> tuple[dict, list]:
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
    ref = F.linear(x, w)
    cublas = graph_us(lambda: F.linear(x, w), calls)
    best, rows = None, []
    for bn, bk, nw in itertools.product(BLOCK_NS, BLOCK_KS, WARPS):
        tiles = (bn, bk, nw)
        try:
            out = triton_gemv._launch(x, w, None, tiles)[0]
            err = (out.float() - ref.float()).abs().max().item()
            us = graph_us(lambda tiles=tiles: triton_gemv._launch(x, w, None, tiles), calls)
        except Exception as e:  # noqa: BLE001  (a config the compiler refuses: registers, shared memory)
            rows.append({"tiles": tiles, "error": repr(e)[:120]})
            continue
        rows.append({"tiles": tiles, "us": us, "max_abs_err_vs_cublas": err})
        if best is None or us < best[1]:
            best = (tiles, us)
    return {"cublas_us": cublas, "gemv_us": best[1] if best else None, "tiles": best[0] if best else None}, rows


def fused_times(n_qkv: int, h: int, inter: int, m: int, calls: int) -> dict:
    """The model's fused calls vs their unfused pair, with whatever the table now says."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    x, res = torch.randn(m, h, device=dev, dtype=bf), torch.randn(m, h, device=dev, dtype=bf)
    nw = torch.ones(h, device=dev, dtype=bf)
    wq, b = torch.randn(n_qkv, h, device=dev, dtype=bf) * h ** -0.5, torch.randn(n_qkv, device=dev, dtype=bf)
    wgu = torch.randn(2 * inter, h, device=dev, dtype=bf) * h ** -0.5

    def norm_unfused():
        hh, _ = triton_ops.rms_norm(x, nw, 1e-6, res)
        return F.linear(hh, wq, b)

    return {
        "norm_qkv_fused_us": graph_us(lambda: triton_ops.rms_norm_linear(x, res, nw, 1e-6, wq, b), calls),
        "norm_qkv_unfused_cublas_us": graph_us(norm_unfused, calls),
        "gate_up_silu_fused_us": graph_us(lambda: triton_ops.linear_silu_and_mul(x, wgu), calls),
        "gate_up_silu_unfused_cublas_us": graph_us(lambda: triton_ops.silu_and_mul(F.linear(x, wgu)), calls),
        "gate_up_silu_max_abs_err": (triton_ops.linear_silu_and_mul(x, wgu).float()
                                     - ops.silu_and_mul(F.linear(x, wgu)).float()).abs().max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-1.5b,llama-3.1-8b,qwen2.5-0.5b",
                    help="shape names of specserve/model/shapes.py ('' for none)")
    ap.add_argument("--nk", default="", help="more linears as NxK pairs (weight [N, K]), e.g. 6144x4096,4096x4096")
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="copy bandwidth for the % column")
    ap.add_argument("--write", action="store_true", help="write the engine's table for this GPU")
    ap.add_argument("--merge", action="store_true",
                    help="with --write: keep the table's entries for shapes not measured in this run")
    args = ap.parse_args()
    t0 = time.time()
    name = torch.cuda.get_device_name()
    results = []
    table = dict(triton_gemv.config_table(name)) if args.merge else {}
    measured: set[str] = set()
    print(f"{'shape':14} {'linear':8} {'M':>2} {'cuBLAS us':>9} {'GEMV us':>8} {'GEMV GB/s':>9} {'% peak':>6} tiles")
    todo = [(shape, lin, nk) for shape in filter(None, args.shapes.split(",")) for lin, nk in linears(shape).items()]
    todo += [("custom", pair, tuple(int(v) for v in pair.split("x"))) for pair in filter(None, args.nk.split(","))]
    for shape, lin, (n, k) in todo:
        for m in (int(v) for v in args.ms.split(",")):
            best, rows = tune(n, k, m, args.calls)
            gbs = n * k * 2 / best["gemv_us"] / 1e3 if best["gemv_us"] else 0.0
            key = triton_gemv.config_key(n, k, m)
            win = best["gemv_us"] is not None and best["gemv_us"] < best["cublas_us"]
            if key not in measured or win:  # M rounds up to a power of two: keep the best of a key's runs
                table[key] = list(best["tiles"]) if win else [0, 0, 0]
                measured.add(key)
            results.append({"shape": shape, "linear": lin, "n": n, "k": k, "m": m, **best, "sweep": rows})
            print(f"{shape:14} {lin:8} {m:2} {best['cublas_us']:9.2f} {best['gemv_us'] or 0:8.2f} {gbs:9.0f} "
                  f"{100 * gbs / args.peak_gbs:5.1f}% {best['tiles']}", flush=True)
    if args.write:
        path = triton_gemv.CONFIG_DIR / f"{name.replace(' ', '_')}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"device": name, "torch": torch.__version__, "by": "bench/gemv_tune.py",
                                    "configs": dict(sorted(table.items()))}, indent=1) + "\n")
        triton_gemv.config_table.cache_clear()
        print(f"wrote {path}")
    fused = {}
    for shape in filter(None, args.shapes.split(",")):
        li = linears(shape)
        for m in (int(v) for v in args.ms.split(",")):
            f = fused_times(li["qkv"][0], li["o"][0], li["down"][1], m, args.calls)
            fused[f"{shape},m={m}"] = f
            print(shape, m, {k: round(v, 3) for k, v in f.items()})
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gemv_tune.json"), "w") as fh:
        json.dump({"device": name, "table": table, "results": results, "fused": fused,
                   "seconds": time.time() - t0}, fh, indent=1)
    if args.write:
        import shutil
        shutil.copy(triton_gemv.CONFIG_DIR / f"{name.replace(' ', '_')}.json", out)


if __name__ == "__main__":
    main()
