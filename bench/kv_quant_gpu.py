"""Quantized KV on one GPU (made for the H200): decode attention time and KV pool capacity.

1. Decode attention (one new token per sequence) at 4k / 32k / 128k context, batch 1 and 32,
   32 query heads over 8 KV heads, head_dim 128, block size 16, for bf16 / fp8 / nvfp4 KV
   (`triton_paged.paged_attention` and `triton_quant.paged_attention_quant`, each with its own
   default split-KV choice). Reported as time, ratio to bf16 at the same shape, and KV bytes read
   (data + scales) per second against a device-to-device copy measured in the same run.
   A small split sweep at batch 32 / 32k separates the split choice from the format.
   Quantized kernels are checked against the bf16 kernel run over the dequantized cache (4k).
2. Capacity: how many concurrent 4096-token requests the KV pool holds with each dtype on the
   Llama-3.1-8B shape (`LLM(model="llama-3.1-8b", load_format="dummy", max_model_len=8192,
   enforce_eager=True)`: `num_blocks * block_size // 4096`).

Prints a compact table last; writes JSON to $OUT/kv_quant.json when OUT is set.

    python bench/kv_quant_gpu.py [--skip-capacity] [--contexts 4096,32768]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.attention.triton_paged import paged_attention  # noqa: E402
from specserve.attention.triton_quant import paged_attention_quant  # noqa: E402
from specserve.kv import quant  # noqa: E402
from specserve.kv.spec import LayerKVCache, kv_format  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
DEVICE = "cuda"
FORMATS = ("bf16", "fp8", "nvfp4")


def _ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(2 ** 30, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _ms(lambda: dst.copy_(src)) / 1e6


def random_cache(name: str, num_blocks: int) -> LayerKVCache:
    """Random but valid contents (no NaN codes); timing does not depend on the values."""
    shape = (num_blocks, BS, HKV)
    if name == "bf16":
        return LayerKVCache(torch.randn(*shape, D, dtype=torch.bfloat16, device=DEVICE),
                            torch.randn(*shape, D, dtype=torch.bfloat16, device=DEVICE), None, None)

    def data(width: int, mask: int) -> torch.Tensor:
        return torch.randint(0, 256, (*shape, width), dtype=torch.uint8, device=DEVICE) & mask

    if name == "fp8":  # clearing bit 6 keeps the e4m3 exponent below the NaN pattern
        def scale() -> torch.Tensor:
            return (torch.rand(*shape, 1, device=DEVICE) * 0.01 + 1e-3).half()
        return LayerKVCache(data(D, 0xBF).view(torch.float8_e4m3fn), data(D, 0xBF).view(torch.float8_e4m3fn),
                            scale(), scale())

    def group_scale() -> torch.Tensor:
        return (torch.rand(*shape, D // 16, device=DEVICE) * 2 + 0.05).to(torch.float8_e4m3fn)
    return LayerKVCache(data(D // 2, 0xFF), data(D // 2, 0xFF), group_scale(), group_scale())


class Decode:
    """One decode step's inputs: `batch` sequences of `context` cached tokens plus the new one."""

    def __init__(self, name: str, batch: int, context: int) -> None:
        self.name, self.batch, self.seq_len = name, batch, context + 1
        blocks = triton.cdiv(self.seq_len, BS)
        self.cache = random_cache(name, batch * blocks)
        self.bt = torch.randperm(batch * blocks, device=DEVICE).view(batch, blocks).int()
        self.q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=DEVICE)
        self.cu = torch.arange(0, batch + 1, dtype=torch.int32, device=DEVICE)
        self.sl = torch.full((batch,), self.seq_len, dtype=torch.int32, device=DEVICE)
        self.out = torch.empty_like(self.q)
        self.fmt = kv_format("bfloat16" if name == "bf16" else name, torch.bfloat16)

    def run(self, num_splits: int | None = None, config: tuple[int, int, int] | None = None) -> torch.Tensor:
        """config: (block_n, num_warps, num_stages) for the quantized kernels; None = their default."""
        if self.name == "bf16":
            return paged_attention(self.q, self.cache.key, self.cache.value, self.cu, self.sl, self.bt, 1,
                                   self.seq_len, D ** -0.5, out=self.out, num_splits=num_splits)
        bn, warps, stages = config or (None, None, None)
        return paged_attention_quant(self.q, self.cache, self.fmt, self.cu, self.sl, self.bt, 1, self.seq_len,
                                     D ** -0.5, out=self.out, num_splits=num_splits, block_n=bn,
                                     num_warps=warps, num_stages=stages)

    def kv_bytes(self) -> int:
        """Bytes the step must read: every context token's K and V data and scales, once."""
        per_token_head = self.fmt.bytes_per_token_head(D)
        return 2 * self.batch * self.seq_len * HKV * per_token_head

    def error_vs_dequantized(self) -> float:
        """||quantized kernel - bf16 kernel over the dequantized cache|| / ||the latter||."""
        if self.name == "bf16":
            return 0.0

        def deq(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            n = data.shape[0] * BS
            return quant.dequantize(data.view(n, HKV, -1), scale.view(n, HKV, -1), self.fmt,
                                    torch.bfloat16).view(-1, BS, HKV, D)

        k, v = deq(self.cache.key, self.cache.key_scale), deq(self.cache.value, self.cache.value_scale)
        ref = paged_attention(self.q, k, v, self.cu, self.sl, self.bt, 1, self.seq_len, D ** -0.5)
        return ((self.run().float() - ref.float()).norm() / ref.float().norm()).item()


def decode_rows(contexts: list[int], copy_gbs: float) -> list[dict]:
    rows = []
    for batch in (1, 32):
        for context in contexts:
            base = None
            for name in FORMATS:
                p = Decode(name, batch, context)
                us = _ms(p.run) * 1e3
                base = base or us
                row = {"batch": batch, "context": context, "kv": name, "us": us, "vs_bf16": us / base,
                       "gbs": p.kv_bytes() / us / 1e3}
                row["pct_copy"] = 100 * row["gbs"] / copy_gbs
                if context == contexts[0]:
                    row["rel_err_vs_deq"] = p.error_vs_dequantized()
                rows.append(row)
                print(f"  decode B={batch} ctx={context} {name}: {us:.1f} us ({row['vs_bf16']:.2f}x bf16, "
                      f"{row['gbs']:.0f} GB/s)", flush=True)
                del p
                torch.cuda.empty_cache()
    return rows


CONFIGS = {"fp8": [(32, 4, 3), (32, 8, 3), (64, 4, 3), (64, 8, 3), (128, 8, 3)],
           "nvfp4": [(32, 4, 3), (32, 8, 3), (64, 4, 3), (64, 8, 3), (64, 4, 2)]}


def sweep(batch: int, context: int) -> dict:
    """us per call: split factors with each format's default tiles, and tile configs (block_n,
    num_warps, num_stages) of the quantized kernels with their default splits."""
    res = {}
    for name in FORMATS:
        p = Decode(name, batch, context)
        for s in (1, 2, 4, 8):
            res[f"{name} splits={s}"] = _ms(lambda: p.run(num_splits=s)) * 1e3
        for cfg in CONFIGS.get(name, []):
            res[f"{name} bn/w/st={'/'.join(map(str, cfg))}"] = _ms(lambda: p.run(config=cfg)) * 1e3
        del p
        torch.cuda.empty_cache()
    return res


def capacity_rows(model: str) -> list[dict]:
    from specserve import LLM, SamplingParams

    rows = []
    for dtype in ("bfloat16", "fp8", "nvfp4"):
        t0 = time.perf_counter()
        llm = out = None
        try:
            llm = LLM(model=model, load_format="dummy", kv_cache_dtype=dtype, max_model_len=8192,
                      enforce_eager=True, progress=False)
            blocks, block_size = llm.engine.kv.num_blocks, llm.config.cache.block_size
            # One short greedy generation: the engine's prefill + decode path over this cache works.
            out = llm.generate([list(range(1000, 1300))], SamplingParams(temperature=0.0, max_tokens=8))
            rows.append({"kv": dtype, "num_blocks": blocks, "kv_tokens": blocks * block_size,
                         "requests_4k": blocks * block_size // 4096,
                         "gen_tokens": len(out[0].outputs[0].token_ids), "build_s": time.perf_counter() - t0})
            print(f"  capacity {dtype}: {blocks} blocks, {rows[-1]['requests_4k']} x 4k requests, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as e:  # report and go on: the kernel table is already out
            print(f"  capacity {dtype}: FAILED {type(e).__name__}: {e}", flush=True)
            rows.append({"kv": dtype, "requests_4k": 0, "error": repr(e)})
        del llm, out
        gc.collect()
        torch.cuda.empty_cache()
    base = rows[0]["requests_4k"] or 1
    for r in rows:
        r["vs_bf16"] = r["requests_4k"] / base
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768,131072")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--capacity-model", default="llama-3.1-8b", help="a dummy shape from model/shapes.py")
    args = parser.parse_args()
    torch.manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    copy_gbs = copy_bandwidth()
    torch.cuda.empty_cache()
    rows = decode_rows(contexts, copy_gbs)
    swept = sweep(32, 32768)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "copy_gbs": copy_gbs,
              "shape": {"num_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "block_size": BS},
              "decode": rows, "sweep_b32_32k_us": swept, "capacity": []}
    save(result)
    print_kernel_table(result, contexts)  # before the (slow) capacity part, in case it is cut short
    if not args.skip_capacity:
        result["capacity"] = capacity_rows(args.capacity_model)
        save(result)
        print_kernel_table(result, contexts)
        print(f"capacity ({args.capacity_model} shape, max_model_len 8192, concurrent 4096-token requests): "
              + " | ".join(f"{r['kv']}: {r['requests_4k']} ({r['vs_bf16']:.2f}x)" for r in result["capacity"]))


def save(result: dict) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kv_quant.json").write_text(json.dumps(result, indent=2))


def print_kernel_table(result: dict, contexts: list[int]) -> None:
    rows, swept = result["decode"], result["sweep_b32_32k_us"]
    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}  copy "
          f"{result['copy_gbs']:,.0f} GB/s  Hq/Hkv/D = {HQ}/{HKV}/{D}, block {BS}, decode (1 new token)")
    print("B  | ctx  | " + " | ".join(f"{n:>14}" for n in FORMATS) + " | fp8/bf16 | nvfp4/bf16 | GB/s bf16/fp8/nvfp4")
    for batch in (1, 32):
        for context in contexts:
            r = {x["kv"]: x for x in rows if x["batch"] == batch and x["context"] == context}
            print(f"{batch:<2} | {context // 1024:>3}k | " + " | ".join(f"{r[n]['us']:>11.1f} us" for n in FORMATS)
                  + f" | {r['fp8']['vs_bf16']:>8.2f} | {r['nvfp4']['vs_bf16']:>10.2f} | "
                  + "/".join(f"{r[n]['gbs']:.0f}" for n in FORMATS))
    errs = {x["kv"]: x["rel_err_vs_deq"] for x in rows if "rel_err_vs_deq" in x and x["kv"] != "bf16"}
    print("rel. error, quantized kernel vs bf16 kernel on the dequantized KV (first context): "
          + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    for name in FORMATS:
        mine = {k.split(" ", 1)[1]: v for k, v in swept.items() if k.startswith(name + " ")}
        print(f"sweep B=32 32k {name} (us): " + ", ".join(f"{k} {v:.0f}" for k, v in mine.items()))


if __name__ == "__main__":
    main()
