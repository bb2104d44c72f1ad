"""Decode-sized NVFP4-weight projections (weight-only, Hopper): the dispatch
``nvfp4_skinny_linear`` and the tensor-core dot kernel. One row, and 2-4 rows on the projections
where it wins, go to ``nvfp4_fma_kernels``; the nibble decode is ``nvfp4_decode``'s.

``_nvfp4_dot_kernel`` (2..128 rows): a pair is multiplied by its block scale in one packed 16-bit
FMA (bf16: bits e2m1 * 2^-126 times scale * 2^118; fp16: e2m1 * 2^-14 times scale * 2^7, both
exact), so the tile [BLOCK_N, 8 * BLOCK_W] holds e2m1 * scale * 2^-SHIFT in x's dtype and goes to
one ``tl.dot`` per tile with float32 accumulation; the global scale and 2^SHIFT multiply each output
once. K is permuted within each word, x alike: the decode's register pairs (nibbles j, j + 4) stay
packed. In input order the joins cost a byte permute a value, and the scales came a byte load per
word: 7.0 -> 4.3 SASS instructions a weight in the loop at 64 x 16-word tiles (sm_90 compile). H200
(2026-11-28, ``benchmarks/results/2026-11-28-nvfp4-dot-perm-h200.md``), 8 rows at the same tiles:
in_proj 58.1 -> 45.5 us, down_proj 141.6 -> 101.5; 8B decode at batch 8 876 -> 1201 tok/s.

``k_slices`` cuts K into slices, a program each (grid axis 2), their float32 sums added in slice
order by ``slice_sum.sum_slices``: the narrow long-row projections had too few programs (down_proj at
8 rows 93.2 -> 41.0 us in 6 slices; batch 8 1211 -> 1719 tok/s, bf16 1604). ``SWAP`` puts the
weight on the MMA's M side (acc [BLOCK_N, rows]; the rule's form everywhere), else x (acc [rows,
BLOCK_N]; above 32 rows it does not compile at 16-wide output tiles, and 2-word tiles miscompile).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv
from hybrid_engine.models.activation import relu2 as relu2_act

from .nvfp4_decode import _check_layout, _check_x_dtype, _nibble_f32, _pairs_ptx, _use_ptx
from .nvfp4_fma_kernels import _fma_config, _rows_config, nvfp4_skinny_linear_fma, nvfp4_skinny_linear_rows
from .slice_sum import slice_tiles, sum_slices

MAX_ROWS = 128

# word, 16-bit scale c ($9) -> 8 values (bits e2m1 * 2^-126 for bf16 / e2m1 * 2^-14 for fp16) * c
_ASM_BF16 = ("{ .reg .b32 t0, t1, p, sp, nz; mov.b32 sp, {$9, $9}; mov.b32 nz, 0x80008000; "
             + _pairs_ptx(6, 0x01C001C0, lambda j: f"fma.rn.bf16x2 p, p, sp, nz; mov.b32 {{${j}, ${j + 4}}}, p;")
             + " }")
_ASM_F16 = ("{ .reg .b32 t0, t1, p, sp, nz; mov.b32 sp, {$9, $9}; mov.b32 nz, 0x80008000; "
            + _pairs_ptx(9, 0x0E000E00, lambda j: f"fma.rn.f16x2 p, p, sp, nz; mov.b32 {{${j}, ${j + 4}}}, p;")
            + " }")
ASM_BF16 = tl.constexpr(_ASM_BF16)
ASM_F16 = tl.constexpr(_ASM_F16)
# the dot kernel's tile holds e2m1 * scale * 2^-SHIFT (exact in each dtype: module docstring)
_SHIFT = {torch.bfloat16: 8, torch.float16: 7, torch.float32: 0}


@triton.jit
def _scaled8(wd, s, DT: tl.constexpr, SHIFT: tl.constexpr, PTX: tl.constexpr):
    """int32 words, float32 block scales (same shape) -> 8 tensors in DT: nibble j = e2m1 * s *
    2^-SHIFT, exactly (PTX: one packed 16-bit FMA per pair; the twin: float32, then a cast)."""
    if PTX:
        if DT == tl.bfloat16:
            return tl.inline_asm_elementwise(ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
                                             [wd, (s * 3.3230699894622245e+35).to(tl.bfloat16)],    # s * 2^118
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
                                             [wd, (s * 128.0).to(tl.float16)],                       # s * 2^7
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        c = s * (16384.0 / (1 << SHIFT))
        return ((_nibble_f32(wd, 0) * c).to(DT), (_nibble_f32(wd, 1) * c).to(DT), (_nibble_f32(wd, 2) * c).to(DT),
                (_nibble_f32(wd, 3) * c).to(DT), (_nibble_f32(wd, 4) * c).to(DT), (_nibble_f32(wd, 5) * c).to(DT),
                (_nibble_f32(wd, 6) * c).to(DT), (_nibble_f32(wd, 7) * c).to(DT))


@triton.jit(do_not_specialize=["M"])   # the step's rows (2-128): a value must not compile a variant
def _nvfp4_dot_kernel(x_ptr, w_ptr, bs_ptr, gs_ptr, b_ptr, y_ptr, part_ptr, M, N, KW, KW_S, sxm, swn, sbn, sym,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_W: tl.constexpr, SWAP: tl.constexpr, SHIFT: tl.constexpr, PTX: tl.constexpr,
                      SPLIT: tl.constexpr = False):
    # words [N, KW] walked in [BLOCK_N, BLOCK_W] tiles = [BLOCK_N, 8 * BLOCK_W] inputs; rows of x in
    # tiles of BLOCK_M (grid axis 1); K in slices of KW_S words (a multiple of BLOCK_W), one a
    # program (grid axis 2). SPLIT: the slice's float32 sum (global scale applied, no bias) goes to
    # part [slices, M, N] for slice_sum.sum_slices
    DT: tl.constexpr = x_ptr.dtype.element_ty
    w_lo = tl.program_id(2) * KW_S
    w_hi = tl.minimum(w_lo + KW_S, KW)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * swn
    s_rows = bs_ptr + offs_n[:, None].to(tl.int64) * sbn
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w0 in range(w_lo, w_hi, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        mw = mn[:, None] & (offs_w < KW)[None, :]
        wd = tl.load(w_rows + offs_w[None, :], mask=mw, other=0)                                # [BN, BW]
        # a group's block scale once (two words a group), then beside each of its words
        offs_g = w0 // 2 + tl.arange(0, BLOCK_W // 2)
        sg = tl.load(s_rows + offs_g[None, :], mask=mn[:, None] & (offs_g < KW // 2)[None, :],
                     other=0.0).to(tl.float32)                                                    # [BN, BW / 2]
        s = tl.reshape(tl.join(sg, sg), [BLOCK_N, BLOCK_W])
        v0, v1, v2, v3, v4, v5, v6, v7 = _scaled8(wd, s, DT, SHIFT, PTX)
        # K permuted within each word: tile position q of word w holds input 8w + q // 2 + 4 (q % 2),
        # i.e. the pairs (j, j + 4) the decode packs into one register stay side by side (joined in
        # input order they cost a byte permute per value); x takes the same order below
        wt = tl.reshape(tl.join(tl.join(tl.join(v0, v2), tl.join(v1, v3)),
                                tl.join(tl.join(v4, v6), tl.join(v5, v7))), [BLOCK_N, BLOCK_W * 8])
        offs_k = w0 * 8 + tl.arange(0, BLOCK_W * 8)
        mk = offs_k < KW * 8
        if SWAP:
            xt = tl.load(x_ptr + offs_m[None, :] * sxm + offs_k[:, None], mask=mm[None, :] & mk[:, None],
                         other=0.0)                                                               # [BK, BM]
            xt = tl.reshape(tl.permute(tl.reshape(xt, [BLOCK_W, 2, 4, BLOCK_M]), (0, 2, 1, 3)), [BLOCK_W * 8, BLOCK_M])
            acc = tl.dot(wt, xt, acc)
        else:
            xt = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=mm[:, None] & mk[None, :],
                         other=0.0)                                                               # [BM, BK]
            xt = tl.reshape(tl.permute(tl.reshape(xt, [BLOCK_M, BLOCK_W, 2, 4]), (0, 1, 3, 2)), [BLOCK_M, BLOCK_W * 8])
            acc = tl.dot(xt, tl.trans(wt), acc)
    out = acc * (tl.load(gs_ptr) * (1 << SHIFT))
    if SPLIT:
        part = part_ptr + tl.program_id(2).to(tl.int64) * M * N
        if SWAP:
            tl.store(part + offs_m[None, :] * N + offs_n[:, None], out, mask=mm[None, :] & mn[:, None])
        else:
            tl.store(part + offs_m[:, None] * N + offs_n[None, :], out, mask=mm[:, None] & mn[None, :])
    elif SWAP:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m[None, :] * sym + offs_n[:, None], out.to(y_ptr.dtype.element_ty),
                 mask=mm[None, :] & mn[:, None])
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & mn[None, :])


def nvfp4_skinny_linear_dot(x, packed, weight_scale, weight_scale_2, bias=None, *, block_n=32, block_w=64,
                            swap=False, num_warps=4, num_stages=3, k_slices=1):
    """x [M <= 128, K] @ dequant(packed)^T -> [M, N] in x.dtype (float32 only under the interpreter):
    ``tl.dot`` on decoded tiles of [block_n, 8 * block_w]; rows in tiles of 16 / 32 / 64 (grid axis
    1, each row tile decodes the weight again, from L2). ``k_slices`` > 1 cuts K into up to that
    many slices of whole tiles, a program each, and ``slice_sum.sum_slices`` adds their float32 sums
    in slice order (the same bits every run): more programs for the narrow long-row projections."""
    M, K = x.shape
    N = packed.shape[0]
    _check_layout(x, packed, weight_scale, weight_scale_2)
    assert M <= MAX_ROWS, f"the NVFP4 kernel takes up to {MAX_ROWS} rows"
    ptx = _use_ptx(x)
    _check_x_dtype(x)
    if not ptx and x.dtype == torch.bfloat16:
        raise ValueError("nvfp4_skinny_linear: bfloat16 x needs CUDA (Triton's interpreter has no exact "
                         "bfloat16 tl.dot); use float16 / float32, or nvfp4_linear, which dequantizes on CPU")
    if block_w < 2 or block_w & (block_w - 1):
        raise ValueError(f"nvfp4_skinny_linear_dot: block_w must be a power of two >= 2 (whole groups), got {block_w}")
    if not swap and block_w < 4:
        # H200, Triton 3.6 (2026-11-28): with x on the MMA's M side, 2-word (16-input) tiles gave
        # wrong sums (relative error ~1) at every shape tried, 4-16 words and the swapped form exact
        raise ValueError(f"nvfp4_skinny_linear_dot: block_w must be >= 4 with swap=False, got {block_w}")
    KW = K // 8
    kw_s, slices = slice_tiles(KW, k_slices, block_w)               # words a slice, whole tiles
    words = packed.view(torch.int32)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    bias_arg = bias if bias is not None else weight_scale_2
    part = torch.empty((slices, M, N), dtype=torch.float32, device=x.device) if slices > 1 else y
    _nvfp4_dot_kernel[(cdiv(N, block_n), cdiv(M, block_m), slices)](
        x, words, weight_scale, weight_scale_2, bias_arg, y, part, M, N, KW, kw_s,
        x.stride(0), words.stride(0), weight_scale.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w, SWAP=swap, SHIFT=_SHIFT[x.dtype], PTX=ptx,
        SPLIT=slices > 1, num_warps=num_warps, num_stages=num_stages)
    if slices > 1:
        sum_slices(part, bias, y)
    return y


def _dot_config(M: int, N: int, K: int) -> dict:
    # H200 sweeps of the permuted-K kernel on the 8B shapes at 3-64 rows (results in
    # 2026-11-28-nvfp4-dot-perm-h200.md): the weight on the MMA's M side in 64 x 16-word tiles
    # everywhere, and K in slices wherever that gives the SMs a few waves of programs. The narrow
    # projections (N <= 8192: 64 tiles of 64 rows, each a long K loop) gain most: at 8 rows
    # down_proj 93.2 us (x on the M side, one slice) -> 41.0 in 6 slices, out_proj 37.4 -> 19.6,
    # q/o_proj 20.6 -> 12.6 in 4, k/v_proj 18.9 -> 7.1 in 8; at 64 rows 4 slices beat 6 (down_proj
    # 61.0 against 77.2). The wide ones a little, up to 32 rows (in_proj 45.0 -> 37.9 in 3 slices);
    # not lm_head (not swept in slices)
    if N >= 16384:
        slices = 3 if N < 65536 and M <= 32 else 1
        return dict(block_n=64, block_w=16, swap=True, num_stages=4 if M <= 16 else 3, k_slices=slices)
    if N <= 2048:
        slices = 8
    else:
        slices = 6 if K >= 8192 and M <= 32 else 4
    return dict(block_n=64, block_w=16, swap=True, num_stages=4, k_slices=slices)


def nvfp4_skinny_linear(x, packed, weight_scale, weight_scale_2, bias=None, relu2: bool = False):
    """x [M <= 128, K] (bf16/fp16) @ dequant(packed)^T -> [M, N] in x.dtype at the measured configs:
    the FMA kernel for one row, the rows kernel for 2 rows (3-4 on the narrowest projections,
    N <= 2048), else the dot kernel. ``relu2``: the projection of ``activation.relu2(x)``, applied
    as the one-row kernel loads x (no relu² launch), by the relu² kernel first for more rows."""
    M, K = x.shape
    N = packed.shape[0]
    if M == 1:
        return nvfp4_skinny_linear_fma(x, packed, weight_scale, weight_scale_2, bias, relu2=relu2,
                                       **_fma_config(N, K))
    if relu2:
        x = relu2_act(x)
    rows = _rows_config(M, N, K)
    if rows is not None:
        return nvfp4_skinny_linear_rows(x, packed, weight_scale, weight_scale_2, bias, **rows)
    return nvfp4_skinny_linear_dot(x, packed, weight_scale, weight_scale_2, bias, **_dot_config(M, N, K))
