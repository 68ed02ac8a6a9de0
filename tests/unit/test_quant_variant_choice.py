"""Host-side choices of the quantized-KV attention launch (no GPU: the kernels run in tests/gpu/).

- default_variant: nvfp4 takes v7 for plain decode launches bound by throughput (at least as many
  (sequence, KV head) programs as SMs, long contexts: what was timed) and v4 elsewhere; fp8 always v3.
- offsets_fit_int32: the nvfp4 kernels' OFFS32 (int32 cache offsets) only where every offset fits.
- kernel_flags / half_rows_apply: nvfp4 v7 skips the second half of a q block's rows only where no
  query row can sit there.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specserve.attention import triton_quant  # noqa: E402
from specserve.attention.triton_quant_nvfp4 import half_rows_apply, kernel_flags, offsets_fit_int32  # noqa: E402

SMS = 132


@pytest.mark.parametrize(
    "num_seqs,max_seq_len,want",
    [
        (32, 32768, "v7"),  # the shape: 256 programs before splitting
        (32, 131072, "v7"),
        (17, 16384, "v7"),  # 136 >= 132 programs, at the context threshold
        (16, 32768, "v4"),  # 128 programs: fewer than the SMs
        (1, 131072, "v4"),  # latency-bound
        (32, 4096, "v4"),  # short contexts: level on the H200
        (32, 16383, "v4"),
    ],
)
def test_nvfp4_default_variant_follows_the_launch(num_seqs: int, max_seq_len: int, want: str) -> None:
    assert triton_quant.default_variant("nvfp4", num_seqs, 8, 1, max_seq_len, SMS) == want
    assert want in triton_quant.VARIANTS["nvfp4"]


@pytest.mark.parametrize("max_query_len", [2, 5, 512])
def test_nvfp4_launches_beyond_plain_decode_keep_v4(max_query_len: int) -> None:
    # verify steps (k + 1 rows per sequence) and prefill chunks take the latency variant
    assert triton_quant.default_variant("nvfp4", 32, 8, max_query_len, 32768, SMS) == "v4"


def test_fp8_default_variant_is_fixed() -> None:
    for num_seqs, ctx in ((1, 4096), (256, 131072)):
        assert triton_quant.default_variant("fp8", num_seqs, 8, 1, ctx, SMS) == triton_quant.DEFAULT_VARIANT["fp8"]


def test_offsets_fit_int32_at_the_boundary() -> None:
    # Meta tensors: shapes and strides only, nothing allocated.
    small = torch.empty((1024, 16, 8, 32), dtype=torch.int16, device="meta")
    assert offsets_fit_int32(small)
    # 2^31 elements: the last offset is 2^31 - 1, the largest int32.
    edge = torch.empty((2**31 // (16 * 8 * 32), 16, 8, 32), dtype=torch.int16, device="meta")
    assert offsets_fit_int32(edge)
    over = torch.empty((2**31 // (16 * 8 * 32) + 1, 16, 8, 32), dtype=torch.int16, device="meta")
    assert not offsets_fit_int32(over)
    assert not offsets_fit_int32(small, over)  # every tensor must fit
    # A strided view reaches as far as its largest offset, not its element count.
    strided = torch.empty((2, 4), dtype=torch.int16, device="meta").as_strided((2, 4), (2**31 - 3, 1))
    assert not offsets_fit_int32(strided)


@pytest.mark.parametrize(
    "max_query_len,group,want",
    [
        (1, 4, True),  # the decode: 4 rows of 16
        (1, 8, True),
        (2, 4, True),  # a 2-token verify step at GQA 4
        (1, 1, True),
        (1, 9, False),
        (3, 4, False),
        (5, 2, False),
        (16, 4, False),  # prefill chunks
    ],
)
def test_v7_half_rows_only_where_no_query_row_is_in_the_second_half(max_query_len: int, group: int, want: bool) -> None:
    block_m = triton_quant.quant_attention_config(max_query_len, group, 128, "nvfp4", "v7")[0]
    assert half_rows_apply(max_query_len, group, block_m) == want
    # every query row of a sequence is below max_query_len * group in its q block (triton_quant_common._locate)
    assert not want or max_query_len * group <= block_m // 2
    flags = kernel_flags("v7", True, True, max_query_len, group, block_m)
    assert flags["HALF_ROWS"] == want and flags["K_PAIRS"] and flags["FUSED_SCALE"] and flags["ROWSUM_MMA"]
    v4 = kernel_flags("v4", True, True, max_query_len, group, block_m)
    assert v4["DOT_KWIDTH2"] and v4["DECODER"] == 1
    assert not any(v4[k] for k in ("FUSED_SCALE", "OFFS32", "ROWSUM_MMA", "HALF_ROWS", "K_PAIRS"))
    # a key cache not 4-byte aligned: v7 reads K as units
    assert not kernel_flags("v7", True, True, max_query_len, group, block_m, words_aligned=False)["K_PAIRS"]
    # the interpreter: the plain Triton decoder and Triton's own layouts
    assert kernel_flags("v7", False, True, max_query_len, group, block_m)["DECODER"] == 0
    with pytest.raises(ValueError, match="variant"):
        kernel_flags("v6", True, True, max_query_len, group, block_m)


def test_nvfp4_splits_at_least_its_minimum_where_the_context_allows() -> None:
    assert triton_quant.VARIANTS["nvfp4"] == ("v4", "v7")
    for variant in ("v4", "v7"):
        assert triton_quant.choose_num_splits_quant(32, 1, 32768, 8, 4, SMS, variant) == triton_quant.NVFP4_MIN_SPLITS
        assert triton_quant.choose_num_splits_quant(32, 1, 1024, 8, 4, SMS, variant) == 4  # 1024 // 256 keys
    # fp8: one full wave of 4 programs per SM, rounded down
    assert triton_quant.choose_num_splits_quant(32, 1, 32768, 8, 4, SMS, "v3") == (4 * SMS) // 256
