"""bench/gemv_tune.py's pure parts: how many cold copies of a weight it cycles through, which tiles it
times, and the table it writes as the engine (triton_gemv) reads it back. No GPU needed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gemv_tune  # noqa: E402

from specserve.model.layers import triton_gemv  # noqa: E402

L2 = 50 << 20  # the H200's
H200_SMS = 132


@pytest.mark.parametrize("weight_bytes", [1, 1536 * 1536 * 2, 2048 * 1536 * 2, 17920 * 1536 * 2, L2, L2 + 1,
                                          2 * L2, 28672 * 4096 * 2])
def test_weight_copies_exceed_twice_the_l2(weight_bytes: int) -> None:
    """The fewest copies (at least 2) that together exceed 2x the L2, so a copy's next read comes after
    more than the L2 of other weights."""
    copies = gemv_tune.weight_copies(weight_bytes, L2)
    assert copies >= 2
    assert copies * weight_bytes > 2 * L2
    assert copies == 2 or (copies - 1) * weight_bytes <= 2 * L2  # no more than needed


def test_weight_copies_examples() -> None:
    assert gemv_tune.weight_copies(1536 * 1536 * 2, L2) == 23  # o_proj of the 1.5B: 4.7 MB
    assert gemv_tune.weight_copies(1536 * 8960 * 2, L2) == 4  # down: 27.5 MB, the one the profile caught
    assert gemv_tune.weight_copies(28672 * 4096 * 2, L2) == 2  # the 8B's gate_up: 235 MB


@pytest.mark.parametrize("n,k", [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (1152, 896),
                                 (6144, 4096), (4096, 14336), (100, 200), (300, 128)])
def test_candidates_are_pruned(n: int, k: int) -> None:
    full = 1 << (k - 1).bit_length()
    tiles = gemv_tune.candidates(n, k, H200_SMS)
    assert tiles and len(set(tiles)) == len(tiles)
    for bn, bk, nw in tiles:
        assert bn & (bn - 1) == 0 and bk & (bk - 1) == 0 and nw in gemv_tune.WARPS
        assert bk <= full, "a BLOCK_K past next_power_of_2(K) only masks more"
        assert bk <= gemv_tune.MAX_LOOP_BLOCK_K or bk == full, "a BLOCK_K over 1024 only as one tile"
        assert bn == 1 or -(-n // bn) >= H200_SMS, "fewer programs than SMs"
        assert bn * bk <= 128 * 32 * nw, "more than 128 elements per thread"
        assert bn * bk >= 8 * 32 * nw or n * k < 132 * 8 * 32 * 4, "less than a vector load per thread"
    single = {t for t in tiles if t[1] >= k}
    if full <= 2048:  # a tile over the whole reduction is among them, and so is BLOCK_N 1
        assert single and any(bn == 1 for bn, _, _ in single)
    else:
        assert not single


def test_candidates_examples() -> None:
    qkv = gemv_tune.candidates(2048, 1536, H200_SMS)
    assert {(1, 2048, 4), (2, 2048, 4), (2, 1024, 4), (8, 2048, 8)} <= set(qkv)
    assert (16, 2048, 4) not in qkv  # 128 programs for 132 SMs
    assert (1, 256, 8) not in qkv  # one bf16 per thread
    assert {bk for _, bk, _ in gemv_tune.candidates(1536, 8960, H200_SMS)} == {256, 512, 1024}
    # A small matrix: no tile gives each thread a vector, so the ones with the fewest warps stay.
    assert gemv_tune.candidates(300, 128, H200_SMS) == [(1, 128, 4), (2, 128, 4)]  # K under every BLOCK_KS


def test_sweep_stays_within_the_old_budget() -> None:
    """The sweep of the 1.5B and 8B shapes times no more tiles than the 5 x 3 x 2 grid before it did."""
    shapes = ("qwen2.5-1.5b", "llama-3.1-8b")
    total = sum(len(gemv_tune.candidates(n, k, H200_SMS)) for s in shapes for n, k in gemv_tune.linears(s).values())
    assert total <= 8 * 30


def test_fused_candidates() -> None:
    """A fused norm is timed with single tiles only (no pre-pass over x), as `_launch` takes them: with
    a silu epilogue BLOCK_N counts gate's rows, half the plain tile's."""
    qkv = gemv_tune.fused_candidates(2048, 1536, H200_SMS, silu_out=False)
    assert qkv and all(bk == 2048 for _, bk, _ in qkv) and (1, 2048, 4) in qkv
    gate_up = gemv_tune.fused_candidates(17920, 1536, H200_SMS, silu_out=True)
    plain = {(bn // 2, bk, nw) for bn, bk, nw in gemv_tune.candidates(17920, 1536, H200_SMS) if bk == 2048 and bn > 1}
    assert gate_up and set(gate_up) == plain
    assert gemv_tune.fused_candidates(6144, 4096, H200_SMS, silu_out=False) == []  # K > 2048: the engine's own tiles


def test_table_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the tuner writes is what the engine reads; a table from before "norm_fuse" reads as no entries."""
    monkeypatch.setattr(triton_gemv, "CONFIG_DIR", tmp_path)
    triton_gemv.clear_tables()
    try:
        old = {"device": "Old GPU", "configs": {"2048,1536,1": [2, 1024, 4]}}
        (tmp_path / "Old_GPU.json").write_text(json.dumps(old))
        assert triton_gemv.config_table("Old GPU") == {"2048,1536,1": (2, 1024, 4)}
        assert triton_gemv.norm_fuse_table("Old GPU") == {}
        written = gemv_tune.table_json("New GPU", {"2048,1536,1": [2, 2048, 4], "1536,8960,4": [0, 0, 0]},
                                       {"17920,1536,1": True, "17920,1536,4": False},
                                       {"17920,1536,1": [4, 2048, 8], "17920,1536,4": [1, 2048, 4]})
        (tmp_path / "New_GPU.json").write_text(json.dumps(written))
        assert triton_gemv.config_table("New GPU") == {"2048,1536,1": (2, 2048, 4), "1536,8960,4": (0, 0, 0)}
        assert triton_gemv.norm_fuse_table("New GPU") == {
            "17920,1536,1": triton_gemv.NormFuse(True, (4, 2048, 8)),
            "17920,1536,4": triton_gemv.NormFuse(False, None)}  # tiles of a false entry are not kept
        assert triton_gemv.prefetch_table("Old GPU") == {} and triton_gemv.prefetch_table("New GPU") == {}
    finally:
        triton_gemv.clear_tables()


