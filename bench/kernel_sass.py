"""sm_90 SASS of the nvfp4 decode attention kernel, compiled on the CPU (no GPU needed).

Compiles `triton_quant_nvfp4._paged_attention_nvfp4_v2_kernel` for each named variant at the issue's
decode shape (32 query / 8 KV heads, head_dim 128, 16-token blocks, 128-key tiles, 4 warps, 3 stages,
128-register cap, split-KV, KV heads first) with Triton's `GPUTarget("cuda", 90, 32)` and the launch's
16-byte pointer alignment, disassembles the cubin with the cuobjdump Triton ships, and counts:
- every loop (a backward branch and its target) that holds an HMMA, in program order: the first is
  the unmasked loop over the tiles every row sees in full, the second the masked one;
- per loop: instructions (the target through the branch, both included; NOPs included), a histogram
  of opcodes (first dot-separated part), barriers, shared-memory loads;
- the whole kernel's instruction count (to the last EXIT; the trailing self-branch and NOP padding
  excluded), registers, stack, spill stores / loads (ptxas -v on the kernel's own PTX).

The variant's constexprs come from `triton_quant_nvfp4.kernel_flags`, the function the launch uses,
so what is compiled here is what the GPU runs. Use Triton 3.6 (the H200's; its stage hook gives
v4 and later the 16-bit dot operand layout: on another Triton the counts are not comparable):

    PYTHONPATH=/path/to/triton-3.6:. python bench/kernel_sass.py v6 v7 [--opcodes] [--dump DIR] [--json F]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_POINTERS = {"out_ptr": "*bf16", "q_ptr": "*bf16", "key_cache_ptr": "*i16", "value_cache_ptr": "*i16",
             "key_scale_ptr": "*fp8e4nv", "value_scale_ptr": "*fp8e4nv", "part_acc_ptr": "*fp32",
             "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "cu_query_lens_ptr": "*i32", "seq_lens_ptr": "*i32",
             "block_tables_ptr": "*i32"}
_FLOATS = ("sm_scale_log2", "v_factor")
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def decode_constants(variant: str, num_kv_heads: int = 8, group: int = 4, head_dim: int = 128,
                     block_size: int = 16, block_n: int = 128, max_query_len: int = 1) -> dict:
    """The kernel's constexprs for a decode launch of `variant` on a contiguous cache
    [blocks, block_size, num_kv_heads, head_dim / 2] (what paged_attention_quant passes on the GPU)."""
    from specserve.attention import triton_quant_nvfp4 as nv

    quads, groups = head_dim // 4, head_dim // 16
    block_m = 16
    c_slot, s_slot = num_kv_heads * quads, num_kv_heads * groups
    consts = dict(C_BLOCK=block_size * c_slot, C_SLOT=c_slot, C_HEAD=quads, S_BLOCK=block_size * s_slot,
                  S_SLOT=s_slot, S_HEAD=groups, QUADS=quads, QUADS_PAD=quads, GROUPS=groups, G_PAD=groups,
                  GROUP=group, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
                  BLOCK_Q=block_m // group, BLOCK_N=block_n, SPLIT=True, HEADS_FIRST=True)
    consts.update(nv.kernel_flags(variant, on_gpu=True, offs32=True, max_query_len=max_query_len,
                                  group=group, block_m=block_m))
    return consts


def compile_variant(variant: str, num_warps: int = 4, num_stages: int = 3, maxnreg: int | None = 128, **shape):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve.attention import triton_quant_nvfp4 as nv

    fn = nv._paged_attention_nvfp4_v2_kernel
    consts = decode_constants(variant, **shape)
    missing = set(consts) - set(fn.arg_names)
    if missing:
        raise SystemExit(f"kernel has no parameters {sorted(missing)}")
    signature = {n: "constexpr" if n in consts else _POINTERS.get(n, "fp32" if n in _FLOATS else "i32")
                 for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in _POINTERS}
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else name


def parse_sass(sass: str) -> list[tuple[int, str]]:
    """(address, instruction without predicate) of every instruction line of cuobjdump -sass."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P[0-9T]\s+", "", ins)
    return ins.split()[0]


