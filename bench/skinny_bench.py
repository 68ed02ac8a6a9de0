"""Time the skinny tensor-core GEMM (model/layers/triton_skinny.py) against cuBLAS, cold weights.

For the linears of Qwen2.5-1.5B and Llama-3.1-8B (qkv, o, gate_up, down, LM head) and rows M in
--ms, it times F.linear (cuBLAS) and skinny_linear (its default config and a small sweep of
others, the fastest kept) inside a CUDA graph of --calls back-to-back calls, as a forward replays
them. The weights are cold: call i reads copy i % copies of W, with enough copies that together
they exceed 2x the L2 cache, so every call streams its weights from HBM. Every config's output is
checked against F.linear first (max abs diff). For gate_up it also times the fused
skinny_linear_silu_and_mul against F.linear + the Triton silu_and_mul.

It also times what the engine runs without skinny entries (`engine us`: the GEMV where the tuned
table has it, else cuBLAS; run bench/gemv_tune.py --write first). --write merges the configs that
beat both by WIN_MARGIN into model/layers/gemv_configs/<device>.json ("skinny" / "skinny_silu"),
which ops.linear then follows (triton_gemv.skinny_table; SPECSERVE_SKINNY=0 turns it off).

Prints a table (us per call, GB/s of weight read, skinny / cuBLAS time) and writes
$OUT/skinny_bench.json (OUT defaults to /tmp/out). Runs in ~1-2 minutes on an H200 (--budget-s
caps the sweep: past it only the default config is timed).

    python bench/skinny_bench.py [--ms 1,2,4,5,8,16] [--shapes qwen1.5b-o,llama8b-down] [--calls 50]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from env_var import env_set  # noqa: E402
from gemv_tune import graph_us, weight_copies  # noqa: E402  (bench/: the same timing as the GEMV tuner)
from json_out import write_json_atomic

from specserve.model.layers import triton_gemv, triton_ops
from specserve.model.layers import triton_skinny as sk
from specserve.kernels.pdl import use_pdl

# name -> (N, K) of weight [N, K]
SHAPES = {
    "qwen1.5b-qkv": (2048, 1536), "qwen1.5b-o": (1536, 1536), "qwen1.5b-gate_up": (17920, 1536),
    "qwen1.5b-down": (1536, 8960), "qwen1.5b-lm_head": (151936, 1536),
    "qwen0.5b-qkv": (1152, 896), "qwen0.5b-o": (896, 896), "qwen0.5b-gate_up": (9728, 896),
    "qwen0.5b-down": (896, 4864), "qwen0.5b-lm_head": (151936, 896),
    "llama8b-qkv": (6144, 4096), "llama8b-o": (4096, 4096), "llama8b-gate_up": (28672, 4096),
    "llama8b-down": (4096, 14336), "llama8b-lm_head": (128256, 4096),
}


def sweep_configs(n: int, k: int, m: int, num_sms: int) -> list[sk.SkinnyConfig]:
    """The default, then per (BLOCK_N, BLOCK_K) the split the cost model likes, 8 warps, and the
    default's split halved / doubled."""
    default = sk.default_config(n, k, m, num_sms)
    configs = [default]
    for block_n in (32, 64, 128):
        for block_k, stages in ((128, 4), (256, 3)):
            k_tiles = -(-k // block_k)
            splits = sorted({sk.effective_split(k, block_k, s)[0] for s in range(1, min(16, k_tiles) + 1)})
            cands = [sk.SkinnyConfig(block_n, block_k, s, 4, stages) for s in splits]
            configs.append(min(cands, key=lambda c: sk.estimate_us(n, k, m, c, num_sms)))
    configs.append(default._replace(num_warps=8))
    configs.append(default._replace(split_k=max(1, default.split_k // 2)))
    configs.append(default._replace(split_k=default.split_k * 2))
    unique = []
    for cfg in configs:
        cfg = cfg._replace(split_k=sk.effective_split(k, cfg.block_k, cfg.split_k)[0])
        if cfg not in unique:
            unique.append(cfg)
    return unique


def bench_shape(name: str, n: int, k: int, ms: list[int], args, deadline: float, l2_bytes: int) -> list[dict]:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w_bytes = n * k * 2
    copies = weight_copies(w_bytes, l2_bytes)  # together > 2x L2, as gemv_tune times the GEMV
    ws = [torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5 for _ in range(copies)]
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ref = F.linear(x, ws[0])
        row = {"shape": name, "n": n, "k": k, "m": m, "weight_bytes": w_bytes, "copies": copies,
               "cublas_us": graph_us(lambda i, x=x: F.linear(x, ws[i % copies]), args.calls), "sweep": []}
        configs = sweep_configs(n, k, m, num_sms)
        for j, cfg in enumerate(configs):
            if j > 0 and time.time() > deadline:
                row["sweep_cut_short"] = True
                break
            entry = {"config": cfg._asdict()}
            try:
                err = (sk.skinny_linear(x, ws[0], config=cfg).float() - ref.float()).abs().max().item()
                entry.update(max_abs_diff=err,
                             us=graph_us(lambda i, x=x, cfg=cfg: sk.skinny_linear(x, ws[i % copies], config=cfg),
                                         args.calls))
            except Exception as e:  # noqa: BLE001  (a config the compiler refuses: shared memory, registers)
                entry["error"] = repr(e)[:200]
            row["sweep"].append(entry)
        with _skinny_off():  # what the engine runs without skinny entries: the GEMV or cuBLAS
            row["engine_us"] = graph_us(lambda i, x=x: triton_ops.linear(x, ws[i % copies]), args.calls)
        timed = [e for e in row["sweep"] if "us" in e]
        row["default"] = row["sweep"][0]
        row["best"] = min(timed, key=lambda e: e["us"]) if timed else None
        row["max_abs_diff"] = max((e["max_abs_diff"] for e in timed), default=None)
        if name.endswith("gate_up"):
            row["silu"] = silu_times(x, ws, copies, args.calls, row["best"])
        rows.append(row)
        print_row(row)
    ws.clear()  # free this shape's copies before the next shape's
    torch.cuda.empty_cache()
    return rows


def _skinny_off():
    return env_set("SPECSERVE_SKINNY", "0")


def silu_times(x: torch.Tensor, ws: list[torch.Tensor], copies: int, calls: int, best: dict | None) -> dict:
    """The MLP's gate_up + activation: fused skinny (its default config, and the plain product's best
    with block_n halved: a program reads block_n rows of gate and of up) vs cuBLAS + the Triton
    silu_and_mul, and vs what the engine runs without skinny entries (the GEMV's silu epilogue or
    cuBLAS + silu_and_mul)."""
    want = triton_ops.silu_and_mul(F.linear(x, ws[0]))
    n, k = ws[0].shape
    plain = sk.default_config(n, k, x.shape[0], torch.cuda.get_device_properties(0).multi_processor_count)
    configs = [plain._replace(block_n=max(16, plain.block_n // 2))]  # the silu default (skinny_linear_silu_and_mul)
    if best is not None:
        c = sk.SkinnyConfig(**best["config"])
        configs.append(c._replace(block_n=max(16, c.block_n // 2)))
    fused = []
    for cfg in dict.fromkeys(configs):
        try:
            got = sk.skinny_linear_silu_and_mul(x, ws[0], config=cfg)
            fused.append({"config": cfg._asdict(), "max_abs_diff": (got.float() - want.float()).abs().max().item(),
                          "us": graph_us(lambda i, cfg=cfg: sk.skinny_linear_silu_and_mul(x, ws[i % copies], config=cfg),
                                         calls)})
        except Exception as e:  # noqa: BLE001
            fused.append({"config": cfg._asdict(), "error": repr(e)[:200]})
    timed = [f for f in fused if "us" in f]
    with _skinny_off():
        engine_us = graph_us(lambda i: triton_ops.linear_silu_and_mul(x, ws[i % copies]), calls)
    return {
        "fused": fused,
        "best": min(timed, key=lambda f: f["us"]) if timed else None,
        "fused_us": min((f["us"] for f in timed), default=float("nan")),
        "cublas_unfused_us": graph_us(lambda i: triton_ops.silu_and_mul(F.linear(x, ws[i % copies])), calls),
        "engine_us": engine_us,
        "max_abs_diff": max((f["max_abs_diff"] for f in timed), default=float("nan")),
    }


# Write a skinny entry only where it beats the best alternative by this margin (noise, one run).
WIN_MARGIN = 0.97


def table_entries(rows: list[dict]) -> tuple[dict, dict]:
    """("skinny", "skinny_silu") objects for the GEMV table: per "N,K,M" (M a power of two: the
    engine looks up next_power_of_2(rows)) the best config where it beat both cuBLAS and the
    engine's own choice by WIN_MARGIN."""
    plain, silu = {}, {}
    for r in rows:
        m = r["m"]
        if m & (m - 1) or r["best"] is None:
            continue
        key = f"{r['n']},{r['k']},{m}"
        if r["best"]["us"] < WIN_MARGIN * min(r["cublas_us"], r.get("engine_us", float("inf"))):
            plain[key] = list(sk.SkinnyConfig(**r["best"]["config"]))
        s = r.get("silu")
        if s and s["best"] is not None and s["fused_us"] < WIN_MARGIN * min(s["cublas_unfused_us"], s["engine_us"]):
            silu[key] = list(sk.SkinnyConfig(**s["best"]["config"]))
    return plain, silu


def write_table(rows: list[dict], device_name: str) -> Path:
    """Merge the skinny entries into model/layers/gemv_configs/<device>.json (other entries kept; the
    shapes measured here replace their old skinny entries, at every M)."""
    path = triton_gemv.CONFIG_DIR / f"{device_name.replace(' ', '_')}.json"
    table = json.loads(path.read_text()) if path.is_file() else {"device": device_name, "configs": {}}
    plain, silu = table_entries(rows)
    measured = {f"{r['n']},{r['k']}," for r in rows}
    for name, new in (("skinny", plain), ("skinny_silu", silu)):
        old = {key: v for key, v in table.get(name, {}).items() if not any(key.startswith(p) for p in measured)}
        table[name] = dict(sorted({**old, **new}.items()))
    write_json_atomic(path, table)
    triton_gemv.clear_tables()
    return path


def _cfg(c: dict) -> str:
    return f"{c['block_n']}x{c['block_k']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}"


def print_row(r: dict) -> None:
    def gbs(us: float) -> float:
        return r["weight_bytes"] / us / 1e3 if us else 0.0

    best, default = r["best"], r["default"]
    best_us = best["us"] if best else float("nan")
    default_us = default.get("us", float("nan"))
    line = (f"{r['shape']:18} {r['m']:3} {r['cublas_us']:9.2f} {gbs(r['cublas_us']):7.0f} "
            f"{r.get('engine_us', float('nan')):9.2f} {default_us:9.2f} "
            f"{best_us:9.2f} {gbs(best_us):7.0f} {best_us / r['cublas_us']:6.2f} "
            f"{r['max_abs_diff'] if r['max_abs_diff'] is not None else float('nan'):8.4f}  "
            f"{_cfg(best['config']) if best else '-'}")
    if "silu" in r:
        s = r["silu"]
        line += (f"  | silu fused {s['fused_us']:.2f} vs cuBLAS {s['cublas_unfused_us']:.2f}, engine "
                 f"{s['engine_us']:.2f} (diff {s['max_abs_diff']:.4f})")
    print(line, flush=True)


def summary(rows: list[dict], ms: list[int]) -> None:
    """Per shape and M: skinny's best us (its time / cuBLAS's, then the default config's / cuBLAS's)."""
    print("\nskinny best us (best/cuBLAS, default/cuBLAS) per M")
    print(f"{'shape':18} " + " ".join(f"{'M=' + str(m):>20}" for m in ms))
    for shape in dict.fromkeys(r["shape"] for r in rows):
        cells = []
        for m in ms:
            r = next((r for r in rows if r["shape"] == shape and r["m"] == m), None)
            if r is None or r["best"] is None:
                cells.append(f"{'-':>20}")
                continue
            dflt = r["default"].get("us", float("nan")) / r["cublas_us"]
            cells.append(f"{r['best']['us']:7.2f} ({r['best']['us'] / r['cublas_us']:4.2f},{dflt:5.2f})")
        print(f"{shape:18} " + " ".join(cells))


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    except Exception:  # noqa: BLE001  (no git on the device copy)
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--ms", default="1,2,4,5,8,16")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=100.0, help="past it, only default configs are timed")
    ap.add_argument("--write", action="store_true",
                    help="merge the winning configs into model/layers/gemv_configs/<device>.json (skinny, skinny_silu)")
    args = ap.parse_args()
    t0 = time.time()
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    ms = [int(v) for v in args.ms.split(",")]
    result = {"device": props.name, "l2_bytes": props.L2_cache_size, "sms": props.multi_processor_count,
              "torch": torch.__version__, "triton": __import__("triton").__version__, "commit": _commit(),
              "pdl": use_pdl(torch.empty(1, device="cuda")), "calls": args.calls, "rows": []}
    print(f"{props.name}, L2 {props.L2_cache_size / 2**20:.0f} MiB, {props.multi_processor_count} SMs, "
          f"PDL {result['pdl']}; bf16, cold weights, {args.calls} calls per graph")
    print(f"{'shape':18} {'M':>3} {'cuBLAS us':>9} {'GB/s':>7} {'engine us':>9} {'dflt us':>9} {'best us':>9} {'GB/s':>7} "
          f"{'sk/cuB':>6} {'max diff':>8}  best config")
    for name in filter(None, args.shapes.split(",")):
        n, k = SHAPES[name]
        result["rows"] += bench_shape(name, n, k, ms, args, t0 + args.budget_s, props.L2_cache_size)
        result["seconds"] = time.time() - t0
        write_json_atomic(out_dir / "skinny_bench.json", result)
    rows = result["rows"]
    summary(rows, ms)
    ratios = [r["best"]["us"] / r["cublas_us"] for r in rows if r["best"]]
    if ratios:
        geo = torch.tensor(ratios).log().mean().exp().item()
        print(f"geomean skinny(best)/cuBLAS time: {geo:.3f} over {len(ratios)} cases; "
              f"{time.time() - t0:.0f} s; wrote {out_dir / 'skinny_bench.json'}")
    if args.write:
        plain, silu = table_entries(rows)
        print(f"wrote {len(plain)} skinny and {len(silu)} skinny_silu entries to {write_table(rows, props.name)}: "
              f"{sorted(plain)} {sorted(silu)}")


if __name__ == "__main__":
    main()
