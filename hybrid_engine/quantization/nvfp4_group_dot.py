"""The per-group arithmetic the NVFP4 FMA kernels share (``nvfp4_fma_kernels``: looped one-row and
2-8-row kernels; ``nvfp4_persistent``: the persistent one-row kernel). x is prepared as float16
pairs, each 16-input group times a power of two that puts its largest value in [2^13, 2^14)
(``_x_scaled``, ``_x_pairs``). A group's 16 nibble products then run in packed float16
(``ASM_GROUP`` / ``_pairs_dot``, or decode once and ``ASM_PAIRS_DOT`` per row), with the nibble decode
of ``nvfp4_decode``. ``_group_dot`` is the float32 twin the interpreter runs. Plus the row-tile
addressing (``_row_tile``, ``_words``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .nvfp4_decode import _nibble_f32, _pairs_ptx

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