def loops(instrs: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last address) of every loop with an HMMA, closed by a backward branch, in program order."""
    found = []
    for addr, ins in instrs:
        m = re.match(r"^(?:@!?U?P[0-9T]\s+)?BRA\s+(?:`\()?(0x[0-9a-f]+)", ins)
        if m:
            target = int(m.group(1), 16)
            if target < addr and any(target <= a <= addr and _opcode(i).startswith("HMMA") for a, i in instrs):
                found.append((target, addr))
    return sorted(found)


def summarize(instrs: list[tuple[int, str]], lo: int, hi: int) -> dict:
    body = [ins for a, ins in instrs if lo <= a <= hi]
    ops = collections.Counter(_opcode(i).split(".")[0] for i in body)
    full = collections.Counter(_opcode(i) for i in body)
    return {"instructions": len(body), "opcodes": dict(ops.most_common()), "full_opcodes": dict(full.most_common()),
            "BAR": ops.get("BAR", 0), "LDS+LDSM": ops.get("LDS", 0) + ops.get("LDSM", 0),
            "STL/LDL": ops.get("STL", 0) + ops.get("LDL", 0)}


def kernel_length(instrs: list[tuple[int, str]]) -> int:
    last_exit = max(i for i, (_, ins) in enumerate(instrs) if _opcode(ins) == "EXIT")
    return last_exit + 1


def ptxas_usage(ptx: str) -> dict:
    """Registers, stack frame and spills from ptxas -v on the kernel's PTX (sm_90a, as Triton)."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d, "k.ptx")
        src.write_text(ptx)
        r = subprocess.run([_tool("ptxas"), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(d, "k.o"))],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    usage = {}
    for key, pat in (("registers", r"Used (\d+) registers"), ("stack_bytes", r"(\d+) bytes stack frame"),
                     ("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads")):
        m = re.search(pat, text)
        usage[key] = int(m.group(1)) if m else None
    return usage


def analyze(variant: str, dump: Path | None = None, **kw) -> dict:
    kernel = compile_variant(variant, **kw)
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d, "k.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            Path(dump, f"{variant}.{ext}").write_text(kernel.asm[ext])
        Path(dump, f"{variant}.sass").write_text(sass)
    instrs = parse_sass(sass)
    found = loops(instrs)
    result = {"variant": variant, "name": kernel.metadata.name, "kernel_instructions": kernel_length(instrs),
              "shared_bytes": kernel.metadata.shared, **ptxas_usage(kernel.asm["ptx"]),
              "kernel_STL/LDL": sum(_opcode(i).split(".")[0] in ("STL", "LDL") for _, i in instrs),
              "loops": [dict(first=hex(lo), last=hex(hi), **summarize(instrs, lo, hi)) for lo, hi in found]}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--max-query-len", type=int, default=1)
    ap.add_argument("--opcodes", action="store_true", help="print the unmasked loop's full opcode histogram")
    ap.add_argument("--dump", type=Path, help="write each variant's TTGIR, PTX and SASS here")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kernel_sass_"))
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # the stage hook is not part of Triton's cache key
    import triton

    print(f"triton {triton.__version__}, sm_90, decode 32/8 heads, head_dim 128, block_n {args.block_n}")
    results = [analyze(v, args.dump, block_n=args.block_n, max_query_len=args.max_query_len) for v in args.variants]
    keys = ("HMMA", "F2FP", "HMUL2", "LOP3", "IMAD", "SHF", "PRMT", "FFMA", "FMUL", "FMNMX", "MUFU", "SHFL", "LDS",
            "BAR")
    print("\n| variant | unmasked loop | masked loop | kernel | regs | stack | spill st/ld | "
          + " | ".join(keys) + " |")
    print("| --- " * (7 + len(keys)) + "|")
    for r in results:
        lp = r["loops"]
        u = lp[0] if lp else {"instructions": 0, "opcodes": {}}
        m = lp[1]["instructions"] if len(lp) > 1 else "-"
        print(f"| {r['variant']} | {u['instructions']} | {m} | {r['kernel_instructions']} | {r['registers']} | "
              f"{r['stack_bytes']} | {r['spill_stores']}/{r['spill_loads']} | "
              + " | ".join(str(u["opcodes"].get(k, 0)) for k in keys) + " |")
    if args.opcodes:
        for r in results:
            if r["loops"]:
                print(f"\n{r['variant']} unmasked loop:", json.dumps(r["loops"][0]["full_opcodes"]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
