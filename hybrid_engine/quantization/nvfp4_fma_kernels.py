"""NVFP4 projections for 1-8 rows of x on register FMAs in packed float16 (weight-only, Hopper):
Triton. The nibble decode is ``nvfp4_decode``'s.

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

``_nvfp4_fma_persistent_kernel`` (one row, K <= 8192: the dispatch's choice there): the same
arithmetic, but each program prepares x once for the whole row and then walks many tiles of whole
weight rows (a persistent grid of a few programs an SM), optionally with the next tile's words in
flight. At 4 x 256 tiles the looped kernel spent ~6 SASS instructions a value, over half of them
preparing x for only 4 rows (a layout change through shared memory, barriers); the persistent loop
spends ~3.3-3.6, nearly all decode and packed FMAs. ``k_slices`` cuts longer rows into slices, a
program a slice, and ``_sum_slices_kernel`` adds the slices' float32 sums in slice order (for the
8B down_proj, K 21504; not yet measured, so not in the dispatch rule).

``_nvfp4_rows_kernel`` (2-8 rows; dispatched for 2 rows, and 3-4 on projections with N <= 8192):
the one-row kernel's arithmetic with the words decoded into float16 pairs once per tile
(``ASM_DECODE``) and each row's x pairs meeting them (``ASM_PAIRS_DOT``); the global scale on the
output, as in the dot kernel (outputs beyond ~3e38 times it overflow). Decode batches of a few
rows and speculative verification at batch 1 (K + 1 rows) take it; more rows amortise the
tensor cores better.

H100 (2026-11-27, ``benchmarks/results/2026-11-27-nvfp4-half2-h100.md``): one 8B step's projections
with lm_head, bf16 5.1 ms; NVFP4 at one row 3.93 ms with the float32 FMA kernel, 3.12 ms with the
packed float16 one, 2.66 ms with x in 16-byte loads and 4-row tiles (the L1 had been the limit:
2-byte x loads, four times the weight loads' wavefronts). H200 (2026-11-28,
``benchmarks/results/2026-11-28-nvfp4-persistent-h200.md``): the persistent kernel takes the step's
projections from ~2.55 to 2.11 ms (bf16 3.70 ms). Twin: ``nvfp4_linear_ref``;
``benchmarks/nvfp4_gemv.py`` times the kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, next_pow2, num_sms
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs

from .nvfp4_decode import _check_layout, _check_x_dtype, _nibble_f32, _pairs_ptx, _use_ptx

MAX_FMA_ROWS = 8        # the rows kernel's limit (one ROWS variant each for 2, 4 and 8)
# the persistent one-row kernel keeps a thread's x pairs for the whole row in registers:
# 512 groups (K 8192) at 4 warps is 32 pair registers a thread
MAX_PERSISTENT_GROUPS = 512

# a group's words ($1, $2) and x pairs ($3 .. $10) -> float32 $0: sum over the 16 nibbles of
# e2m1 * 2^-14 (float16 bits, subnormals included) times its x', in packed float16 FMAs
_ASM_GROUP = ("{ .reg .b32 t0, t1, p, a; .reg .b16 h0, h1; .reg .f32 f0, f1; mov.b32 a, 0; "
              + _pairs_ptx(9, 0x0E000E00, lambda j: f"fma.rn.f16x2 a, p, ${3 + j}, a;", "$1") + " "
              + _pairs_ptx(9, 0x0E000E00, lambda j: f"fma.rn.f16x2 a, p, ${7 + j}, a;", "$2")
              + " mov.b32 {h0, h1}, a; cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; add.f32 $0, f0, f1; }")
# a group's two words ($8, $9) -> its 8 nibble pairs as 2 x float16 registers ($0 .. $7: word 0's
# pairs j = 0..3, then word 1's), e2m1 * 2^-14 each (the rows kernel decodes once for all rows)
_ASM_DECODE = ("{ .reg .b32 t0, t1, p; "
               + _pairs_ptx(9, 0x0E000E00, lambda j: f"mov.b32 ${j}, p;", "$8") + " "
               + _pairs_ptx(9, 0x0E000E00, lambda j: f"mov.b32 ${4 + j}, p;", "$9") + " }")
# 8 decoded pairs ($1 .. $8) and 8 x pairs ($9 .. $16) -> float32 $0: the group's 16 products summed
_ASM_PAIRS_DOT = ("{ .reg .b32 a; .reg .b16 h0, h1; .reg .f32 f0, f1; mul.rn.f16x2 a, $1, $9; "
                  + " ".join(f"fma.rn.f16x2 a, ${1 + k}, ${9 + k}, a;" for k in range(1, 8))
                  + " mov.b32 {h0, h1}, a; cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; add.f32 $0, f0, f1; }")
ASM_GROUP = tl.constexpr(_ASM_GROUP)
ASM_DECODE = tl.constexpr(_ASM_DECODE)
ASM_PAIRS_DOT = tl.constexpr(_ASM_PAIRS_DOT)


@triton.jit
def _x_pair(lo, hi):
    """float32 tensors -> int32: float16 lo in the low half, float16 hi in the high half (one
    cvt.rn.f16x2.f32; exact for bf16 / fp16 x times a power of two, above float16's subnormals)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _wide(p, BLOCK_N: tl.constexpr):
    """[BG] -> [BLOCK_N, BG]: an x pair for every row of the tile."""
    return tl.broadcast_to(p[None, :], (BLOCK_N, p.shape[0]))


@triton.jit
def _split8(t):
    """[..., 8] -> its 8 columns, in order."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [4, 2]))           # columns 2q / 2q + 1
    a0, a1 = tl.split(tl.reshape(a, a.shape[:-1] + [2, 2]))
    b0, b1 = tl.split(tl.reshape(b, b.shape[:-1] + [2, 2]))
    c0, c4 = tl.split(a0)
    c2, c6 = tl.split(a1)
    c1, c5 = tl.split(b0)
    c3, c7 = tl.split(b1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _x_scaled(xt):
    """x [BG, 16] float32 -> (x', undo [BG]): each group times a power of two putting its largest
    value in [2^13, 2^14), and undo = 2^14 / that power (2^14: the decode's e2m1 * 2^-14). amax in
    [2^(e-127), 2^(e-126)) takes 2^(140-e), biased exponent 267 - e, kept in [14, 254] so that
    neither power is infinite or subnormal (x beyond 2^127 or below 2^-114 lands outside)."""
    amax = tl.max(tl.abs(xt), axis=1)
    sb = tl.minimum(tl.maximum(267 - (amax.to(tl.int32, bitcast=True) >> 23), 14), 254)
    scale = (sb << 23).to(tl.float32, bitcast=True)
    return xt * scale[:, None], ((268 - sb) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _x_lohi(xs):
    """x' [BG, 16] -> lo, hi [BG, 2, 4]: lo[g, i, j] = input 8i + j, hi = input 8i + j + 4 (the
    inputs of word i's nibbles j and j + 4), within each thread."""
    BG: tl.constexpr = xs.shape[0]
    return tl.split(tl.permute(tl.reshape(xs, [BG, 2, 2, 4]), [0, 1, 3, 2]))  # [g, i, j, h]: 8i + 4h + j


@triton.jit
def _x_pairs(lo, hi):
    """lo, hi [BG, 2, 4] -> 8 int32 [BG]: float16 pairs (lo, hi) of word 0's j = 0..3, then word 1's."""
    return _split8(tl.reshape(_x_pair(lo, hi), [lo.shape[0], 8]))        # pair (i, j) at column 4i + j


@triton.jit
def _pairs_dot(wd, p0, p1, p2, p3, p4, p5, p6, p7, BLOCK_N: tl.constexpr):
    """Words [BN, BG, 2] and a tile's 8 x pairs [BG] (``_x_pairs``) -> [BN, BG] float32 group sums
    (ASM_GROUP: the CUDA path of ``_group_dot`` with x prepared by the caller)."""
    w0, w1 = tl.split(wd)
    return tl.inline_asm_elementwise(
        ASM_GROUP, "=r,r,r,r,r,r,r,r,r,r,r",
        [w0, w1, _wide(p0, BLOCK_N), _wide(p1, BLOCK_N), _wide(p2, BLOCK_N), _wide(p3, BLOCK_N),
         _wide(p4, BLOCK_N), _wide(p5, BLOCK_N), _wide(p6, BLOCK_N), _wide(p7, BLOCK_N)],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _group_dot(wd, xs, BLOCK_N: tl.constexpr, PTX: tl.constexpr):
    """Words [BN, BG, 2] (a 16-input group's two words) and x' [BG, 16] (already times the group's
    power of two) -> [BN, BG] float32: the sum of each group's 16 products e2m1 * 2^-14 * x'.

    CUDA: x' becomes float16 pairs (x'[8i + j], x'[8i + j + 4]) matching the decoded nibble pairs
    of ASM_GROUP, which multiplies and adds them in packed float16 (8 FMAs a group, one conversion
    to float32): about half the instructions a value of a float32 decode and FMA. The twin
    (interpreter): the same sum in float32."""
    w0, w1 = tl.split(wd)                                                                   # [BN, BG]
    BG: tl.constexpr = xs.shape[0]
    lo, hi = _x_lohi(xs)                                                                    # [BG, 2, 4]
    if PTX:
        p0, p1, p2, p3, p4, p5, p6, p7 = _x_pairs(lo, hi)
        return tl.inline_asm_elementwise(
            ASM_GROUP, "=r,r,r,r,r,r,r,r,r,r,r",
            [w0, w1, _wide(p0, BLOCK_N), _wide(p1, BLOCK_N), _wide(p2, BLOCK_N), _wide(p3, BLOCK_N),
             _wide(p4, BLOCK_N), _wide(p5, BLOCK_N), _wide(p6, BLOCK_N), _wide(p7, BLOCK_N)],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        l0, l1, l2, l3, l4, l5, l6, l7 = _split8(tl.reshape(lo, [BG, 8]))     # x'[8i + j] at 4i + j
        h0, h1, h2, h3, h4, h5, h6, h7 = _split8(tl.reshape(hi, [BG, 8]))     # x'[8i + j + 4]
        part = _nibble_f32(w0, 0) * l0[None, :] + _nibble_f32(w0, 4) * h0[None, :]
        part += _nibble_f32(w0, 1) * l1[None, :] + _nibble_f32(w0, 5) * h1[None, :]
        part += _nibble_f32(w0, 2) * l2[None, :] + _nibble_f32(w0, 6) * h2[None, :]
        part += _nibble_f32(w0, 3) * l3[None, :] + _nibble_f32(w0, 7) * h3[None, :]
        part += _nibble_f32(w1, 0) * l4[None, :] + _nibble_f32(w1, 4) * h4[None, :]
        part += _nibble_f32(w1, 1) * l5[None, :] + _nibble_f32(w1, 5) * h5[None, :]
        part += _nibble_f32(w1, 2) * l6[None, :] + _nibble_f32(w1, 6) * h6[None, :]
        part += _nibble_f32(w1, 3) * l7[None, :] + _nibble_f32(w1, 7) * h7[None, :]
        return part


@triton.jit
def _row_tile(pid, N, w_ptr, bs_ptr, swn, sbn, BLOCK_N: tl.constexpr):
    """Program pid's BLOCK_N weight rows: offsets, mask, and row pointers into the int32 words
    [BN, 1, 1] and the block scales [BN, 1]."""
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    return (offs_n, offs_n < N, w_ptr + offs_n[:, None, None].to(tl.int64) * swn,
            bs_ptr + offs_n[:, None].to(tl.int64) * sbn)


@triton.jit
def _words(w_rows, offs_g, mn, mg):
    """The two int32 words of groups offs_g [BG] for each row -> [BN, BG, 2] (0 where masked)."""
    offs_i = tl.arange(0, 2)
    return tl.load(w_rows + (offs_g[:, None] * 2 + offs_i[None, :])[None, :, :],
                   mask=mn[:, None, None] & mg[None, :, None], other=0)


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


@triton.jit
def _nvfp4_fma_persistent_kernel(x_ptr, w_ptr, bs_ptr, gs_ptr, b_ptr, y_ptr, part_ptr, N, n_tiles, swn, sbn,
                                 NG: tl.constexpr, NG_S: tl.constexpr, NG_PAD: tl.constexpr,
                                 SLICES: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 BLOCK_N: tl.constexpr, PIPELINE: tl.constexpr = False,
                                 PTX: tl.constexpr = False, PDL: tl.constexpr = False):
    # one row of x, K = 16 NG inputs, in SLICES slices of NG_S groups: program p takes slice
    # p % SLICES whole per tile. Each program prepares its slice of x once (as the looped kernel
    # does per tile: group powers of two, float16 pairs; NG_PAD / (32 num_warps) groups a thread in
    # registers for all its tiles), then walks the row tiles p // SLICES, + programs / SLICES, ...
    # of BLOCK_N weight rows [BLOCK_N, NG_S, 2] words. One slice: the outputs are stored; more: each
    # slice's float32 sums go to part [SLICES, N] for _sum_slices_kernel. PIPELINE: the next
    # tile's words and block scales are loaded before this tile's products (two tiles in flight)
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
    xt = tl.load(x_ptr + offs_g[:, None] * 16 + offs_c[None, :], mask=mg[:, None], other=0.0).to(tl.float32)
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


@triton.jit
def _sum_slices_kernel(part_ptr, b_ptr, y_ptr, N, SLICES: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # y = the K slices' float32 sums part [SLICES, N], added in slice order (the same bits on every
    # run), plus the bias, in y's dtype
    pid = tl.program_id(0) + pdl_enter(PDL)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SLICES):
        acc += tl.load(part_ptr + s * N + offs, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=m)


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
                            num_warps=4, programs_per_sm=4, pipeline=False, programs=None, k_slices=1):
    """x [1, K] (bf16/fp16) @ dequant(packed)^T -> [1, N] in x.dtype: register FMAs, no tensor cores
    (one row: the dot kernel's 16-row MMA tiles and their operand shuffles are overhead).

    ``block_g`` groups of 16 inputs a K step (the looped kernel, x prepared per tile), or None:
    the persistent kernel, whole rows a tile, x prepared once per program (K / k_slices <= 16 *
    MAX_PERSISTENT_GROUPS); ``programs_per_sm`` (or ``programs``) sizes its grid, ``pipeline``
    keeps the next tile's loads in flight. ``k_slices`` > 1 cuts K into that many slices, each
    program taking one, and a second launch adds their float32 sums in slice order (for rows too
    long for one program's registers; not in the dispatch rule: not yet measured)."""
    M, K = x.shape
    N = packed.shape[0]
    _check_layout(x, packed, weight_scale, weight_scale_2)
    assert M == 1, "the FMA kernel takes one row"
    _check_x_dtype(x)
    words = packed.view(torch.int32)                        # [N, K / 8], row stride packed.stride(0) / 4
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else weight_scale_2
    if block_g is None:
        NG = K // 16
        NG_S = cdiv(NG, max(1, k_slices))
        if k_slices < 1 or NG_S > MAX_PERSISTENT_GROUPS:
            raise ValueError(f"nvfp4_skinny_linear_fma: the persistent kernel (block_g=None) takes K / k_slices <= "
                             f"{16 * MAX_PERSISTENT_GROUPS} (k_slices >= 1), got K {K}, k_slices {k_slices}")
        n_tiles = cdiv(N, block_n)
        per_slice = max(1, min(n_tiles, (programs or programs_per_sm * num_sms(x.device)) // k_slices))
        part = torch.empty((k_slices, N), dtype=torch.float32, device=x.device) if k_slices > 1 else y
        _nvfp4_fma_persistent_kernel[(per_slice * k_slices,)](
            x, words, weight_scale, weight_scale_2, bias_arg, y, part, N, n_tiles, words.stride(0),
            weight_scale.stride(0), NG=NG, NG_S=NG_S, NG_PAD=next_pow2(NG_S), SLICES=k_slices,
            HAS_BIAS=bias is not None, BLOCK_N=block_n, PIPELINE=pipeline, PTX=_use_ptx(x), num_warps=num_warps,
            **pdl_kwargs(x.device))
        if k_slices > 1:
            _sum_slices_kernel[(cdiv(N, 1024),)](part, bias_arg, y, N, SLICES=k_slices, HAS_BIAS=bias is not None,
                                                 BLOCK=1024, num_warps=4, **pdl_kwargs(x.device))
        return y
    _nvfp4_fma_kernel[(cdiv(N, block_n),)](
        x, words, weight_scale, weight_scale_2, bias_arg, y, N, K // 8,
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
    # persistent kernel up to K 8192, pipelined on the wide projections (in_proj 25.7 -> 18.4 us,
    # lm_head 170.1 -> 105.5 us), plain at N 4096; the looped kernel above (down_proj, K 21504: its
    # x would not fit the registers), at the H100's 8 x 128 tiles
    if K > 16 * MAX_PERSISTENT_GROUPS:
        return dict(block_n=8, block_g=128, num_warps=4)
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
    # down, q/o, k/v), and nowhere at 8 rows (11.75 ms against 8.24): None -> the dot kernel
    if M == 2:
        return dict(block_n=8, block_g=64) if K >= 8192 else dict(block_n=4, block_g=256)
    if 3 <= M <= 4 and N <= 8192:
        return dict(block_n=4, block_g=256) if N <= 2048 else dict(block_n=8, block_g=64)
    return None
