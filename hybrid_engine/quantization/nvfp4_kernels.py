"""Decode-sized NVFP4-weight projections (weight-only, Hopper): Triton.

``_nvfp4_dot_kernel`` (2..128 rows): one program per BLOCK_N outputs (and per tile of x rows)
walks the packed weight [N, K/2] uint8 in [BLOCK_KH, BLOCK_N] byte tiles (each byte = inputs 2j
and 2j+1). The low and high nibbles are decoded to e2m1 values (``_nibble_f32``, below),
multiplied by their float8 block scale (``weight_scale[n, j // 8]``; exact in bf16) and fed to
two ``tl.dot`` with the even and odd columns of x (rows padded to 16, float32 accumulation);
the global ``weight_scale_2`` multiplies each output once. Twin: ``nvfp4_linear_ref``.

``_nvfp4_fma_kernel`` (one row, dispatched for M == 1): for one row the dot kernel's 16-row MMA
tiles and their operand shuffles are overhead, and the decode of the nibbles, not the bytes read,
bounds the kernel. The packed weight is read as int32 words (8 nibbles = 8 consecutive inputs);
``_nibble_f32`` turns a nibble into float32 with ~3 integer ops and one float16 -> float32
conversion (e2m1 * 2^-14 is exactly a float16, subnormals included), each nibble position times
its x column (a static loop of 8), summed per 16-input group, times the group's block scale, and
reduced into a [BLOCK_N] accumulator every tile. On the H100 (2026-11-26,
``benchmarks/results/2026-11-26-nvfp4-gemv-h100.md``, one call): one 8B step's projections with
lm_head take 4.277 ms at the dispatch rule against 5.114 ms in bf16 (the previous decode, bytes
with an int -> float conversion and ~11 ops per value, took 6.64 ms against 4.76 ms of bf16
without lm_head in an earlier call). ``benchmarks/nvfp4_gemv.py`` compares it with the dot kernel
and bf16 on the 8B shapes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs

from .nvfp4 import GROUP, _check_k

MAX_ROWS = 128


@triton.jit
def _nibble_f32(wd, J: tl.constexpr):
    """Nibble J (bits 4J .. 4J+3) of each int32 word -> float32 e2m1 * 2^-14, exactly: the three
    magnitude bits go to bits 9-11 of a float16 (its two lowest exponent bits and top mantissa
    bit) and the sign bit to bit 15, so e >= 1 gives 2^(e-15) (1 + m/2) and e = 0 the subnormal
    m * 2^-15: e2m1 scaled by 2^-14 in both cases; the hardware float16 -> float32 conversion keeps
    them exact (2^14 goes on the output scale). Shifts are per J at compile time: ~3 integer ops
    per value (and no int -> float conversion, which bounded the previous decode)."""
    if J <= 2:
        mag = (wd << (9 - 4 * J)) & 0xE00
    else:
        mag = (wd >> (4 * J - 9)) & 0xE00
    if J <= 3:
        sgn = (wd << (12 - 4 * J)) & 0x8000
    else:
        sgn = (wd >> (4 * J - 12)) & 0x8000
    return (mag | sgn).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nvfp4_fma_kernel(x_ptr, w_ptr, bs_ptr, gs_ptr, b_ptr, y_ptr, N, KW, swn, sbn,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                      PDL: tl.constexpr = False):
    # one row of x; the packed weight read as int32 words [N, KW = K / 8] (word w holds inputs
    # 8w .. 8w+7, nibble j = input 8w + j), walked as [BLOCK_N, BLOCK_G, 2] words = BLOCK_G 16-input
    # groups (one block scale each); nibble j of every word times x[16g + 8i + j], summed per group,
    # the group's block scale, then reduced into [BLOCK_N] every tile
    z = pdl_enter(PDL)            # x is addressed from the wait's zero (triton_pdl); z * 16 keeps
    pid = tl.program_id(0) + z
    x_ptr += z * 16               # the 16-element alignment Triton vectorises x loads on
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    offs_i = tl.arange(0, 2)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * swn
    s_rows = bs_ptr + offs_n[:, None].to(tl.int64) * sbn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g0 in range(0, KW // 2, BLOCK_G):
        offs_g = g0 + tl.arange(0, BLOCK_G)
        mg = offs_g < KW // 2
        wd = tl.load(w_rows + (offs_g[:, None] * 2 + offs_i[None, :])[None, :, :],
                     mask=mn[:, None, None] & mg[None, :, None], other=0)                   # [BN, BG, 2]
        xb = x_ptr + offs_g[:, None] * 16 + offs_i[None, :] * 8                              # [BG, 2]
        part = tl.zeros([BLOCK_N, BLOCK_G, 2], dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(xb + j, mask=mg[:, None], other=0.0).to(tl.float32)
            part += _nibble_f32(wd, j) * xj[None, :, :]
        bs = tl.load(s_rows + offs_g[None, :], mask=mn[:, None] & mg[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(part, axis=2) * bs, axis=1)
    out = acc * (tl.load(gs_ptr) * 16384.0)
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
        p = tl.load(w_rows + offs_j[:, None], mask=mw, other=0).to(tl.int32)      # [BKH, BN] bytes
        # the block scale times 2^14 (exact) undoes _nibble_f32's 2^-14: lo / hi are e2m1 * scale,
        # exact in bf16 / fp16 as before
        bs = tl.load(s_rows + (offs_j // 8)[:, None], mask=mw, other=0.0).to(tl.float32) * 16384.0
        lo = (_nibble_f32(p, 0) * bs).to(x_ptr.dtype.element_ty)
        hi = (_nibble_f32(p, 1) * bs).to(x_ptr.dtype.element_ty)
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
    (one row: the dot kernel's 16-row MMA tiles and their operand shuffles are pure overhead). The
    packed weight is read as int32 words, so its rows must be 4-byte aligned (contiguous weights
    are: K / 2 is a multiple of 8)."""
    M, K = x.shape
    N = packed.shape[0]
    _check_k(K)
    _check_layout(x, packed, weight_scale, weight_scale_2)
    assert M == 1, "the FMA kernel takes one row"
    if packed.stride(0) % 4 or packed.data_ptr() % 4:
        raise ValueError(f"nvfp4_skinny_linear: the packed weight's rows must start on 4-byte boundaries "
                         f"(row stride {packed.stride(0)} bytes, offset {packed.data_ptr() % 4}); pass a "
                         "contiguous weight")
    words = packed.view(torch.int32)                        # [N, K / 8], row stride packed.stride(0) / 4
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _nvfp4_fma_kernel[(triton.cdiv(N, block_n),)](
        x, words, weight_scale, weight_scale_2, bias if bias is not None else weight_scale_2, y, N, K // 8,
        words.stride(0), weight_scale.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_G=block_g, num_warps=num_warps, **pdl_kwargs(x.device))
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
    row, else the dot kernel. Rows go in tiles of
    16 / 32 / 64 (grid axis 1); each row tile decodes the weight tiles again (from L2)."""
    M, K = x.shape
    N = packed.shape[0]
    if M == 1 and block_n is None:
        # H100 sweep of 9 configs on the 8B shapes (results/2026-11-26-nvfp4-gemv-h100.md): (8, 64, 8
        # warps) is the best or within 1.3 us of it on every projection but the few long rows (out,
        # down, q/o, k/v: 128-group tiles) and lm_head (131072 rows: 32-group tiles, 4 warps)
        if N <= 4096:
            cfg = dict(block_n=4, block_g=128, num_warps=8)
        elif N >= 65536:
            cfg = dict(block_n=8, block_g=32, num_warps=4)
        else:
            cfg = dict(block_n=8, block_g=64, num_warps=8)
        return nvfp4_skinny_linear_fma(x, packed, weight_scale, weight_scale_2, bias, **cfg)
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
