"""The persistent one-row NVFP4 projection (weight-only, Hopper; dispatched by
``nvfp4_fma_kernels._fma_config`` for K <= 8192): the looped one-row kernel's arithmetic
(``nvfp4_group_dot``), but each program prepares x once for the whole row and then walks many
tiles of whole weight rows. The grid is persistent, a few programs an SM. ``pipeline`` keeps the
next tile's words and block scales in flight.

At 4 x 256 tiles the looped kernel spent ~6 SASS instructions a value, over half of them preparing
x for only 4 rows (a layout change through shared memory, barriers). The persistent loop spends
~3.3-3.6, nearly all decode and packed FMAs. ``k_slices`` cuts longer rows into slices, a program a
slice, and ``slice_sum.sum_slices`` adds the slices' float32 sums in slice order (for the 8B
down_proj, K 21504: 29.9 us on the looped kernel -> 21.6 us in 3 slices, H200).

H200 (2026-11-28, ``benchmarks/results/2026-11-28-nvfp4-persistent-h200.md``): the 8B step's
projections go from ~2.55 to 2.11 ms (bf16 3.70 ms).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, next_pow2, num_sms
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs
from hybrid_engine.models.activation import proj_input_f32, relu2_flags

from .nvfp4_decode import _use_ptx
from .slice_sum import sum_slices
from .nvfp4_group_dot import _group_dot, _pairs_dot, _x_lohi, _x_pairs, _x_scaled

# the persistent one-row kernel keeps a thread's x pairs for its whole slice of the row in registers:
# 512 groups (K 8192) at 4 warps is 32 pair registers a thread
MAX_PERSISTENT_GROUPS = 512


@triton.jit
def _nvfp4_fma_persistent_kernel(x_ptr, w_ptr, bs_ptr, gs_ptr, b_ptr, y_ptr, part_ptr, N, n_tiles, swn, sbn,
                                 NG: tl.constexpr, NG_S: tl.constexpr, NG_PAD: tl.constexpr,
                                 SLICES: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 BLOCK_N: tl.constexpr, PIPELINE: tl.constexpr = False,
                                 PTX: tl.constexpr = False, RELU2: tl.constexpr = False,
                                 BF16_BITS: tl.constexpr = False, PDL: tl.constexpr = False):
    # one row of x, K = 16 NG inputs, in SLICES slices of NG_S groups: program p takes slice
    # p % SLICES whole per tile. Each program prepares its slice of x once (as the looped kernel
    # does per tile: group powers of two, float16 pairs; NG_PAD / (32 num_warps) groups a thread in
    # registers for all its tiles), then walks the row tiles p // SLICES, + programs / SLICES, ...
    # of BLOCK_N weight rows [BLOCK_N, NG_S, 2] words. One slice: the outputs are stored; more: each
    # slice's float32 sums go to part [SLICES, N] for slice_sum. PIPELINE: the next
    # tile's words and block scales are loaded before this tile's products (two tiles in flight).
    # RELU2: x is relu(x)² rounded to x's dtype as it loads (the relu² MLP's down_proj), so the
    # output is the projection of relu2(x) bit for bit without the relu² kernel's launch
    z = pdl_enter(PDL)            # x is addressed from the wait's zero (triton_pdl); z * 16 keeps
    pid = tl.program_id(0) + z
    x_ptr += z * 16               # the 16-element alignment Triton vectorises x loads on
    step = tl.num_programs(0) // SLICES
    sl = pid % SLICES
    first = pid // SLICES
    offs_s = tl.arange(0, NG_PAD)
    offs_g = sl * NG_S + offs_s
    mg = (offs_s < NG_S) & (offs_g < NG)
    offs_c = tl.arange(0, 16)
    xt = proj_input_f32(tl.load(x_ptr + offs_g[:, None] * 16 + offs_c[None, :], mask=mg[:, None], other=0.0),
                        RELU2, BF16_BITS)
    xs, undo = _x_scaled(xt)                                                             # [NGP, 16], [NGP]
    fac = undo * tl.load(gs_ptr)  # on each group's factor, as in the looped kernel: acc holds y itself
    if PTX:
        lo, hi = _x_lohi(xs)
        p0, p1, p2, p3, p4, p5, p6, p7 = _x_pairs(lo, hi)                                # [NGP] each
    offs_w = (offs_g[:, None] * 2 + tl.arange(0, 2)[None, :])[None, :, :]                # [1, NGP, 2]
    if PIPELINE:
        offs_n = first * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = offs_n < N
        wd_next = tl.load(w_ptr + offs_n[:, None, None].to(tl.int64) * swn + offs_w,
                          mask=mn[:, None, None] & mg[None, :, None], other=0)
        bs_next = tl.load(bs_ptr + offs_n[:, None].to(tl.int64) * sbn + offs_g[None, :],
                          mask=mn[:, None] & mg[None, :], other=0.0)
    for tile in range(first, n_tiles, step):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = offs_n < N
        if PIPELINE:
            wd = wd_next
            bs8 = bs_next
            offs_nn = offs_n + step * BLOCK_N                       # past N on the last tile: masked
            mnn = offs_nn < N
            wd_next = tl.load(w_ptr + offs_nn[:, None, None].to(tl.int64) * swn + offs_w,
                              mask=mnn[:, None, None] & mg[None, :, None], other=0)
            bs_next = tl.load(bs_ptr + offs_nn[:, None].to(tl.int64) * sbn + offs_g[None, :],
                              mask=mnn[:, None] & mg[None, :], other=0.0)
        else:
            wd = tl.load(w_ptr + offs_n[:, None, None].to(tl.int64) * swn + offs_w,
                         mask=mn[:, None, None] & mg[None, :, None], other=0)                # [BN, NGP, 2]
            bs8 = tl.load(bs_ptr + offs_n[:, None].to(tl.int64) * sbn + offs_g[None, :],
                          mask=mn[:, None] & mg[None, :], other=0.0)                         # [BN, NGP]
        if PTX:
            part = _pairs_dot(wd, p0, p1, p2, p3, p4, p5, p6, p7, BLOCK_N)                   # [BN, NGP]
        else:
            part = _group_dot(wd, xs, BLOCK_N, False)
        out = tl.sum(part * (bs8.to(tl.float32) * fac[None, :]), axis=1)
        if SLICES == 1:
            if HAS_BIAS:
                out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mn)
        else:
            tl.store(part_ptr + sl * N + offs_n, out, mask=mn)


def nvfp4_persistent_fma(x, words, weight_scale, weight_scale_2, bias, y, *, block_n, num_warps, programs_per_sm,
                         pipeline, programs, k_slices, relu2=False):
    """The persistent kernel's launch for ``nvfp4_fma_kernels.nvfp4_skinny_linear_fma(block_g=None)``
    (checked arguments, words = the packed weight as int32, y [1, N] to write)."""
    K, N = x.shape[1], words.shape[0]
    NG = K // 16
    NG_S = cdiv(NG, max(1, k_slices))
    if k_slices < 1 or NG_S > MAX_PERSISTENT_GROUPS:
        raise ValueError(f"nvfp4_skinny_linear_fma: the persistent kernel (block_g=None) takes K / k_slices <= "
                         f"{16 * MAX_PERSISTENT_GROUPS} (k_slices >= 1), got K {K}, k_slices {k_slices}")
    bias_arg = bias if bias is not None else weight_scale_2
    n_tiles = cdiv(N, block_n)
    per_slice = max(1, min(n_tiles, (programs or programs_per_sm * num_sms(x.device)) // k_slices))
    part = torch.empty((k_slices, N), dtype=torch.float32, device=x.device) if k_slices > 1 else y
    _nvfp4_fma_persistent_kernel[(per_slice * k_slices,)](
        x, words, weight_scale, weight_scale_2, bias_arg, y, part, N, n_tiles, words.stride(0),
        weight_scale.stride(0), NG=NG, NG_S=NG_S, NG_PAD=next_pow2(NG_S), SLICES=k_slices,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, PIPELINE=pipeline, PTX=_use_ptx(x), num_warps=num_warps,
        **relu2_flags(x, relu2), **pdl_kwargs(x.device))
    if k_slices > 1:
        sum_slices(part, bias, y, pdl=True)
    return y
