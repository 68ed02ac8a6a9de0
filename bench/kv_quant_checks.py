"""bench/kv_quant_gpu.py's shapes, launch configs and correctness checks: the tests' mixed batch
against TorchRefBackend in float64, and the decode problem (`Decode`) with its float32 SDPA reference.

DEVICE, SWEEP_SHAPE, BATCHES and SPLIT_SWEEP are set here for the whole run (kv_quant_gpu --smoke
switches them to the CPU interpreter's tiny shapes); read them as kv_quant_checks.NAME.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.attention import triton_quant  # noqa: E402
from specserve.attention.base import AttentionMetadata  # noqa: E402
from specserve.attention.torch_ref import TorchRefBackend, gather_padded  # noqa: E402
from specserve.attention.triton_paged import paged_attention  # noqa: E402
from specserve.kv import quant  # noqa: E402
from specserve.kv.spec import KVFormat, LayerKVCache, kv_format  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
DEVICE = "cuda"
TARGET = {"fp8": 0.65, "nvfp4": 0.45}  # issue 6: time vs bf16 at batch 32, 32k context
SWEEP_SHAPE = (32, 32768)
BATCHES = (32, 1)
# Launch configs per (format, variant); the first ({}) is the library default. Keys are
# paged_attention_quant's arguments (maxnreg 0: no register cap).
CONFIGS = {
    # Dropped after the H200 run of 2026-11-30 (docs/benchmarks.md, eighth session): fp8 v3 maxnreg=0
    # (0.70x), block_n=32 (0.96x), 8 warps (0.84-1.17x); nvfp4 v3 maxnreg=0 (0.73x), 8 warps (0.87x),
    # block_n=32 (1.04x). Fewer warps per program are the open question: a 16-row decode tile split over
    # 4 warps by keys needs a cross-warp row max / sum and P's layout change through shared memory per tile.
    ("fp8", "v1"): [{}],
    ("fp8", "v3"): [{}, {"num_warps": 2}, {"num_warps": 2, "block_n": 64}, {"num_stages": 4}],
    ("nvfp4", "v1"): [{}],
    ("nvfp4", "v2"): [{}],
    # nvfp4 v3 with fewer warps per program was 1.5-2.8x slower (ninth session). The fourteenth session
    # asks whether more programs per SM help: 4 fit at 128 registers, 5 at 96, with spills (sm_90
    # ptxas on the CPU: 152 bytes at 128-key tiles, 56 at 64-key tiles with a few reloads in the loop),
    # and the splits must grow to fill them.
    # At 96 registers and more splits it was slower (fourteenth session: 636-881 us against 595), so v3
    # keeps two. v4 (v3 with 16-bit dot operand layouts, triton_dot_layout.py): 64-key tiles at 96
    # registers and 5 splits took 636 us against 542 by default; 16 splits 542, 2 stages 542 against
    # 535 (fifteenth session). Its default takes at least 8 splits, so 2 (one wave) is the comparison.
    ("nvfp4", "v3"): [{}, {"num_splits": 8}],
    ("nvfp4", "v4"): [{}, {"num_splits": 2}, {"num_splits": 12}, {"num_stages": 4}],
    # v5: v4 with the score scale in exp2's fma and int32 cache offsets (917 against 961 sm_90
    # instructions per 128-key tile, sixteenth session).
    ("nvfp4", "v5"): [{}, {"num_splits": 12}, {"num_stages": 4}],
    # v6: v5 with the softmax denominator from a dot with ones (900 instructions, 6 barriers against 9).
    ("nvfp4", "v6"): [{}, {"num_splits": 12}, {"num_stages": 4}],
    # v7: v6 with the softmax of the first 8 of a decode tile's 16 rows only (the rest are padding) and K
    # decoded from 32-bit words without a byte permute (sm_90 SASS of the unmasked loop: 815 against 882
    # instructions, bench/kernel_sass.py).
    ("nvfp4", "v7"): [{}, {"num_splits": 12}, {"num_stages": 4}],
}
SPLIT_SWEEP = (1, 2, 3, 4, 8)
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def cfg_name(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"


def _us(fn) -> float:
    if DEVICE == "cpu":  # --smoke: Triton's interpreter, one timed call
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(2 ** (29 if DEVICE == "cuda" else 16), dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (_us(lambda: dst.copy_(src)) * 1e3)


# ----------------------------------------------------------------------------- correctness (a)

MIXED = [(0, 37), (48, 20), (37, 19), (70, 1), (33, 5), (100, 4), (16, 16), (0, 1)]


def mixed_batch_check(name: str, variant: str, seed: int = 0) -> dict:
    """The tests' mixed batch: kernels (write + attention) vs TorchRefBackend in float64."""
    fmt = kv_format(name, torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    group, hkv, block = 4, 2, 16
    counts = [math.ceil((c + n) / block) for c, n in MIXED]
    perm = torch.randperm(sum(counts) + 3, generator=gen).tolist()
    tables, at = [], 0
    for n in counts:
        tables.append(perm[at:at + n])
        at += n
    cpu = LayerKVCache(*(t.cpu() for t in _empty_cache(fmt, len(perm), block, hkv, "cpu")))
    for (c, _), t in zip(MIXED, tables):
        slots = torch.tensor([t[p // block] * block + p % block for p in range(c)], dtype=torch.long)
        quant.write_kv(cpu, fmt, slots, torch.randn(c, hkv, D, generator=gen), torch.randn(c, hkv, D, generator=gen) * 3)
    num_tokens = sum(n for _, n in MIXED)
    q = torch.randn(num_tokens, group * hkv, D, generator=gen).bfloat16()
    k = torch.randn(num_tokens, hkv, D, generator=gen).bfloat16()
    v = (torch.randn(num_tokens, hkv, D, generator=gen) * 3).bfloat16()
    slots = torch.tensor([tables[b][p // block] * block + p % block for b, (c, n) in enumerate(MIXED)
                          for p in range(c, c + n)], dtype=torch.long)
    bt = torch.zeros(len(MIXED), max(counts), dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    query_lens, seq_lens = [n for _, n in MIXED], [c + n for c, n in MIXED]
    cu = torch.tensor([sum(query_lens[:i]) for i in range(len(MIXED) + 1)], dtype=torch.int32)
    meta = AttentionMetadata(cu, torch.tensor(seq_lens, dtype=torch.int32), bt, slots, max(query_lens),
                             max(seq_lens), len(MIXED), num_tokens, query_lens, seq_lens)
    # Reference: the oracle writes the new tokens too, then float64 attention over the dequantized cache.
    ref_cache = LayerKVCache(*(t.clone() for t in cpu))
    quant.write_kv(ref_cache, fmt, slots, k, v)
    f64 = KVFormat("float64", torch.float64, 1, None, None)
    deq = [_dequantize_all(d, s, fmt, torch.float64) for d, s in ((ref_cache.key, ref_cache.key_scale),
                                                                  (ref_cache.value, ref_cache.value_scale))]
    k_new, v_new = deq[0].view(-1, hkv, D)[slots], deq[1].view(-1, hkv, D)[slots]
    ref = TorchRefBackend().forward(q.double(), k_new, v_new, LayerKVCache(deq[0], deq[1], None, None), f64, meta,
                                    D ** -0.5)
    dev = LayerKVCache(*(t.to(DEVICE) for t in cpu))
    triton_quant.reshape_and_cache_quant(k.to(DEVICE), v.to(DEVICE), dev, fmt, slots.to(DEVICE))
    written_ok = all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dev, ref_cache))
    res = {}
    for splits in (None, 3):
        out = triton_quant.paged_attention_quant(
            q.to(DEVICE), dev, fmt, cu.to(DEVICE), meta.seq_lens.to(DEVICE), bt.to(DEVICE), meta.max_query_len,
            meta.max_seq_len, D ** -0.5, num_splits=splits, variant=variant)
        res[f"splits={splits or 'auto'}"] = _errors(out.cpu().double(), ref)
    worst = max(r["max_abs"] for r in res.values())
    rel = max(r["rel"] for r in res.values())
    return {"write_bit_exact": written_ok, "max_abs": worst, "rel": rel, "runs": res,
            "ok": bool(written_ok and worst < 5e-2 and rel < 1e-2)}


def _empty_cache(fmt: KVFormat, num_blocks: int, block: int, heads: int, device: str) -> LayerKVCache:
    shape = (num_blocks, block, heads, fmt.packed_dim(D))
    sshape = shape[:3] + (fmt.num_scale_groups(D),)
    return LayerKVCache(torch.zeros(shape, dtype=torch.uint8, device=device).view(fmt.storage_dtype),
                        torch.zeros(shape, dtype=torch.uint8, device=device).view(fmt.storage_dtype),
                        torch.ones(sshape, device=device).to(fmt.scale_dtype),
                        torch.ones(sshape, device=device).to(fmt.scale_dtype))


def _dequantize_all(data: torch.Tensor, scale: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    nb, bs, h, p = data.shape
    full = quant.dequantize(data.reshape(-1, h, p), scale.reshape(-1, h, scale.shape[-1]), fmt, dtype)
    return full.view(nb, bs, h, -1)


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (out.double() - ref.double())
    return {"max_abs": diff.abs().max().item(), "rel": (diff.norm() / ref.double().norm()).item(),
            "ref_max": ref.abs().max().item(), "nan": bool(torch.isnan(out).any())}


# ----------------------------------------------------------------------------- decode problems

def random_cache(name: str, num_blocks: int) -> LayerKVCache:
    """Random but valid contents (no NaN codes); timing does not depend on the values."""
    shape = (num_blocks, BS, HKV)
    if name == "bf16":
        return LayerKVCache(torch.randn(*shape, D, dtype=torch.bfloat16, device=DEVICE),
                            torch.randn(*shape, D, dtype=torch.bfloat16, device=DEVICE), None, None)

    def data(width: int, mask: int) -> torch.Tensor:
        return torch.randint(0, 256, (*shape, width), dtype=torch.uint8, device=DEVICE) & mask

    if name == "fp8":
        def codes() -> torch.Tensor:  # any e4m3 byte but the NaNs (0x7F, 0xFF): values up to +-448
            x = data(D, 0xFF)
            return torch.where((x & 0x7F) == 0x7F, x - 1, x).view(torch.float8_e4m3fn)

        def scale() -> torch.Tensor:
            return (torch.rand(*shape, 1, device=DEVICE) * 0.01 + 1e-3).half()
        return LayerKVCache(codes(), codes(), scale(), scale())

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
        gen = torch.Generator(device=DEVICE).manual_seed(batch * 7 + context)
        self.q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=DEVICE, generator=gen)
        self.cu = torch.arange(0, batch + 1, dtype=torch.int32, device=DEVICE)
        self.sl = torch.full((batch,), self.seq_len, dtype=torch.int32, device=DEVICE)
        self.out = torch.empty_like(self.q)
        self.fmt = kv_format("bfloat16" if name == "bf16" else name, torch.bfloat16)

    def run(self, variant: str | None = None, **cfg) -> torch.Tensor:
        if self.name == "bf16":
            return paged_attention(self.q, self.cache.key, self.cache.value, self.cu, self.sl, self.bt, 1,
                                   self.seq_len, D ** -0.5, out=self.out, num_splits=cfg.get("num_splits"))
        return triton_quant.paged_attention_quant(self.q, self.cache, self.fmt, self.cu, self.sl, self.bt, 1,
                                                  self.seq_len, D ** -0.5, out=self.out, variant=variant, **cfg)

    def kv_bytes(self) -> int:
        """Bytes the step must read: every context token's K and V data and scales, once."""
        return 2 * self.batch * self.seq_len * HKV * self.fmt.bytes_per_token_head(D)

    def reference(self) -> torch.Tensor:
        """float32 SDPA over the dequantized cache: [B, HQ, D]."""
        key, value = gather_padded(self.cache, self.fmt, self.bt, torch.float32)  # [B, L_pad, HKV, D]
        key, value = key[:, :self.seq_len].transpose(1, 2), value[:, :self.seq_len].transpose(1, 2)
        out = F.scaled_dot_product_attention(self.q.float().unsqueeze(2), key, value, scale=D ** -0.5,
                                             enable_gqa=True)
        return out.squeeze(2)
