"""Micro-benchmark of the Triton paged-attention kernels on one GPU (made for the H200).

Decode attention (one new token per sequence) at contexts 4k / 32k / 128k, batch 1 and 32, 32 query
heads over 8 KV heads, head_dim 128, bf16, block size 16, against torch SDPA over the same KV
gathered into contiguous [B, Hkv, S, D] tensors (GQA folded into SDPA's query length, so SDPA runs
its fused kernel over each KV head once). Also: a k+1 verify batch, a 4k prefill, and small sweeps
of the split-KV factor and the KV tile. Bandwidth is reported against a device-to-device copy
measured in the same run. Prints a table last; writes JSON to $OUT/kernels.json when OUT is set.

    python bench/kernels.py [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.attention.triton_paged import (
    attention_config,
    choose_num_splits,
    paged_attention,
)

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


def _ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(2 ** 30, dtype=DTYPE, device=DEVICE)
    dst = torch.empty_like(src)
    ms = _ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


class Paged:
    def __init__(self, batch: int, context: int, query_len: int = 1) -> None:
        seq_len = context + query_len
        blocks = triton.cdiv(seq_len, BS)
        num_blocks = batch * blocks
        self.kc = torch.randn(num_blocks, BS, HKV, D, dtype=DTYPE, device=DEVICE)
        self.vc = torch.randn_like(self.kc)
        self.bt = torch.randperm(num_blocks, device=DEVICE).view(batch, blocks).int()
        self.q = torch.randn(batch * query_len, HQ, D, dtype=DTYPE, device=DEVICE)
        self.cu = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32, device=DEVICE)
        self.sl = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
        self.out = torch.empty_like(self.q)
        self.batch, self.seq_len, self.query_len = batch, seq_len, query_len
        self.scale = D ** -0.5

    def run(self, num_splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
        return paged_attention(self.q, self.kc, self.vc, self.cu, self.sl, self.bt, self.query_len,
                               self.seq_len, self.scale, out=self.out, num_splits=num_splits, block_n=block_n)

    def kv_bytes(self) -> int:
        return 2 * self.batch * self.seq_len * HKV * D * self.kc.element_size()

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, S, D] contiguous copies of the paged K and V."""
        def one(cache: torch.Tensor) -> torch.Tensor:
            g = cache[self.bt.long()].view(self.batch, -1, HKV, D)[:, :self.seq_len]
            return g.transpose(1, 2).contiguous()
        return one(self.kc), one(self.vc)

    def splits(self) -> int:
        block_m = attention_config(self.query_len, HQ // HKV, D, DTYPE)[0]
        return choose_num_splits(self.batch, self.query_len, self.seq_len, HKV, block_m // (HQ // HKV),
                                 _num_sms())


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] over k/v [B, Hkv, S, D]: the query heads of a group become SDPA's query rows."""
    batch = q.shape[0]
    out = F.scaled_dot_product_attention(q.view(batch, HKV, HQ // HKV, D), k, v, scale=scale)
    return out.reshape(batch, HQ, D)


def decode_row(batch: int, context: int, copy_gbs: float) -> dict:
    p = Paged(batch, context)
    ms = _ms(p.run)
    k, v = p.gather()
    ms_sdpa = _ms(lambda: sdpa_decode(p.q, k, v, p.scale))
    ms_gather = _ms(p.gather)
    err = (p.run().float() - sdpa_decode(p.q, k, v, p.scale).float()).abs().max().item()
    row = {"case": f"decode B={batch} ctx={context // 1024}k", "batch": batch, "context": context,
           "triton_us": ms * 1e3, "gbs": p.kv_bytes() / ms / 1e6, "sdpa_us": ms_sdpa * 1e3,
           "gather_sdpa_us": (ms_gather + ms_sdpa) * 1e3, "splits": p.splits(), "max_abs_vs_sdpa": err}
    row["pct_copy"] = 100 * row["gbs"] / copy_gbs
    row["vs_sdpa"] = ms_sdpa / ms
    if batch == 1:
        row["no_split_us"] = _ms(lambda: p.run(num_splits=1)) * 1e3
    return row  # its tensors go with this frame; main() empties the allocator's cache


def sweep(batch: int, context: int) -> dict:
    p = Paged(batch, context)
    res = {f"block_n={bn}": _ms(lambda bn=bn: p.run(block_n=bn)) * 1e3 for bn in (32, 64, 128)}
    if batch == 1:
        res.update({f"splits={s}": _ms(lambda s=s: p.run(num_splits=s)) * 1e3 for s in (16, 32, 64, 128)})
    return {"case": f"sweep B={batch} ctx={context // 1024}k, us", **res}


def verify_row(batch: int, context: int, query_len: int, copy_gbs: float) -> dict:
    p = Paged(batch, context, query_len)
    ms = _ms(p.run)
    gbs = p.kv_bytes() / ms / 1e6
    return {"case": f"verify B={batch} ctx={context // 1024}k q={query_len}", "triton_us": ms * 1e3,
            "gbs": gbs, "pct_copy": 100 * gbs / copy_gbs, "splits": p.splits()}


def prefill_row(prompt: int) -> dict:
    p = Paged(1, 0, prompt)
    ms = _ms(p.run)
    k, v = p.gather()
    q4 = p.q.view(1, prompt, HQ, D).transpose(1, 2)
    kx, vx = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    ms_sdpa = _ms(lambda: F.scaled_dot_product_attention(q4, kx, vx, is_causal=True, scale=p.scale))
    ref = F.scaled_dot_product_attention(q4, kx, vx, is_causal=True, scale=p.scale).transpose(1, 2)[0]
    err = (p.run().float() - ref.float()).abs().max().item()
    flops = 4 * HQ * D * prompt * prompt / 2  # causal: half of QK^T and PV
    return {"case": f"prefill B=1 prompt={prompt // 1024}k", "triton_us": ms * 1e3, "sdpa_us": ms_sdpa * 1e3,
            "tflops": flops / ms / 1e9, "vs_sdpa": ms_sdpa / ms, "max_abs_vs_sdpa": err}


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1 else f"{v:,.1f}"
    return str(v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="contexts 4k and 32k only")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    contexts = (4096, 32768) if args.quick else (4096, 32768, 131072)
    def freed(row: dict) -> dict:
        torch.cuda.empty_cache()
        return row

    rows = [freed(decode_row(b, c, copy_gbs)) for b in (1, 32) for c in contexts]
    extra = [verify_row(32, 4096, 5, copy_gbs), verify_row(1, 32768, 5, copy_gbs), prefill_row(4096)]
    sweeps = [freed(sweep(1, contexts[-1])), freed(sweep(32, 32768))]
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": {"num_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "block_size": BS, "dtype": "bf16"},
              "copy_gbs": copy_gbs, "decode": rows, "other": extra, "sweeps": sweeps}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kernels.json").write_text(json.dumps(result, indent=2))
    print(f"\n{result['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {copy_gbs:,.0f} GB/s (read+write)  Hq/Hkv/D = {HQ}/{HKV}/{D} bf16 block {BS}")
    cols = ["case", "triton_us", "gbs", "pct_copy", "sdpa_us", "gather_sdpa_us", "vs_sdpa", "splits",
            "no_split_us", "tflops", "max_abs_vs_sdpa"]
    print(" | ".join(cols))
    for row in rows + extra:
        print(" | ".join(fmt(row.get(c, "")) for c in cols))
    for s in sweeps:
        print(s["case"] + ": " + " | ".join(f"{k} {fmt(v)}" for k, v in s.items() if k != "case"))


if __name__ == "__main__":
    main()
