"""NVFP4 projections for 1-8 rows of x on register FMAs in packed float16 (weight-only, Hopper):
Triton. The nibble decode is ``nvfp4_decode``'s, the per-group arithmetic ``nvfp4_group_dot``'s.

``_nvfp4_fma_kernel`` (one row, dispatched for M == 1): no tensor cores. Each tile's x is prepared
once for all its rows: a 16-input group's values times a power of two that puts the group's
largest in [2^13, 2^14) (clamped for |x| beyond 2^127 or below 2^-114), as float16 pairs
matching the decoded nibble pairs. A pair of nibbles
(float16 bits e2m1 * 2^-14) then takes one packed float16 FMA against its x pair, 8 a group; the
group's sum is converted to float32 once, times its block scale, the inverse power of two (2^14
included) and the global scale (so the float32 accumulator holds y itself: a finite y never
overflows it). The products are float16: a relative error of ~4e-4 against the float32 twin
(float16 rounding; bf16 output rounding adds more). The power of two keeps each group's float16
products finite and normal relative to its largest value, whatever the magnitude of x. About 4
SASS instructions a value at 8 x 256 tiles (7.6 with the float32 decode and FMA before). x comes
in 16-byte loads, a [groups, 16] tile, paired within each thread.

The dispatch takes the persistent one-row kernel instead (``nvfp4_persistent``; above K 8192 with K
in slices): this looped kernel is no longer dispatched. It stays as the baseline of
``benchmarks/nvfp4_gemv.py`` and as the one-row form of the rows kernel below, tested alike.

``_nvfp4_rows_kernel`` (2-8 rows; dispatched for 2 rows, and 3-4 on projections with N <= 8192):
the one-row kernel's arithmetic with the words decoded into float16 pairs once per tile
(``ASM_DECODE``) and each row's x pairs meeting them (``ASM_PAIRS_DOT``); the global scale on the
output, as in the dot kernel (outputs beyond ~3e38 times it overflow). Decode batches of a few
rows and speculative verification at batch 1 (K + 1 rows) take it; more rows amortise the
tensor cores better.

H100 (2026-11-27, ``benchmarks/results/2026-11-27-nvfp4-half2-h100.md``): one 8B step's projections
with lm_head, bf16 5.1 ms; NVFP4 at one row 3.93 ms with the float32 FMA kernel, 3.12 ms with the
packed float16 one, 2.66 ms with x in 16-byte loads and 4-row tiles (the L1 had been the limit:
2-byte x loads, four times the weight loads' wavefronts). Twin: ``nvfp4_linear_ref``;
``benchmarks/nvfp4_gemv.py`` times the kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs

from .nvfp4_decode import _check_layout, _check_x_dtype, _use_ptx
from .nvfp4_group_dot import (ASM_DECODE, ASM_PAIRS_DOT, _group_dot, _row_tile, _words, _wide, _x_lohi, _x_pairs,
                              _x_scaled)
from .nvfp4_persistent import MAX_PERSISTENT_GROUPS, nvfp4_persistent_fma

MAX_FMA_ROWS = 8        # the rows kernel's limit (one ROWS variant each for 2, 4 and 8)


@triton.jit
def _nvfp4_fma_kernel(x_ptr, w_ptr, bs_ptr, gs_ptr, b_ptr, y_ptr, N, KW, swn, sbn,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                      PTX: tl.constexpr = False, PDL: tl.constexpr = False):
    # one row of x; the packed weight as int32 words [N, KW = K / 8], walked as [BLOCK_N, BLOCK_G,
    # 2] words = BLOCK_G 16-input groups (one block scale each). x is prepared once per tile for
    # all BLOCK_N rows, loaded as [BLOCK_G, 16] (16-byte vectors: scattered 2-byte loads of x made
    # the L1 the bottleneck): each group's 16 values times a power of two that puts the group's largest
    # below 2^14, as float16 pairs matching the decoded nibble pairs; the products accumulate in
    # packed float16 (_group_dot), each group's sum then times its block scale, the inverse power
    # of two (2^14 of the decode included) and the global scale into a float32 [BLOCK_N] accumulator
    z = pdl_enter(PDL)            # x is addressed from the wait's zero (triton_pdl); z * 16 keeps
    pid = tl.program_id(0) + z
    x_ptr += z * 16               # the 16-element alignment Triton vectorises x loads on
    offs_n, mn, w_rows, s_rows = _row_tile(pid, N, w_ptr, bs_ptr, swn, sbn, BLOCK_N)
    gs = tl.load(gs_ptr)          # on each group's factor, not the output: acc holds y itself, so
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)                      # a finite y never overflows it
    for g0 in range(0, KW // 2, BLOCK_G):
        offs_g = g0 + tl.arange(0, BLOCK_G)
        mg = offs_g < KW // 2
        wd = _words(w_rows, offs_g, mn, mg)                                                  # [BN, BG, 2]
        offs_c = tl.arange(0, 16)
        xt = tl.load(x_ptr + offs_g[:, None] * 16 + offs_c[None, :], mask=mg[:, None],
                     other=0.0).to(tl.float32)                                               # [BG, 16]
        xs, undo = _x_scaled(xt)
        part = _group_dot(wd, xs, BLOCK_N, PTX)                                              # [BN, BG]
        bs = tl.load(s_rows + offs_g[None, :], mask=mn[:, None] & mg[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(part * (bs * (undo * gs)[None, :]), axis=1)
    out = acc
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mn)

@triton.jit(do_not_specialize=["M"])   # the step's rows: a value must not compile a variant
def _nvfp4_rows_kernel(x_ptr, w_ptr, bs_ptr, gs_ptr, b_ptr, y_ptr, M, N, KW, sxm, swn, sbn, sym,
                       HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                       PTX: tl.constexpr = False, PDL: tl.constexpr = False):
    # the one-row kernel for M <= ROWS rows (2-8): a tile's words are decoded into float16 pairs
    # once (ASM_DECODE), then each row of x is prepared as in the one-row kernel and meets them in
    # 8 packed FMAs a group (ASM_PAIRS_DOT); row m's sums go to row m of acc [ROWS, BLOCK_N]
    z = pdl_enter(PDL)            # x is addressed from the wait's zero (triton_pdl); z * 16 keeps
    pid = tl.program_id(0) + z
    x_ptr += z * 16               # the 16-element alignment Triton vectorises x loads on
    offs_n, mn, w_rows, s_rows = _row_tile(pid, N, w_ptr, bs_ptr, swn, sbn, BLOCK_N)
    offs_c = tl.arange(0, 16)
    offs_m = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, KW // 2, BLOCK_G):
        offs_g = g0 + tl.arange(0, BLOCK_G)
        mg = offs_g < KW // 2
        wd = _words(w_rows, offs_g, mn, mg)                                                  # [BN, BG, 2]
        if PTX:
            w0, w1 = tl.split(wd)
            d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
                ASM_DECODE, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w0, w1], dtype=(tl.int32,) * 8, is_pure=True,
                pack=1)                                                                     # [BN, BG] each
        bs = tl.load(s_rows + offs_g[None, :], mask=mn[:, None] & mg[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(ROWS):
            xt = tl.load(x_ptr + m * sxm + offs_g[:, None] * 16 + offs_c[None, :],
                         mask=mg[:, None] & (offs_c * 0 + m < M)[None, :], other=0.0).to(tl.float32)   # [BG, 16]
            xs, undo = _x_scaled(xt)
            if PTX:
                lo, hi = _x_lohi(xs)
                p0, p1, p2, p3, p4, p5, p6, p7 = _x_pairs(lo, hi)
                part = tl.inline_asm_elementwise(
                    ASM_PAIRS_DOT, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                    [d0, d1, d2, d3, d4, d5, d6, d7, _wide(p0, BLOCK_N), _wide(p1, BLOCK_N), _wide(p2, BLOCK_N),
                     _wide(p3, BLOCK_N), _wide(p4, BLOCK_N), _wide(p5, BLOCK_N), _wide(p6, BLOCK_N),
                     _wide(p7, BLOCK_N)], dtype=tl.float32, is_pure=True, pack=1)             # [BN, BG]
            else:
                part = _group_dot(wd, xs, BLOCK_N, False)
            row = tl.sum(part * (bs * undo[None, :]), axis=1)                                # [BN]
            acc = tl.where(offs_m[:, None] == m, acc + row[None, :], acc)
    # the global scale at the end, as in the dot kernel: acc holds y / gs, so outputs beyond ~3e38 gs
    # (activations beyond ~1e33) overflow. Folding gs into each group's factor as the one-row
    # kernel does cost 20% at 2 rows on the (4, 256) tiles (H100, 2026-11-27)
    out = acc * tl.load(gs_ptr)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :], out.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & mn[None, :])


def nvfp4_skinny_linear_fma(x, packed, weight_scale, weight_scale_2, bias=None, *, block_n=4, block_g=256,
                            num_warps=4, programs_per_sm=4, pipeline=False, programs=None, k_slices=1,
                            relu2=False):
    """x [1, K] (bf16/fp16) @ dequant(packed)^T -> [1, N] in x.dtype: register FMAs, no tensor cores
    (one row: the dot kernel's 16-row MMA tiles and their operand shuffles are overhead).

    ``block_g`` groups of 16 inputs a K step (the looped kernel, x prepared per tile), or None:
    the persistent kernel, whole rows a tile, x prepared once per program (K / k_slices <= 16 *
    MAX_PERSISTENT_GROUPS); ``programs_per_sm`` (or ``programs``) sizes its grid, ``pipeline``
    keeps the next tile's loads in flight. ``k_slices`` > 1 cuts K into that many slices, each
    program taking one, and a second launch adds their float32 sums in slice order (for rows too
    long for one program's registers: the dispatch rule's choice above K 8192). ``relu2``: the
    projection of ``activation.relu2(x)``, applied as the persistent kernel loads x (its only form)."""
    M, K = x.shape
    N = packed.shape[0]
    _check_layout(x, packed, weight_scale, weight_scale_2)
    assert M == 1, "the FMA kernel takes one row"
    _check_x_dtype(x)
    if relu2 and block_g is not None:
        raise ValueError("nvfp4_skinny_linear_fma: relu2 needs the persistent kernel (block_g=None)")
    words = packed.view(torch.int32)                        # [N, K / 8], row stride packed.stride(0) / 4
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if block_g is None:
        return nvfp4_persistent_fma(x, words, weight_scale, weight_scale_2, bias, y, block_n=block_n,
                                    num_warps=num_warps, programs_per_sm=programs_per_sm, pipeline=pipeline,
                                    programs=programs, k_slices=k_slices, relu2=relu2)
    _nvfp4_fma_kernel[(cdiv(N, block_n),)](
        x, words, weight_scale, weight_scale_2, bias if bias is not None else weight_scale_2, y, N, K // 8,
        words.stride(0), weight_scale.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_G=block_g, PTX=_use_ptx(x), num_warps=num_warps, **pdl_kwargs(x.device))
    return y


def nvfp4_skinny_linear_rows(x, packed, weight_scale, weight_scale_2, bias=None, *, block_n=4, block_g=256,
                             num_warps=4):
    """x [M <= 8, K] (bf16/fp16) @ dequant(packed)^T -> [M, N] in x.dtype: the one-row kernel's
    packed float16 products for a few rows (decode batches, speculative verification), the
    weight decoded once per tile for all of them."""
    M, K = x.shape
    N = packed.shape[0]
    _check_layout(x, packed, weight_scale, weight_scale_2)
    assert M <= MAX_FMA_ROWS, f"the rows kernel takes up to {MAX_FMA_ROWS} rows"
    _check_x_dtype(x)
    words = packed.view(torch.int32)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    rows = 2 if M <= 2 else (4 if M <= 4 else 8)
    _nvfp4_rows_kernel[(cdiv(N, block_n),)](
        x, words, weight_scale, weight_scale_2, bias if bias is not None else weight_scale_2, y, M, N, K // 8,
        x.stride(0), words.stride(0), weight_scale.stride(0), y.stride(0), HAS_BIAS=bias is not None, ROWS=rows,
        BLOCK_N=block_n, BLOCK_G=block_g, PTX=_use_ptx(x), num_warps=num_warps, **pdl_kwargs(x.device))
    return y


def _fma_config(N: int, K: int) -> dict:
    # H200 sweep of the 8B shapes (benchmarks/results/2026-11-28-nvfp4-persistent-h200.md): the
    # persistent kernel, pipelined on the wide projections (in_proj 25.7 -> 18.4 us, lm_head 170.1
    # -> 105.5 us), plain at N 4096. Above K 8192 its x would not fit the registers: K in the
    # fewest slices that do (8B down_proj, K 21504: 3 slices of 448 groups, 29.9 us on the looped
    # kernel -> 21.6 us, 2026-11-28-nvfp4-slices-h200.md; 6 slices at best 23.7, pipelined 24.8)
    if K > 16 * MAX_PERSISTENT_GROUPS:
        return dict(block_n=2, block_g=None, num_warps=4, programs_per_sm=4,
                    k_slices=cdiv(K // 16, MAX_PERSISTENT_GROUPS))
    if N >= 65536:
        return dict(block_n=4, block_g=None, num_warps=8, programs_per_sm=8, pipeline=True)
    if N >= 16384:
        return dict(block_n=2, block_g=None, num_warps=4, programs_per_sm=8, pipeline=True)
    if K >= 8192:
        return dict(block_n=2, block_g=None, num_warps=4, programs_per_sm=4)
    return dict(block_n=4, block_g=None, num_warps=4, programs_per_sm=4)


def _rows_config(M: int, N: int, K: int) -> dict | None:
    # H100 sweep of the 8B shapes at 2 / 4 / 8 rows (benchmarks/results/2026-11-27-nvfp4-half2-h100.md,
    # call 13): the rows kernel wins at 2 rows everywhere (one step's projections 3.90 ms against
    # the dot kernel's 8.27 and bf16's 5.66), at 3-4 rows on the projections with N <= 8192 (out,
    # down, q/o, k/v), and nowhere at 8 rows (11.75 ms against 8.24): None -> the dot kernel. Since
    # the dot kernel permutes K and cuts it in slices (H200, 2026-11-28-nvfp4-dot-perm-h200.md) it
    # wins at 3 rows on out, down and q/o_proj too (down_proj 70.9 us -> 41.6); the rows kernel
    # keeps k/v_proj there (4.9 us against 7.0)
    if M == 2:
        return dict(block_n=8, block_g=64) if K >= 8192 else dict(block_n=4, block_g=256)
    if 3 <= M <= 4 and N <= 2048:
        return dict(block_n=4, block_g=256)
    return None
