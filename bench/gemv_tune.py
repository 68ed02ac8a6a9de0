"""Tune and time the small-batch GEMV (model/layers/triton_gemv.py) against cuBLAS on this GPU.

For every linear of the given model shapes (qkv, o, gate_up, down) and rows M in --ms, it times
cuBLAS (F.linear) and each GEMV tile config (BLOCK_N, BLOCK_K, num_warps) inside a CUDA graph of
--calls back-to-back calls (as a decode step replays them), keeps the fastest, and writes the
table the engine reads: specserve/model/layers/gemv_configs/<device>.json (--write), with
[0, 0, 0] where cuBLAS won. Then, per shape and M, it measures whether the RMSNorm before qkv
and before gate_up (+ silu) pays fused into the projection (single tiles where K <= 2048, so no
pre-pass over x) against the norm kernel and the projection apart, and writes the decision:
"norm_fuse" {"N,K,M": true | false} and, for the true ones, "norm_fuse_tiles" {"N,K,M":
[BLOCK_N, BLOCK_K, num_warps]} (as `_launch` takes them; triton_gemv.norm_fuse_table reads
both). Last it times the fused calls as the model makes them against their unfused pair. Prints
a table (us per call, GB/s of weight read, % of the copy bandwidth --peak-gbs) and writes
$OUT/gemv_tune.json.

Cold weights: every timed call reads its weight from HBM, as in a decode step, where each layer's
weights were last read a whole step (GBs) ago. Replaying one weight --calls times kept it in L2
(50 MB on the H200) for every matrix smaller than that, so the tiles were tuned for an L2-resident
weight (1.5B down: timed 7.2 us that way, 12.5 us in a decode step's profile, whose HBM floor is
~6.5 us). So each timing allocates `weight_copies` copies that together exceed twice the L2
(at least 2), and call i of the graph reads copy i % copies; x stays the same (it is hot in the
model too: the previous kernel just wrote it).

    python bench/gemv_tune.py --shapes qwen2.5-1.5b,llama-3.1-8b --write
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.model.layers import ops, triton_gemv, triton_ops  # noqa: E402
from specserve.model.shapes import SHAPES  # noqa: E402

BLOCK_NS = (1, 2, 4, 8, 16, 32)
BLOCK_KS = (256, 512, 1024, 2048)
WARPS = (4, 8)
# A BLOCK_K above this only as the one tile of a whole reduction (K <= 2048): a longer loop step
# buys nothing the prefetching loop does not, and holds twice the registers.
MAX_LOOP_BLOCK_K = 1024
# Weight elements one thread holds per tile (converted to fp32, so registers); past 128 the kernel
# spills (a thread has 255 registers, and the prefetching loop holds two tiles).
MAX_TILE_PER_THREAD = 128
# ... and at least one 16-byte load of bf16 per thread, else threads hold copies of the same lanes.
MIN_TILE_PER_THREAD = 8
EPS = 1e-6


def linears(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the model's fused projections."""
    c = SHAPES[shape]
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv, h, inter = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["hidden_size"], \
        c["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def weight_copies(weight_bytes: int, l2_bytes: int) -> int:
    """How many copies of a weight to cycle through so none is still in L2 when read again: together
    they exceed twice the L2 (LRU-ish eviction is not exact), and there are at least 2."""
    return max(2, 2 * l2_bytes // weight_bytes + 1)


def candidates(n: int, k: int, num_sms: int) -> list[tuple[int, int, int]]:
    """The (BLOCK_N, BLOCK_K, num_warps) worth timing for a weight [n, k], pruned of tiles that
    cannot win: a BLOCK_K past next_power_of_2(k) (only more masked lanes) or past MAX_LOOP_BLOCK_K
    without covering all of k, fewer programs than SMs (idle SMs; BLOCK_N 1 stays), more weight per
    thread than registers hold (MAX_TILE_PER_THREAD) or less than one vector load of it (unless no
    tile of a small matrix has that much: then its tiles with the fewest warps)."""
    full = triton.next_power_of_2(k)
    block_ks = [bk for bk in BLOCK_KS if bk < full and bk <= MAX_LOOP_BLOCK_K]
    if full <= BLOCK_KS[-1]:
        block_ks.append(full)  # one tile over the whole reduction
    fit = [(bn, bk, nw) for bn, bk, nw in itertools.product(BLOCK_NS, block_ks, WARPS)
           if (bn == 1 or triton.cdiv(n, bn) >= num_sms) and bn * bk <= MAX_TILE_PER_THREAD * 32 * nw]
    vector = [(bn, bk, nw) for bn, bk, nw in fit if bn * bk >= MIN_TILE_PER_THREAD * 32 * nw]
    return vector or [t for t in fit if t[2] == WARPS[0]]


def fused_candidates(n: int, k: int, num_sms: int, silu_out: bool) -> list[tuple[int, int, int]]:
    """Tiles for an RMSNorm fused into the [n, k] projection, as `_launch` takes them: single tiles
    only (the norm then reads x once; a loop makes a pre-pass over it), [] where k > 2048. With a
    silu epilogue a program reads BLOCK_N rows of gate and of up: BLOCK_N is the plain tile's half."""
    full = triton.next_power_of_2(k)
    tiles = [t for t in candidates(n, k, num_sms) if t[1] == full]
    if silu_out:
        tiles = [(bn // 2, bk, nw) for bn, bk, nw in tiles if bn >= 2]
    return tiles


def graph_us(fn: Callable[[int], object], calls: int, reps: int = 5) -> float:
    """Median us per call of `fn(i)`, i = 0 .. calls - 1, replayed inside one CUDA graph."""
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
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


def cold(w: torch.Tensor) -> list[torch.Tensor]:
    """`w` and copies of it that together exceed twice the L2: call i reads copy i % len."""
    dev = w.device
    n = weight_copies(w.numel() * w.element_size(), torch.cuda.get_device_properties(dev).L2_cache_size)
    return [w] + [w.clone() for _ in range(n - 1)]


def tune(n: int, k: int, m: int, calls: int, num_sms: int) -> tuple[dict, list]:
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ws = cold(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5)
    c = len(ws)
    ref = F.linear(x, ws[0])
    cublas = graph_us(lambda i: F.linear(x, ws[i % c]), calls)
    best, rows = None, []
    for tiles in candidates(n, k, num_sms):
        try:
            out = triton_gemv._launch(x, ws[0], None, tiles)[0]
            err = (out.float() - ref.float()).abs().max().item()
            us = graph_us(lambda i, tiles=tiles: triton_gemv._launch(x, ws[i % c], None, tiles), calls)
        except Exception as e:  # noqa: BLE001  (a config the compiler refuses: registers, shared memory)
            rows.append({"tiles": tiles, "error": repr(e)[:120]})
            continue
        rows.append({"tiles": tiles, "us": us, "max_abs_err_vs_cublas": err})
        if best is None or us < best[1]:
            best = (tiles, us)
    prefetch = None
    if best is not None:  # the early weight loads, on and off, for the winning tiles
        timed = {}
        for flag in (True, False):
            with forced_prefetch(flag):
                timed[flag] = graph_us(lambda i: triton_gemv._launch(x, ws[i % c], None, best[0]), calls)
        prefetch = min(timed, key=timed.get)
        best = (best[0], timed[prefetch])
        rows.append({"tiles": best[0], "prefetch_us": {str(f).lower(): us for f, us in timed.items()}})
    return {"cublas_us": cublas, "gemv_us": best[1] if best else None, "tiles": best[0] if best else None,
            "prefetch": prefetch, "copies": c}, rows


@contextlib.contextmanager
def forced_prefetch(flag: bool) -> Iterator[None]:
    """SPECSERVE_GEMV_PREFETCH=1/0 while timing (read at each launch, so at graph capture)."""
    old = os.environ.get("SPECSERVE_GEMV_PREFETCH")
    os.environ["SPECSERVE_GEMV_PREFETCH"] = "1" if flag else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPECSERVE_GEMV_PREFETCH", None)
        else:
            os.environ["SPECSERVE_GEMV_PREFETCH"] = old


def norm_fuse(n: int, k: int, m: int, bias: bool, silu_out: bool, calls: int, num_sms: int) -> dict:
    """Whether rms_norm + the [n, k] projection (+ silu_and_mul) pays as one launch: the best fused
    tile (the single tiles, and the projection's own) against the norm kernel followed by what the
    engine runs for the projection with the tiles in effect (`tuned_table`).
    Returns {"fuse", "tiles", "fused_us", "unfused_us", "max_abs_err", "candidates"}."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    x, res = torch.randn(m, k, device=dev, dtype=bf), torch.randn(m, k, device=dev, dtype=bf)
    norm_w = torch.randn(k, device=dev, dtype=bf) * 0.1 + 1.0
    b = torch.randn(n, device=dev, dtype=bf) if bias else None
    ws = cold(torch.randn(n, k, device=dev, dtype=bf) * k ** -0.5)
    c = len(ws)

    def unfused(i: int) -> torch.Tensor:
        h, _ = triton_ops.rms_norm(x, norm_w, EPS, res)
        if silu_out:
            return triton_gemv.linear_silu_and_mul(h, ws[i % c], triton_ops.silu_and_mul)
        return triton_gemv.linear(h, ws[i % c], b)

    unfused_us, ref = graph_us(unfused, calls), unfused(0)
    tiles = fused_candidates(n, k, num_sms, silu_out)
    own = triton_gemv.tile_config(n, k, m, dev)  # what the engine fuses with when the table says nothing
    own = triton_gemv._silu_tiles(own) if silu_out else own
    if own[0] > 0 and own not in tiles:  # (k > 2048: the only one; a loop with a pre-pass over x)
        tiles.append(own)
    best, err = None, None
    for t in tiles:
        def fused(i: int, t=t) -> torch.Tensor:
            return triton_gemv._launch(x, ws[i % c], b, t, silu_out=silu_out, norm=(norm_w, EPS, res))[0]
        try:
            e = (fused(0).float() - ref.float()).abs().max().item()
            us = graph_us(fused, calls)
        except Exception:  # noqa: BLE001  (a config the compiler refuses)
            continue
        if best is None or us < best[1]:
            best, err = (t, us), e
    fuse = best is not None and best[1] < unfused_us
    return {"fuse": fuse, "tiles": best[0] if best else None, "fused_us": best[1] if best else None,
            "unfused_us": unfused_us, "max_abs_err": err, "candidates": len(tiles)}


def fused_times(n_qkv: int, h: int, inter: int, bias: bool, m: int, calls: int) -> dict:
    """The model's fused calls vs their unfused cuBLAS pair, with whatever the table now says."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    x, res = torch.randn(m, h, device=dev, dtype=bf), torch.randn(m, h, device=dev, dtype=bf)
    nw = torch.ones(h, device=dev, dtype=bf)
    b = torch.randn(n_qkv, device=dev, dtype=bf) if bias else None
    wq = cold(torch.randn(n_qkv, h, device=dev, dtype=bf) * h ** -0.5)
    wgu = cold(torch.randn(2 * inter, h, device=dev, dtype=bf) * h ** -0.5)
    cq, cg = len(wq), len(wgu)

    def norm_unfused(i: int) -> torch.Tensor:
        hh, _ = triton_ops.rms_norm(x, nw, EPS, res)
        return F.linear(hh, wq[i % cq], b)

    def norm_gate_up_unfused(i: int) -> torch.Tensor:
        hh, _ = triton_ops.rms_norm(x, nw, EPS, res)
        return triton_ops.silu_and_mul(F.linear(hh, wgu[i % cg]))

    def norm_gate_up(i: int) -> torch.Tensor:
        return triton_gemv.rms_norm_linear_silu_and_mul(x, res, nw, EPS, wgu[i % cg], triton_ops.rms_norm,
                                                        triton_ops.silu_and_mul)[0]

    return {
        "norm_qkv_fused_us": graph_us(lambda i: triton_ops.rms_norm_linear(x, res, nw, EPS, wq[i % cq], b), calls),
        "norm_qkv_unfused_cublas_us": graph_us(norm_unfused, calls),
        "gate_up_silu_fused_us": graph_us(lambda i: triton_ops.linear_silu_and_mul(x, wgu[i % cg]), calls),
        "gate_up_silu_unfused_cublas_us": graph_us(lambda i: triton_ops.silu_and_mul(F.linear(x, wgu[i % cg])),
                                                   calls),
        "gate_up_silu_max_abs_err": (triton_ops.linear_silu_and_mul(x, wgu[0]).float()
                                     - ops.silu_and_mul(F.linear(x, wgu[0])).float()).abs().max().item(),
        "norm_gate_up_silu_us": graph_us(norm_gate_up, calls),
        "norm_gate_up_silu_unfused_cublas_us": graph_us(norm_gate_up_unfused, calls),
    }


@contextlib.contextmanager
def tuned_table(configs: dict[str, list[int]], fuse: dict[str, bool], fuse_tiles: dict[str, list[int]],
                prefetch: dict[str, bool] | None = None) -> Iterator[None]:
    """Make the engine's functions use this run's table (written or not) while it is measured."""
    saved = triton_gemv.config_table, triton_gemv.norm_fuse_table, triton_gemv.prefetch_table
    tiles = {key: tuple(value) for key, value in configs.items()}
    norm = {key: triton_gemv.NormFuse(f, tuple(fuse_tiles[key]) if key in fuse_tiles else None)
            for key, f in fuse.items()}
    early = dict(prefetch or {})
    triton_gemv.config_table, triton_gemv.norm_fuse_table = (lambda name: tiles), (lambda name: norm)
    triton_gemv.prefetch_table = lambda name: early
    try:
        yield
    finally:
        triton_gemv.config_table, triton_gemv.norm_fuse_table, triton_gemv.prefetch_table = saved


def table_json(device_name: str, configs: dict[str, list[int]], fuse: dict[str, bool],
               fuse_tiles: dict[str, list[int]], prefetch: dict[str, bool] | None = None,
               keep: dict | None = None) -> dict:
    """The engine's table file (triton_gemv.config_table / norm_fuse_table / prefetch_table read it):
    "configs" as before, the norm fusions and the measured PREFETCH choices in objects of their own,
    which older readers ignore. keep: other objects of an old table to carry over (e.g. skinny_bench's)."""
    out = {key: value for key, value in (keep or {}).items()
           if key not in ("device", "torch", "by", "configs", "norm_fuse", "norm_fuse_tiles", "prefetch")}
    return {"device": device_name, "torch": torch.__version__, "by": "bench/gemv_tune.py",
            "configs": dict(sorted(configs.items())), "norm_fuse": dict(sorted(fuse.items())),
            "norm_fuse_tiles": {key: tiles for key, tiles in sorted(fuse_tiles.items()) if fuse.get(key)},
            "prefetch": dict(sorted((prefetch or {}).items())), **out}


def fused_projections(shape: str) -> dict[str, tuple[int, int, bool, bool]]:
    """name -> (N, K, bias, silu_out) of the projections a norm comes before."""
    li = linears(shape)
    return {"qkv": (*li["qkv"], bool(SHAPES[shape].get("attention_bias")), False),
            "gate_up": (*li["gate_up"], False, True)}


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
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = list(filter(None, args.shapes.split(",")))
    ms = [int(v) for v in args.ms.split(",")]
    old = triton_gemv._table_file(name) if args.merge else {}
    table = dict(old.get("configs", {}))
    fuse, fuse_tiles = dict(old.get("norm_fuse", {})), dict(old.get("norm_fuse_tiles", {}))
    prefetch = dict(old.get("prefetch", {}))
    measured: set[str] = set()
    todo = [(shape, lin, nk) for shape in shapes for lin, nk in linears(shape).items()]
    todo += [("custom", pair, tuple(int(v) for v in pair.split("x"))) for pair in filter(None, args.nk.split(","))]
    n_plain = sum(len(candidates(n, k, num_sms)) for _, _, (n, k) in todo) * len(ms)
    n_fused = sum(len(fused_candidates(n, k, num_sms, silu)) + 1
                  for shape in shapes for n, k, _, silu in fused_projections(shape).values()) * len(ms)
    print(f"{n_plain} GEMV candidates and {n_fused} fused-norm candidates to time ({num_sms} SMs, "
          f"L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MB, cold weights)", flush=True)
    results = []
    print(f"{'shape':14} {'linear':8} {'M':>2} {'cuBLAS us':>9} {'GEMV us':>8} {'GEMV GB/s':>9} {'% peak':>6} "
          f"{'tried':>5} tiles")
    for shape, lin, (n, k) in todo:
        for m in ms:
            best, rows = tune(n, k, m, args.calls, num_sms)
            gbs = n * k * 2 / best["gemv_us"] / 1e3 if best["gemv_us"] else 0.0
            key = triton_gemv.config_key(n, k, m)
            win = best["gemv_us"] is not None and best["gemv_us"] < best["cublas_us"]
            if key not in measured or win:  # M rounds up to a power of two: keep the best of a key's runs
                table[key] = list(best["tiles"]) if win else [0, 0, 0]
                prefetch.pop(key, None)
                if win:
                    prefetch[key] = best["prefetch"]
                measured.add(key)
            results.append({"shape": shape, "linear": lin, "n": n, "k": k, "m": m, **best, "sweep": rows})
            print(f"{shape:14} {lin:8} {m:2} {best['cublas_us']:9.2f} {best['gemv_us'] or 0:8.2f} {gbs:9.0f} "
                  f"{100 * gbs / args.peak_gbs:5.1f}% {len(rows):5} {best['tiles']}", flush=True)
    print(f"tiles tuned in {time.time() - t0:.0f} s", flush=True)
    norm_results, fused, norm_measured = {}, {}, set()
    with tuned_table(table, {}, {}, prefetch):  # the unfused baseline runs the projection with this run's tiles
        for shape in shapes:
            for lin, (n, k, bias, silu) in fused_projections(shape).items():
                for m in ms:
                    r = norm_fuse(n, k, m, bias, silu, args.calls, num_sms)
                    key = triton_gemv.config_key(n, k, m)
                    norm_results[f"{shape},{lin},m={m}"] = r
                    if key not in norm_measured or r["fuse"]:
                        fuse[key] = r["fuse"]
                        fuse_tiles.pop(key, None)
                        if r["fuse"]:
                            fuse_tiles[key] = list(r["tiles"])
                        norm_measured.add(key)
                    print(f"norm+{lin:8} {shape:14} {m:2} fused {r['fused_us'] or 0:7.2f} us vs unfused "
                          f"{r['unfused_us']:7.2f} -> fuse {r['fuse']} {r['tiles']} err {r['max_abs_err']}",
                          flush=True)
    if args.write:
        path = triton_gemv.CONFIG_DIR / f"{name.replace(' ', '_')}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(table_json(name, table, fuse, fuse_tiles, prefetch, keep=old), indent=1) + "\n")
        triton_gemv.clear_tables()
        print(f"wrote {path}")
    with tuned_table(table, fuse, fuse_tiles, prefetch):
        for shape in shapes:
            li = linears(shape)
            for m in ms:
                f = fused_times(li["qkv"][0], li["o"][0], li["down"][1], bool(SHAPES[shape].get("attention_bias")),
                                m, args.calls)
                fused[f"{shape},m={m}"] = f
                print(shape, m, {k: round(v, 3) for k, v in f.items()}, flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gemv_tune.json"), "w") as fh:
        json.dump({"device": name, "table": table, "norm_fuse": fuse, "norm_fuse_tiles": fuse_tiles,
                   "results": results, "norm_fuse_results": norm_results, "fused": fused,
                   "seconds": time.time() - t0}, fh, indent=1)
    print(f"done in {time.time() - t0:.0f} s")
    if args.write:
        import shutil
        shutil.copy(triton_gemv.CONFIG_DIR / f"{name.replace(' ', '_')}.json", out)


if __name__ == "__main__":
    main()