def test_prefetch_entries_and_kept_sections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner's measured PREFETCH choice per shape is what the GEMV launches with (the env switch
    still wins; shapes without an entry keep the K <= PREFETCH_MAX_K rule), and a merged write keeps
    the other tools' sections (skinny_bench's)."""
    monkeypatch.setattr(triton_gemv, "CONFIG_DIR", tmp_path)
    triton_gemv.clear_tables()
    monkeypatch.setattr(triton_gemv, "_device_name", lambda device: "New GPU")
    try:
        old = {"skinny": {"1536,1536,4": [64, 128, 6, 4, 4]}, "configs": {}}
        written = gemv_tune.table_json("New GPU", {"1536,8960,1": [1, 1024, 4], "2048,1536,1": [4, 2048, 8]}, {}, {},
                                       {"1536,8960,1": True, "2048,1536,1": False}, keep=old)
        (tmp_path / "New_GPU.json").write_text(json.dumps(written))
        assert written["skinny"] == old["skinny"]
        cpu = torch.device("cpu")
        assert triton_gemv._prefetch(1536, 8960, 1, cpu) is True  # K > 2048, but measured faster with it
        assert triton_gemv._prefetch(2048, 1536, 1, cpu) is False  # K <= 2048, measured slower with it
        assert triton_gemv._prefetch(2048, 1536, 2, cpu) is True  # no entry: the rule
        assert triton_gemv._prefetch(4096, 14336, 1, cpu) is False
    finally:
        triton_gemv.clear_tables()
