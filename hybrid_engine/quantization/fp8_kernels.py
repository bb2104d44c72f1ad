"""Decode-sized FP8-weight projections: y = (x @ w_q^T) * weight_scale (+ bias), Triton.

The weights are float8_e4m3fn [N, K] (1 byte each, half the bytes of bf16, so a memory-bound
decode step reads half as much); x [M <= 8, K] is bf16/fp16 and stays so (weight-only). Every
e4m3 value is exact in bf16/fp32, so converting a weight tile is lossless; the scale (float32,
[] per tensor or [N] per channel) multiplies each output once, after the float32 accumulation.
- ``_fp8_fma_kernel`` (1 row): BLOCK_N outputs per program, a [BLOCK_N, BLOCK_K] float32 product
  tile reduced once at the end (the shape of ``models/skinny_linear``'s FMA kernel).
- ``_fp8_dot_kernel`` (2..8 rows, padded to 16): the weight tile converted to x's dtype and fed
  to ``tl.dot`` with float32 accumulation.
``fp8_linear_ref`` (``quantization/fp8.py``) is the exact twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_fma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, swn,
                    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * swn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        wt = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        xv = tl.load(x_ptr + offs_k, mask=mk, other=0.0)
        acc += wt.to(tl.float32) * xv.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if PER_CHANNEL:
        out *= tl.load(s_ptr + offs_n, mask=mn, other=0.0)
    else:
        out *= tl.load(s_ptr)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _fp8_dot_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym,
                    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * swn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        xt = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :],
                     mask=mm[:, None] & mk[None, :], other=0.0)                  # [BM, BK]
        wt = tl.load(w_rows + offs_k[:, None], mask=mk[:, None] & mn[None, :],
                     other=0.0)                                                  # [BK, BN] fp8
        acc = tl.dot(xt, wt.to(x_ptr.dtype.element_ty), acc)
    if PER_CHANNEL:
        acc *= tl.load(s_ptr + offs_n, mask=mn, other=0.0)[None, :]
    else:
        acc *= tl.load(s_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


def _check(x, w_q, weight_scale):
    if x.dim() != 2 or w_q.dim() != 2 or x.shape[1] != w_q.shape[1]:
        raise ValueError(f"fp8_skinny_linear: x {tuple(x.shape)} and weight {tuple(w_q.shape)} "
                         "must be [M, K] and [N, K]")
    if w_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_skinny_linear: weight must be float8_e4m3fn, got {w_q.dtype}")
    if x.stride(1) != 1 or w_q.stride(1) != 1:
        raise ValueError("fp8_skinny_linear: x and weight need a unit inner stride")
    if weight_scale.dtype != torch.float32 or weight_scale.numel() not in (1, w_q.shape[0]):
        raise ValueError(f"fp8_skinny_linear: weight_scale must be float32 [] or [N], got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")


def _per_channel(weight_scale, N) -> bool:
    return weight_scale.dim() == 1 and weight_scale.numel() == N > 1


def fp8_skinny_linear_fma(x, w_q, weight_scale, bias=None, *, block_n=8, block_k=1024, num_warps=8):
    """x [1, K] -> [1, N] in x.dtype."""
    _check(x, w_q, weight_scale)
    M, K = x.shape
    N = w_q.shape[0]
    assert M == 1, "the FMA kernel takes one row"
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _fp8_fma_kernel[(triton.cdiv(N, block_n),)](
        x, w_q, weight_scale, bias if bias is not None else weight_scale, y, N, K, w_q.stride(0),
        PER_CHANNEL=_per_channel(weight_scale, N),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y


def fp8_skinny_linear_dot(x, w_q, weight_scale, bias=None, *, block_n=16, block_k=512, num_warps=4,
                          num_stages=3):
    """x [M <= 16, K] -> [M, N] in x.dtype."""
    _check(x, w_q, weight_scale)
    M, K = x.shape
    N = w_q.shape[0]
    assert M <= 16, "the dot kernel takes up to 16 rows"
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    _fp8_dot_kernel[(triton.cdiv(N, block_n),)](
        x, w_q, weight_scale, bias if bias is not None else weight_scale, y, M, N, K, x.stride(0),
        w_q.stride(0), y.stride(0), PER_CHANNEL=_per_channel(weight_scale, N),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)
    return y


def fp8_skinny_linear(x, w_q, weight_scale, bias=None):
    """x [M <= 8, K]: the FMA kernel for one row, the dot kernel for more. Block sizes are the bf16
    kernels' H100 choices with BLOCK_K doubled where a bf16 tile was 512 wide (same bytes per tile);
    not yet swept for FP8 (benchmarks/quant.py measures the result against the byte roofline)."""
    M, K = x.shape
    N = w_q.shape[0]
    if M == 1:
        if N <= 4096 and N * K >= (1 << 24):
            return fp8_skinny_linear_fma(x, w_q, weight_scale, bias, block_n=4, block_k=1024, num_warps=4)
        return fp8_skinny_linear_fma(x, w_q, weight_scale, bias, block_n=8, block_k=1024, num_warps=8)
    if N >= 20000:
        return fp8_skinny_linear_dot(x, w_q, weight_scale, bias, block_n=64, block_k=256, num_stages=4)
    return fp8_skinny_linear_dot(x, w_q, weight_scale, bias, block_n=16, block_k=1024 if K >= 1024 else 512)
