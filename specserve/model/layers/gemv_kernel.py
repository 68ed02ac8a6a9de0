"""The GEMV's Triton kernel (`_gemv_kernel`); triton_gemv.py launches it and says what it computes."""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.pdl import pdl_prologue
from specserve.model.layers.triton_skinny import _store_out


@triton.jit
def _load_weights(w_rows, up_rows, norm_w_ptr, offs_k, w_mask, k_ok, SILU_OUT: tl.constexpr, RMS_NORM: tl.constexpr):
    """A single-tile program's weights: its W rows (and up's), and the norm's weight (else a dummy)."""
    w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
    w_up = w
    if SILU_OUT:
        w_up = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0)
    norm_w = k_ok.to(tl.float32)
    if RMS_NORM:
        norm_w = tl.load(norm_w_ptr + offs_k, mask=k_ok, other=0.0)
    return w, w_up, norm_w


@triton.jit
def _single_tile(
    x_ptr,
    res_ptr,
    res_out_ptr,
    norm_w_ptr,
    w_rows,
    up_rows,
    n_ok,
    pid,
    M,
    K,
    stride_xm,
    stride_rm,
    stride_rom,
    eps,
    SILU_OUT: tl.constexpr,
    RMS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """(acc, acc_up) [BLOCK_M, BLOCK_N] fp32 when one tile covers the whole reduction (BLOCK_K >= K)."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    k_ok = offs_k < K
    w_mask = n_ok[:, None] & k_ok[None, :]
    # PREFETCH: all weight loads before the PDL wait (no kernel writes weights).
    if PREFETCH:
        w, w_up, norm_w = _load_weights(w_rows, up_rows, norm_w_ptr, offs_k, w_mask, k_ok, SILU_OUT, RMS_NORM)
        pdl_prologue(USE_PDL)
    else:
        pdl_prologue(USE_PDL)
        w, w_up, norm_w = _load_weights(w_rows, up_rows, norm_w_ptr, offs_k, w_mask, k_ok, SILU_OUT, RMS_NORM)
    w = w.to(tl.float32)
    w_up = w_up.to(tl.float32)
    norm_w = norm_w.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for m in tl.static_range(BLOCK_M):
        ok = k_ok & (m < M)
        xr = tl.load(x_ptr + m * stride_xm + offs_k, mask=ok, other=0.0)
        if RMS_NORM:
            # The whole row is in this tile: no pre-pass for 1/rms. Rounding as ops.rms_norm.
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + m * stride_rm + offs_k, mask=ok, other=0.0)
                xr = (xr.to(tl.float32) + r.to(tl.float32)).to(xr.dtype)
                if pid == 0:  # all programs read the old residual, so this write races with none
                    tl.store(res_out_ptr + m * stride_rom + offs_k, xr, mask=ok)
            xf = xr.to(tl.float32)
            inv = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
            normed = (xf * inv).to(xr.dtype).to(tl.float32)
            xv = (normed * norm_w).to(xr.dtype).to(tl.float32)
        else:
            xv = xr.to(tl.float32)
        is_m = offs_m[:, None] == m
        acc = tl.where(is_m, acc + tl.sum(w * xv[None, :], 1)[None, :], acc)
        if SILU_OUT:
            acc_up = tl.where(is_m, acc_up + tl.sum(w_up * xv[None, :], 1)[None, :], acc_up)
    return acc, acc_up


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    res_ptr,
    res_out_ptr,
    norm_w_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    stride_rom,
    eps,
    HAS_BIAS: tl.constexpr,
    SILU_OUT: tl.constexpr,
    RMS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    SINGLE_TILE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    # SILU_OUT: W is [2N, K] = [gate | up]; this program also owns up's rows offs_n + N.
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_rows + N * stride_wn
    if SINGLE_TILE:
        acc, acc_up = _single_tile(
            x_ptr,
            res_ptr,
            res_out_ptr,
            norm_w_ptr,
            w_rows,
            up_rows,
            n_ok,
            pid,
            M,
            K,
            stride_xm,
            stride_rm,
            stride_rom,
            eps,
            SILU_OUT,
            RMS_NORM,
            HAS_RESIDUAL,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            USE_PDL,
            PREFETCH,
        )
    else:
        # PREFETCH: each weight tile loaded one step ahead, the first before the PDL wait.
        if PREFETCH:
            offs_k = tl.arange(0, BLOCK_K)
            w_mask = n_ok[:, None] & (offs_k < K)[None, :]
            w_next = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
            w_up_next = w_next
            if SILU_OUT:
                w_up_next = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0)
        pdl_prologue(USE_PDL)
        # RMS_NORM: a pre-pass for each row's 1/rms; program 0 alone writes the new residual (all
        # programs read the old one, so nothing races).
        inv = tl.zeros([BLOCK_M], tl.float32)
        if RMS_NORM:
            for m in tl.static_range(BLOCK_M):
                sq = tl.zeros([BLOCK_K], tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    ok = (offs_k < K) & (m < M)
                    xr = tl.load(x_ptr + m * stride_xm + offs_k, mask=ok, other=0.0)
                    if HAS_RESIDUAL:
                        r = tl.load(res_ptr + m * stride_rm + offs_k, mask=ok, other=0.0)
                        xr = (xr.to(tl.float32) + r.to(tl.float32)).to(xr.dtype)
                        if pid == 0:
                            tl.store(res_out_ptr + m * stride_rom + offs_k, xr, mask=ok)
                    xf = xr.to(tl.float32)
                    sq += xf * xf
                inv = tl.where(offs_m == m, tl.rsqrt(tl.sum(sq, 0) / K + eps), inv)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            if PREFETCH:
                w = w_next.to(tl.float32)
                w_up = w_up_next.to(tl.float32)
                next_mask = n_ok[:, None] & ((offs_k + BLOCK_K) < K)[None, :]  # all false after the last tile
                w_next = tl.load(w_rows + BLOCK_K + offs_k[None, :], mask=next_mask, other=0.0)
                if SILU_OUT:
                    w_up_next = tl.load(up_rows + BLOCK_K + offs_k[None, :], mask=next_mask, other=0.0)
            else:
                w_mask = n_ok[:, None] & k_ok[None, :]
                w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
                w_up = w
                if SILU_OUT:
                    w_up = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
            if RMS_NORM:
                norm_w = tl.load(norm_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                row_ok = m < M
                x_row = x_ptr + m * stride_xm
                if RMS_NORM:
                    # Rounding as ops.rms_norm.
                    xr = tl.load(x_row + offs_k, mask=k_ok & row_ok, other=0.0)
                    if HAS_RESIDUAL:
                        r = tl.load(res_ptr + m * stride_rm + offs_k, mask=k_ok & row_ok, other=0.0)
                        xr = (xr.to(tl.float32) + r.to(tl.float32)).to(xr.dtype)
                    inv_m = tl.sum(tl.where(offs_m == m, inv, 0.0), 0)
                    normed = (xr.to(tl.float32) * inv_m).to(xr.dtype).to(tl.float32)
                    xv = (normed * norm_w).to(xr.dtype).to(tl.float32)
                else:
                    xv = tl.load(x_row + offs_k, mask=k_ok & row_ok, other=0.0).to(tl.float32)
                is_m = offs_m[:, None] == m
                acc = tl.where(is_m, acc + tl.sum(w * xv[None, :], 1)[None, :], acc)
                if SILU_OUT:
                    acc_up = tl.where(is_m, acc_up + tl.sum(w_up * xv[None, :], 1)[None, :], acc_up)
    _store_out(acc, acc_up, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, SILU_OUT)
