"""attention/triton_dot_layout.py: the stage hook that gives opted-in kernels 16-bit dot operand layouts.

The nvfp4 kernel is compiled here for sm_90 on the CPU (Triton ships ptxas; no GPU is needed to
compile): its v4 specialization (DOT_KWIDTH2) must come out with kWidth 2 on every dot operand where
the plain one has Triton's kWidth 4, or, on a Triton whose pass list the hook did not copy, exactly as it. The
GPU tests (tests/gpu/test_triton_quant_kv.py) run v4 against the torch reference.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specserve.attention import triton_dot_layout  # noqa: E402
from specserve.attention import triton_quant_nvfp4 as nvfp4  # noqa: E402

_POINTERS = {
    "out_ptr": "*bf16",
    "q_ptr": "*bf16",
    "key_cache_ptr": "*i16",
    "value_cache_ptr": "*i16",
    "key_scale_ptr": "*fp8e4nv",
    "value_scale_ptr": "*fp8e4nv",
    "part_acc_ptr": "*fp32",
    "part_m_ptr": "*fp32",
    "part_l_ptr": "*fp32",
    "cu_query_lens_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "block_tables_ptr": "*i32",
}


@pytest.fixture
def fresh_triton_cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Compiles that reach the stages: the hook is not part of Triton's cache key."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")


def _compile_decode_kernel(kwidth2: bool, **flags):
    """The 8B decode specialization (32 / 8 heads, head_dim 128, 16-token blocks, 128-key tiles) for sm_90
    (flags: other variant constexprs)."""
    fn = nvfp4._paged_attention_nvfp4_kernel
    consts = dict(
        C_BLOCK=16 * 8 * 32,
        C_SLOT=8 * 32,
        C_HEAD=32,
        S_BLOCK=16 * 8 * 8,
        S_SLOT=64,
        S_HEAD=8,
        QUADS=32,
        QUADS_PAD=32,
        GROUPS=8,
        G_PAD=8,
        GROUP=4,
        HEAD_DIM_PAD=128,
        BLOCK_SIZE=16,
        BLOCK_M=16,
        BLOCK_Q=4,
        BLOCK_N=128,
        SPLIT=True,
        HEADS_FIRST=True,
        DECODER=1,
        DOT_KWIDTH2=kwidth2,
        FUSED_SCALE=False,
        OFFS32=False,
        ROWSUM_MMA=False,
        HALF_ROWS=False,
        K_PAIRS=False,
    )
    consts.update(flags)
    assert set(consts) <= set(fn.arg_names)
    signature = {
        n: "constexpr" if n in consts else _POINTERS.get(n, "fp32" if n in ("sm_scale_log2", "v_factor") else "i32")
        for n in fn.arg_names
    }
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in _POINTERS}
    src = ASTSource(fn, signature, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3, maxnreg=128))


def _kwidths(ttgir: str) -> set[str]:
    import re

    return set(re.findall(r"kWidth = (\d+)", ttgir))


def test_retarget_kwidth_edits_16bit_operands_only() -> None:
    f16 = (
        "%a = ttg.convert_layout %x : tensor<16x32xf16, #blocked> -> "
        "tensor<16x32xf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>>\n"
        "%b = ttg.convert_layout %y : tensor<32x64xbf16, #blocked> -> "
        "tensor<32x64xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma1, kWidth = 4}>>\n"
    )
    out = triton_dot_layout.retarget_kwidth(f16)
    assert "kWidth = 4" not in out and out.count("kWidth = 2") == 2
    mixed = f16 + (
        "%c = ttg.convert_layout %z : tensor<16x64xi8, #blocked> -> "
        "tensor<16x64xi8, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>>\n"
    )
    assert triton_dot_layout.retarget_kwidth(mixed) is mixed  # an 8-bit dot: the module stays as it is
    assert triton_dot_layout.retarget_kwidth("module {}") == "module {}"


def test_v4_specialization_is_named_for_the_hook(fresh_triton_cache) -> None:
    plain, kw2 = _compile_decode_kernel(False), _compile_decode_kernel(True)
    assert plain.metadata.name == "_paged_attention_nvfp4_kernel"
    assert kw2.metadata.name == "_paged_attention_nvfp4_kernel" + triton_dot_layout.KWIDTH2_SUFFIX
    if triton_dot_layout._copied_triton():  # Triton 3.6, the H200's: the hook is in
        assert triton_dot_layout._installed
        assert _kwidths(plain.asm["ttgir"]) == {"4"}  # why the hook exists: the scale loads' 8-bit layout
        assert _kwidths(kw2.asm["ttgir"]) == {"2"}
        assert plain.asm["cubin"] != kw2.asm["cubin"]
    else:  # another Triton: no hook (its protocol may differ), Triton's own layouts for both
        assert not triton_dot_layout._installed
        assert _kwidths(kw2.asm["ttgir"]) == _kwidths(plain.asm["ttgir"])


def test_a_failing_retarget_falls_back_to_tritons_layouts(fresh_triton_cache, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("simulated pass failure")

    plain = _compile_decode_kernel(False)
    monkeypatch.setattr(triton_dot_layout, "_make_ttgir_kw2", broken)
    kw2 = _compile_decode_kernel(True)
    assert _kwidths(kw2.asm["ttgir"]) == _kwidths(plain.asm["ttgir"])
    assert kw2.asm["cubin"]


def test_other_kernels_compile_as_triton_makes_them(fresh_triton_cache) -> None:
    """The hook installed (on Triton 3.6) or not, a kernel that does not opt in is untouched, and a
    compile on any Triton goes through (on Triton 3.9 a hook of 3.6's shape failed every compile)."""
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        a = tl.load(a_ptr + i[:, None] * N + i[None, :])
        b = tl.load(b_ptr + i[:, None] * N + i[None, :])
        tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))

    src = ASTSource(dot_kernel, {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "N": "constexpr"}, {"N": 32})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert compiled.metadata.name == "dot_kernel" and compiled.asm["cubin"]


def test_v7_specialization_compiles_with_its_layouts(fresh_triton_cache) -> None:
    """nvfp4 v7's decode specialization: on Triton 3.6 the P.V
    operands get kWidth 2 from the hook and the QK^T operands keep the kWidth 8 that K_PAIRS's join
    gives them (a thread's K words in one 16-byte load); no 8-bit layout is left."""
    from specserve.attention.triton_quant_nvfp4 import kernel_flags

    flags = kernel_flags("v7", True, True, max_query_len=1, group=4, block_m=16)
    assert flags["HALF_ROWS"] and flags["K_PAIRS"]
    v7 = _compile_decode_kernel(True, **flags)
    assert v7.asm["cubin"]
    if triton_dot_layout._copied_triton():
        assert _kwidths(v7.asm["ttgir"]) == {"2", "8"}
