"""Decode-sized NVFP4-weight projections (weight-only, Hopper): Triton.

``_nvfp4_dot_kernel`` (2..128 rows): one program per BLOCK_N outputs (and per tile of x rows) walks the packed weight [N, K/2] uint8 in [BLOCK_KH, BLOCK_N]
byte tiles (each byte = inputs 2j and 2j+1). The low and high nibbles are decoded to e2m1 values,
multiplied by their float8 block scale (``weight_scale[n, j // 8]``; exact in bf16) and fed to
two ``tl.dot`` with the even and odd columns of x (rows padded to 16, float32 accumulation);
the global ``weight_scale_2`` multiplies each output once. Twin: ``nvfp4_linear_ref``.

``_nvfp4_fma_kernel`` (one row, dispatched for M == 1): for one row the dot kernel's 16-row MMA
tiles and their operand shuffles are overhead. On the H200 (2026-11-26, benchmarks/nvfp4_gemv.py)
the projections of one 8B decode step take 7.15 ms with it against 25.4 ms with the dot kernel,
still 1.8x the 3.94 ms of bf16: decoding the nibbles, not the bytes, bounds it. One program per BLOCK_N outputs walks the packed weight as
[BLOCK_N, BLOCK_G, 8] byte tiles (BLOCK_G groups of 16 inputs, one block scale each); nibbles are
decoded with integer ops (``_e2m1_bits``), multiplied with the even / odd inputs in float32
registers, summed per group, then scaled by the group's block scale. ``benchmarks/nvfp4_gemv.py``
compares it with the dot kernel and bf16 on the 8B shapes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4 import GROUP, _check_k

MAX_ROWS = 128


@triton.jit
def _e2m1(c):
    """uint8 codes (0..15) -> float32 e2m1 values."""
    c = c.to(tl.int32)
    mag = c & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    pow2 = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    v = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * pow2)
    return tl.where(c >= 8, -v, v)


@triton.jit
def _e2m1_bits(c):
    """int32 codes (0..15) -> float32 e2m1 values with integer ops: a magnitude index 2..7 (e >= 1)
    shifted into the float32 exponent / top mantissa bit and rebased by 126 is 2^(e-1) (1 + m/2);
    indices 0 and 1 are 0 and 0.5; bit 3 is the sign bit."""
    mag = c & 7
    v = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, v)
    return tl.where(c >= 8, -v, v)


@triton.jit
def _nvfp4_fma_kernel(x_ptr, w_ptr, bs_ptr, gs_ptr, b_ptr, y_ptr, N, KH, swn, sbn,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    # one row of x; the packed weight walked as [BLOCK_N, BLOCK_G, 8] bytes = BLOCK_G 16-input
    # groups (one block scale each) per row, contiguous in memory; the products are summed per group
    # before the group's scale multiplies them
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    offs_b = tl.arange(0, 8)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * swn
    s_rows = bs_ptr + offs_n[:, None].to(tl.int64) * sbn
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    for g0 in range(0, KH // 8, BLOCK_G):
        offs_g = g0 + tl.arange(0, BLOCK_G)
        mg = offs_g < KH // 8
        offs_j = offs_g[:, None] * 8 + offs_b[None, :]                                  # [BG, 8] bytes
        p = tl.load(w_rows + offs_j[None, :, :], mask=mn[:, None, None] & mg[None, :, None],
                    other=0).to(tl.int32)                                               # [BN, BG, 8]
        xe = tl.load(x_ptr + 2 * offs_j, mask=mg[:, None], other=0.0).to(tl.float32)   # [BG, 8]
        xo = tl.load(x_ptr + 2 * offs_j + 1, mask=mg[:, None], other=0.0).to(tl.float32)
        part = tl.sum(_e2m1_bits(p & 15) * xe[None, :, :] + _e2m1_bits(p >> 4) * xo[None, :, :], axis=2)
        bs = tl.load(s_rows + offs_g[None, :], mask=mn[:, None] & mg[None, :], other=0.0).to(tl.float32)
        acc += part * bs
    out = tl.sum(acc, axis=1) * tl.load(gs_ptr)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _nvfp4_dot_kernel(x_ptr, w_ptr, bs_ptr, gs_ptr, b_ptr, y_ptr, M, N, KH, sxm, swn, sbn, sym,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_KH: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * swn
    s_rows = bs_ptr + offs_n[None, :].to(tl.int64) * sbn
    x_rows = x_ptr + offs_m[:, None] * sxm
    for j0 in range(0, KH, BLOCK_KH):
        offs_j = j0 + tl.arange(0, BLOCK_KH)
        mj = offs_j < KH
        mw = mj[:, None] & mn[None, :]
        p = tl.load(w_rows + offs_j[:, None], mask=mw, other=0)                   # [BKH, BN] u8
        bs = tl.load(s_rows + (offs_j // 8)[:, None], mask=mw, other=0.0).to(tl.float32)
        lo = (_e2m1(p & 15) * bs).to(x_ptr.dtype.element_ty)
        hi = (_e2m1(p >> 4) * bs).to(x_ptr.dtype.element_ty)
        mx = mm[:, None] & mj[None, :]
        xe = tl.load(x_rows + 2 * offs_j[None, :], mask=mx, other=0.0)             # [BM, BKH]
        xo = tl.load(x_rows + 2 * offs_j[None, :] + 1, mask=mx, other=0.0)
        acc = tl.dot(xe, lo, acc)
        acc = tl.dot(xo, hi, acc)
    acc *= tl.load(gs_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


def nvfp4_skinny_linear_fma(x, packed, weight_scale, weight_scale_2, bias=None, *, block_n=8, block_g=32,
                            num_warps=4):
    """x [1, K] (bf16/fp16) @ dequant(packed)^T -> [1, N] in x.dtype: register FMAs, no tensor cores
    (one row: the dot kernel's 16-row MMA tiles and their operand shuffles are pure overhead)."""
    M, K = x.shape
    N = packed.shape[0]
    _check_k(K)
    _check_layout(x, packed, weight_scale, weight_scale_2)
    assert M == 1, "the FMA kernel takes one row"
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _nvfp4_fma_kernel[(triton.cdiv(N, block_n),)](
        x, packed, weight_scale, weight_scale_2, bias if bias is not None else weight_scale_2, y, N, K // 2,
        packed.stride(0), weight_scale.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_G=block_g,
        num_warps=num_warps)
    return y


def _check_layout(x, packed, weight_scale, weight_scale_2) -> None:
    M, K = x.shape
    N = packed.shape[0]
    if (packed.shape != (N, K // 2) or packed.dtype != torch.uint8 or weight_scale.shape != (N, K // GROUP)
            or weight_scale.dtype != torch.float8_e4m3fn or weight_scale_2.numel() != 1):
        raise ValueError(f"nvfp4_skinny_linear: x {tuple(x.shape)} needs weight [N, K/2] uint8, weight_scale "
                         f"[N, K/16] float8_e4m3fn, weight_scale_2 [] float32; got {tuple(packed.shape)} "
                         f"{packed.dtype}, {tuple(weight_scale.shape)} {weight_scale.dtype}, "
                         f"{tuple(weight_scale_2.shape)}")
    if x.stride(1) != 1 or packed.stride(1) != 1 or weight_scale.stride(1) != 1:
        raise ValueError("nvfp4_skinny_linear: x, weight and weight_scale need a unit inner stride")


def nvfp4_skinny_linear(x, packed, weight_scale, weight_scale_2, bias=None, *, block_n=None,
                        block_kh=256, num_warps=4, num_stages=3):
    """x [M <= 128, K] (bf16/fp16) @ dequant(packed)^T -> [M, N] in x.dtype: the FMA kernel for one
    row (configs from the 2026-11-26 H200 sweep), else the dot kernel. Rows go in tiles of
    16 / 32 / 64 (grid axis 1); each row tile decodes the weight tiles again (from L2)."""
    M, K = x.shape
    N = packed.shape[0]
    if M == 1 and block_n is None:
        cfg = dict(block_n=4, block_g=64) if N <= 4096 else dict(block_n=8, block_g=32)
        return nvfp4_skinny_linear_fma(x, packed, weight_scale, weight_scale_2, bias, **cfg, num_warps=4)
    _check_k(K)
    _check_layout(x, packed, weight_scale, weight_scale_2)
    assert M <= MAX_ROWS, f"the NVFP4 kernel takes up to {MAX_ROWS} rows"
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    if block_n is None:
        block_n = 64 if N >= 20000 else 16
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    _nvfp4_dot_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
        x, packed, weight_scale, weight_scale_2, bias if bias is not None else weight_scale_2, y, M, N, K // 2,
        x.stride(0), packed.stride(0), weight_scale.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KH=block_kh, num_warps=num_warps, num_stages=num_stages)
    return y
