"""Triton gated RMSNorm, grouped (CONTRACT item 5; the modes of gated_norm.py).

One program per (block of tokens, group): g = y * silu(z) in float32, g *= rsqrt(mean(g^2) + eps)
over the group's channels, cast to y.dtype, times weight (rounded as torch rounds weight * g).
MODE 1 (norm_then_gate): norm(y) * weight * silu(z) in float32, one cast; MODE 2 (gate_only):
y * silu(z), no norm (the weight is not read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import (cdiv, device_ctx, next_pow2, tl_helpers,
                                                         triton_interpreting)
from hybrid_engine.quantization.fp8_kernels import _fast_div_ok, _quantize, _row_scale

_softplus, _silu = tl_helpers()


@triton.jit
def _gated_load(y_ptr, z_ptr, rows, mt, grp, gs, sy_t, sy_c, sz_t, sz_c, BLOCK_G: tl.constexpr,
                LD_EV: tl.constexpr):
    """Group ``grp``'s [BLOCK_T, BLOCK_G] tiles of y and z in float32, with the channel offsets and
    masks."""
    offs_c = grp * gs + tl.arange(0, BLOCK_G)
    mc = tl.arange(0, BLOCK_G) < gs
    m2 = mt[:, None] & mc[None, :]
    y = tl.load(y_ptr + rows * sy_t + offs_c[None, :] * sy_c, mask=m2, other=0.0,
                eviction_policy=LD_EV).to(tl.float32)
    z = tl.load(z_ptr + rows * sz_t + offs_c[None, :] * sz_c, mask=m2, other=0.0,
                eviction_policy=LD_EV).to(tl.float32)
    return y, z, offs_c, mc, m2


@triton.jit
def _gated_out(g, inv, w_ptr, offs_c, mc, dtype: tl.constexpr):
    """MODE 0's output tile (float32, before the final cast): the gated rows g times their inverse
    RMS, rounded to the model dtype, times the weight."""
    g = (g * inv[:, None]).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
    return g * w[None, :]


@triton.jit(do_not_specialize=["T"])
def _gated_rmsnorm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, s_ptr, T, gs, G, eps,
    sy_t, sy_c, sz_t, sz_c, so_t, so_c,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, LD_EV: tl.constexpr, ST_CM: tl.constexpr,
    MODE: tl.constexpr = 0, FP8_OUT: tl.constexpr = False, HW_ROUND: tl.constexpr = True,
    G_PAD: tl.constexpr = 1,
):
    # FP8_OUT (MODE 0, W8A8 prefill of the out_proj, ``fp8.Fp8Rows``): one program per block of
    # tokens walks every group twice, with the plain kernel's launch shape. The first walk computes
    # each group's inverse RMS from tiles that feed no store, so the sum has the plain kernel's
    # layout and order (a uint8 store of the codes would have Triton pick a 16-wide layout for the
    # tile feeding it: tests/engine/test_norm_fp8_layouts.py), keeps them ([BLOCK_T, G_PAD]), and
    # takes each row's amax of the 16-bit values. The second walk recomputes the values
    # elementwise from the kept inverse RMS and stores their e4m3 codes, quantized per token as
    # ``quantize_rows_fp8`` does (out_ptr the codes as uint8, s_ptr[row] = amax / 448). The
    # 16-bit output is never written.
    tb = tl.program_id(0)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = offs_t < T
    rows = offs_t[:, None].to(tl.int64)
    if FP8_OUT:
        cols = tl.arange(0, G_PAD)[None, :]
        inv_all = tl.zeros([BLOCK_T, G_PAD], dtype=tl.float32)
        amax = tl.zeros([BLOCK_T], dtype=tl.float32)
        nan_seen = tl.zeros([BLOCK_T], dtype=tl.int32)
        for grp in range(0, G):
            y, z, offs_c, mc, m2 = _gated_load(y_ptr, z_ptr, rows, mt, grp, gs, sy_t, sy_c, sz_t, sz_c,
                                               BLOCK_G, LD_EV)
            g = y * _silu(z)
            inv = tl.rsqrt(tl.sum(g * g, axis=1) / gs + eps)
            inv_all = tl.where(cols == grp, inv[:, None], inv_all)
            v = tl.where(m2, _gated_out(g, inv, w_ptr, offs_c, mc, y_ptr.dtype.element_ty)
                         .to(y_ptr.dtype.element_ty).to(tl.float32), 0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
            nan_seen = tl.maximum(nan_seen, tl.max((v != v).to(tl.int32), axis=1))
        s = _row_scale(amax, nan_seen)
        tl.store(s_ptr + offs_t, s, mask=mt)
        r = tl.math.div_rn(tl.full([BLOCK_T], 1.0, tl.float32), s)
        fast_div = tl.min(_fast_div_ok(s).to(tl.int32), axis=0) == 1
        # the second walk in [BLOCK_T, 2, BLOCK_G / 2] tiles: all elementwise, and a shape of its
        # own, so that the codes' 16-wide store does not set the first walk's layout (Triton
        # vectorises the memory ops of one shape alike)
        h = tl.arange(0, 2)[None, :, None] * (BLOCK_G // 2) + tl.arange(0, BLOCK_G // 2)[None, None, :]
        rows3 = offs_t[:, None, None].to(tl.int64)
        for grp in range(0, G):
            offs_c = grp * gs + h                                           # [1, 2, BLOCK_G / 2]
            mc = h < gs
            m3 = mt[:, None, None] & mc
            y = tl.load(y_ptr + rows3 * sy_t + offs_c * sy_c, mask=m3, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rows3 * sz_t + offs_c * sz_c, mask=m3, other=0.0).to(tl.float32)
            inv = tl.sum(tl.where(cols == grp, inv_all, 0.0), axis=1)     # the one kept value: exact
            g = (y * _silu(z) * inv[:, None, None]).to(y_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
            v = (g * w).to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_ptr + rows3 * so_t + offs_c * so_c,
                     _quantize(v, s[:, None, None], r[:, None, None], fast_div, HW_ROUND), mask=m3)
    else:
        y, z, offs_c, mc, m2 = _gated_load(y_ptr, z_ptr, rows, mt, tl.program_id(1), gs, sy_t, sy_c, sz_t, sz_c,
                                           BLOCK_G, LD_EV)
        if MODE == 2:                       # gate only
            out = y * _silu(z)
        elif MODE == 1:                     # norm, weight, then gate; all float32
            ms = tl.sum(y * y, axis=1) / gs
            w = tl.load(w_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
            out = y * tl.rsqrt(ms + eps)[:, None] * w[None, :] * _silu(z)
        else:
            g = y * _silu(z)
            inv = tl.rsqrt(tl.sum(g * g, axis=1) / gs + eps)
            out = _gated_out(g, inv, w_ptr, offs_c, mc, out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows * so_t + offs_c[None, :] * so_c,
                 out.to(out_ptr.dtype.element_ty), mask=m2, cache_modifier=ST_CM)


# From the H100 sweeps of 2026-11-22 (benchmarks/norm_sweep.py, intermediate 8192, group 1024,
# bf16): one token per program with 4 warps took 2.5-2.6 / 3.1 / 5.4 / 9.9 / 18.8 us at
# T = 64 / 128 / 256 / 512 / 1024 against 3.0 / 3.7-4.1 / 6.1-6.3 / 9.7 / 19.8 us for 4 tokens
# per program (the rule kept for longer inputs, 85-94% of the copy bandwidth at 2k-8k tokens).
_SMALL_T = 1024


_MODES = {"gate_then_norm": 0, "norm_then_gate": 1, "gate_only": 2}


def _launch_shape(T: int, group_size: int) -> tuple[int, int]:
    """(tokens per program, warps) of the prefill-sized launches, shared by the 16-bit and the FP8
    outputs so both compute the same sums."""
    BLOCK_G = next_pow2(group_size)
    if T <= _SMALL_T:       # decode / verify sizes: one token per program, more programs in flight
        return 1, 4
    BLOCK_T = max(1, min(16, 4096 // BLOCK_G))
    return BLOCK_T, 4 if BLOCK_T * BLOCK_G <= 4096 else 8


def triton_gated_rmsnorm(y, z, weight, group_size, eps, *, block_t=None, num_warps=None,
                         streaming=False, mode: str = "gate_then_norm"):
    """Same arguments and results as ``gated_rmsnorm_ref``. block_t (tokens per program) and
    num_warps: launch options, None for the defaults below; streaming: y and z loads marked
    evict_first and the output stored with .cs (read once / written once)."""
    T, I = y.shape
    assert I % group_size == 0
    # torch's weight * g.to(y.dtype) rounds to the promoted dtype first; we round to y.dtype only,
    # which is the same number whenever weight.dtype == y.dtype (the model's case)
    out = torch.empty((T, I), dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    BLOCK_G = next_pow2(group_size)
    BLOCK_T, nw = _launch_shape(T, group_size)
    BLOCK_T, nw = block_t or BLOCK_T, num_warps or nw
    with device_ctx(y):
        _gated_rmsnorm_kernel[(cdiv(T, BLOCK_T), I // group_size)](
            y, z, weight if weight is not None else y, out, out, T, group_size, I // group_size, float(eps),
            *y.stride(), *z.stride(), *out.stride(),
            BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, LD_EV="evict_first" if streaming else "",
            ST_CM=".cs" if streaming else "", MODE=_MODES[mode], num_warps=nw,
        )
    return out


def triton_gated_rmsnorm_fp8(y, z, weight, group_size, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """The "gate_then_norm" gated norm quantized for the W8A8 prefill path in the same kernel:
    y, z [T, I] (16-bit) -> (codes [T, I] float8_e4m3fn, per-token scales [T, 1] float32), equal to
    ``quantize_rows_fp8(triton_gated_rmsnorm(y, z, weight, group_size, eps))`` code for code."""
    T, I = y.shape
    assert I % group_size == 0 and group_size >= 2 and y.dtype in (torch.bfloat16, torch.float16, torch.float32)
    codes = torch.empty((T, I), dtype=torch.float8_e4m3fn, device=y.device)
    scale = torch.empty((T, 1), dtype=torch.float32, device=y.device)
    if T == 0:
        return codes, scale
    BLOCK_T, nw = _launch_shape(T, group_size)
    with device_ctx(y):
        _gated_rmsnorm_kernel[(cdiv(T, BLOCK_T),)](
            y, z, weight, codes.view(torch.uint8), scale, T, group_size, I // group_size, float(eps),
            *y.stride(), *z.stride(), *codes.stride(),
            BLOCK_T=BLOCK_T, BLOCK_G=next_pow2(group_size), LD_EV="", ST_CM="", MODE=0, FP8_OUT=True,
            HW_ROUND=not triton_interpreting(), G_PAD=next_pow2(I // group_size), num_warps=nw,
        )
    return codes, scale
