"""Decode-sized FP8-weight projections: y = (x @ w_q^T) * weight_scale (+ bias), Triton.

The weights are float8_e4m3fn [N, K] (1 byte each, half the bytes of bf16, so a memory-bound
decode step reads half as much); x [M <= 8, K] is bf16/fp16 and stays so (weight-only). Every
e4m3 value is exact in bf16/fp32, so converting a weight tile is lossless; the scale (float32,
[] per tensor or [N] per channel) multiplies each output once, after the float32 accumulation.
- ``_fp8_fma_kernel`` (1 row): BLOCK_N outputs per program, each [BLOCK_N, BLOCK_K] product tile
  reduced into a float32 [BLOCK_N] accumulator as it is made (few registers, many programs per SM).
- ``_fp8_dot_kernel`` (2..8 rows, padded to 16): the weight tile converted to x's dtype and fed
  to ``tl.dot`` with float32 accumulation.
``fp8_linear_ref`` (``quantization/fp8.py``) is the exact twin.

Also the prefill side's activation quantizer (``quantize_rows_fp8``, twin
``fp8.quantize_activations``): one pass per row instead of ~6 float32 torch passes, which made the
W8A8 prefill slower than bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, next_pow2, triton_interpreting
from hybrid_engine.mamba_cache.ops.triton_pdl import first_weight_tile, pdl_enter, pdl_kwargs
from hybrid_engine.models.activation import proj_input_f32, relu2 as relu2_act, relu2_flags, relu2_rounded

from .slice_sum import sum_slices


@triton.jit
def _fp8_fma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, swn,
                    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                    RELU2: tl.constexpr = False, BF16_BITS: tl.constexpr = False):
    if PREFETCH:                  # issued before the wait, used after it (triton_pdl)
        w_first = first_weight_tile(w_ptr, swn, N, K, BLOCK_N, BLOCK_K)
    z = pdl_enter(PDL)            # x is addressed from the wait's zero (triton_pdl); z * 16 keeps
    pid = tl.program_id(0) + z
    x_ptr += z * 16               # the 16-element alignment Triton vectorises x loads on
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * swn
    # reduced every K tile into [BLOCK_N] (not a [BLOCK_N, BLOCK_K] float32 tile reduced once):
    # 32 fewer registers per thread at (2, 2048, 4 warps), more programs resident per SM, more
    # weight bytes in flight; 2.740 -> 2.588 ms for one 8B step's FP8 projections (H100,
    # benchmarks/results/2026-11-26-fp8-gemv-reduce-h100.md)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_start = 0
    if PREFETCH:                  # the loop's first iteration, on the tile loaded before the wait
        offs_k = tl.arange(0, BLOCK_K)
        xv = proj_input_f32(tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0), RELU2, BF16_BITS)
        acc += tl.sum(w_first.to(tl.float32) * xv[None, :], axis=1)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        wt = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        xv = proj_input_f32(tl.load(x_ptr + offs_k, mask=mk, other=0.0), RELU2, BF16_BITS)
        acc += tl.sum(wt.to(tl.float32) * xv[None, :], axis=1)
    out = acc
    if PER_CHANNEL:
        out *= tl.load(s_ptr + offs_n, mask=mn, other=0.0)
    else:
        out *= tl.load(s_ptr)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _fp8_dot_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, M, N, K, K_S, sxm, swn, sym,
                    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    # K in slices of K_S inputs (a multiple of BLOCK_K), one a program (grid axis 1). SPLIT: the
    # slice's float32 sum (weight scale applied, no bias) goes to part [slices, M, N] for
    # slice_sum.sum_slices
    z = pdl_enter(PDL)            # x is addressed from the wait's zero (triton_pdl); z * 16 keeps
    pid = tl.program_id(0) + z
    x_ptr += z * 16               # the 16-element alignment Triton vectorises x loads on
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * swn
    k_lo = (tl.program_id(1) + z) * K_S
    for k0 in range(k_lo, tl.minimum(k_lo + K_S, K), BLOCK_K):
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
    if SPLIT:
        part = part_ptr + (tl.program_id(1) + z).to(tl.int64) * M * N
        tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=mm[:, None] & mn[None, :])
    else:
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


def fp8_skinny_linear_fma(x, w_q, weight_scale, bias=None, *, block_n=2, block_k=2048, num_warps=4,
                          relu2=False):
    """x [1, K] -> [1, N] in x.dtype (``relu2``: of ``activation.relu2(x)``, applied as x is loaded)."""
    _check(x, w_q, weight_scale)
    M, K = x.shape
    N = w_q.shape[0]
    assert M == 1, "the FMA kernel takes one row"
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _fp8_fma_kernel[(cdiv(N, block_n),)](
        x, w_q, weight_scale, bias if bias is not None else weight_scale, y, N, K, w_q.stride(0),
        PER_CHANNEL=_per_channel(weight_scale, N),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        **relu2_flags(x, relu2), **pdl_kwargs(x.device, prefetch=True))
    return y


def fp8_skinny_linear_dot(x, w_q, weight_scale, bias=None, *, block_n=16, block_k=512, num_warps=4,
                          num_stages=3, k_slices=1):
    """x [M <= 16, K] -> [M, N] in x.dtype. No relu² on load here: squaring each [16, BLOCK_K] x
    tile between its load and the dot made the 8B FP8 decode step at batch 8 5.20 -> 6.61 ms (H100,
    ``benchmarks/results/2026-11-27-relu2-rows-h100.md``), so ``fp8_skinny_linear`` runs the relu²
    kernel first for 2+ rows. ``k_slices`` > 1 cuts K into up to that many slices of whole tiles, a
    program each, their float32 sums added in slice order by ``slice_sum.sum_slices`` (as the
    NVFP4 dot kernel's; ``fp8_skinny_linear`` takes it for the narrow long-row projections)."""
    _check(x, w_q, weight_scale)
    M, K = x.shape
    N = w_q.shape[0]
    assert M <= 16, "the dot kernel takes up to 16 rows"
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    # launched without programmatic dependent launch (its PDL flag stays False): with it, 8B FP8
    # decode at batch 8 ran at 1418 tok/s against 1554 without (H100,
    # benchmarks/results/2026-11-26-pdl-h100.md)
    if k_slices < 1:
        raise ValueError(f"fp8_skinny_linear_dot: k_slices must be >= 1, got {k_slices}")
    k_s = max(block_k, cdiv(cdiv(K, k_slices), block_k) * block_k)      # inputs a slice, whole tiles
    slices = max(1, cdiv(K, k_s))                                       # K = 0: one program, y = bias
    part = torch.empty((slices, M, N), dtype=torch.float32, device=x.device) if slices > 1 else y
    _fp8_dot_kernel[(cdiv(N, block_n), slices)](
        x, w_q, weight_scale, bias if bias is not None else weight_scale, y, part, M, N, K, k_s, x.stride(0),
        w_q.stride(0), y.stride(0), PER_CHANNEL=_per_channel(weight_scale, N),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=slices > 1,
        num_warps=num_warps, num_stages=num_stages)
    if slices > 1:
        sum_slices(part, bias, y)
    return y


def _wastes_wide_k_tiles(K: int) -> bool:
    """True when 2048-wide K tiles would leave over a fifth of their lanes masked (the Nano widths:
    K = 2688 takes two tiles, 4096 lanes, a third masked). Such rows take (4, 1024, 4 warps): the
    best, or within 2% of it, of 15 one-row configs on the three K = 2688 projections of the
    Nano-30B-A3B shape (mamba in_proj 13.8 -> 12.0 us, attention q_proj 7.3 -> 6.0, shared-expert up
    7.2 -> 5.7; H100, ``benchmarks/results/2026-11-27-fp8-gemv-nano-h100.md``). K = 3712 and 4096
    keep the 2048 tiles, best there in the same sweep. Other widths it takes (K < 1639, 3072,
    4480, ...) were not measured; it comes before the long-row rule."""
    return cdiv(K, 2048) * 2048 * 4 > 5 * K


def fp8_skinny_linear(x, w_q, weight_scale, bias=None, relu2: bool = False):
    """x [M <= 8, K]: the FMA kernel for one row (``relu2`` applied as x loads), the dot kernel for
    more (after the relu² kernel, for ``relu2``). Block sizes from H100
    sweeps of ``benchmarks/fp8_gemv.py`` on the 8B shapes: one row (2, 2048, 4 warps), and (8, 2048,
    8 warps) for the few long rows (N <= 4096, N * K >= 2^24: down_proj and q/o_proj 32.5 -> 31.8 us,
    8.2 -> 7.7 us; out_proj too, 13.4 -> 13.6 us; k/v_proj keeps (2, 2048, 4), 4.0 us against 3.2 at
    (2, 4096, 8);
    ``benchmarks/results/2026-11-26-fp8-gemv-reduce-h100.md``), and (4, 1024, 4) where wide K tiles
    would leave over a fifth of their lanes masked (``_wastes_wide_k_tiles``); more rows 32-wide tiles, K tiles of
    512 (``benchmarks/results/2026-11-26-fp8-h100.md``, and the sweep below)."""
    M, K = x.shape
    N = w_q.shape[0]
    if M == 1:
        if _wastes_wide_k_tiles(K):
            block_n, block_k, warps = 4, 1024, 4
        elif N <= 4096 and N * K >= (1 << 24):
            block_n, block_k, warps = 8, 2048, 8
        else:
            block_n, block_k, warps = 2, 2048, 4
        return fp8_skinny_linear_fma(x, w_q, weight_scale, bias, block_n=block_n, block_k=block_k,
                                     num_warps=warps, relu2=relu2)
    # 2..8 rows: (32, 512, 3 stages) on every shape; the long-row projections took (32, 256, 4) until
    # an H100 sweep of 8 configs at 2, 4 and 8 rows (2026-11-26, results/2026-11-26-nvfp4-pair-decode-h100.md):
    # one 8B step's projections 3.918 -> 3.837 ms at 8 rows (down_proj 52.6 -> 48.4 us). K in slices
    # for the narrow long rows (N <= 8192, K >= 4096: 32-256 programs otherwise; N 4096 and 1024
    # swept, 4096 < N <= 8192 not), H200 sweep at 8 rows (benchmarks/results/2026-11-28-fp8-dot-slices-h200.md): down_proj 52.8 -> 37.8 us in 3
    # slices, out_proj 22.7 -> 17.5, q/o_proj 13.2 -> 11.6, k/v_proj 11.6 -> 6.4 in 4; one step's
    # projections 4.00 -> ~3.45 ms (bf16 4.27). The wide ones gain nothing (in_proj 34.5 -> 35.1 in 2)
    return fp8_skinny_linear_dot(relu2_act(x) if relu2 else x, w_q, weight_scale, bias, block_n=32,
                                 block_k=512, num_stages=3, k_slices=_dot_slices(N, K))


def _dot_slices(N: int, K: int) -> int:
    """K slices of the 2-8-row dot kernel (``fp8_skinny_linear``'s rule, above)."""
    return (4 if N <= 2048 else 3) if N <= 8192 and K >= 4096 else 1


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448 or NaN) rounded to the nearest float8_e4m3fn value, ties to even, still
    in float32: the grid step is 2^(e - 3) for the binade [2^e, 2^(e+1)), 2^-9 below 2^-6
    (subnormals). Rounding here, not in the cast, makes the cast of an exact value exact on every
    backend (Triton's interpreter drops the carry when a cast rounds up into the next binade, e.g.
    124.3 -> 64). v times 1 / step (both powers of two built from bits: exact) is below 16 in
    magnitude, so adding and removing 1.5 * 2^23 rounds it to an integer, ties to even, in float32
    arithmetic; v's sign bit is put back so a negative value that rounds to zero gives -0, as the
    cast does. NaN stays NaN."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3          # log2 of the grid step
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)
    r = ((v * inv_step + 12582912.0) - 12582912.0) * step
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _row_scale(m, nan_seen):
    """The dynamic scale of a row from its amax ``m`` (NaN-free max) and whether it held a NaN:
    torch's amax is NaN then, and ``where(amax > 0, amax / 448, 1)`` gives 1; an inf amax gives an
    inf scale (its codes: 0 for finite values, NaN for the infs), as in ``quantize_activations``."""
    return tl.where((m > 0) & (nan_seen == 0), tl.math.div_rn(m, 448.0), 1.0)


@triton.jit
def _fast_div_ok(s):
    """Whether the scale ``s`` lies in [2^-60, 2^60] (elementwise), where ``_divide_fast`` gives
    the correctly rounded quotient (0 / inf / NaN scales are outside)."""
    return (s >= 8.673617379884035e-19) & (s <= 1.152921504606847e18)      # 2^-60, 2^60


@triton.jit
def _divide_fast(xv, s, r, MAY_OVERFLOW: tl.constexpr):
    """x / s rounded to nearest (float32), as torch divides, without a division per value, for
    a scale s in [2^-60, 2^60] (``_fast_div_ok``) and r = 1 / s rounded to nearest. x * r is within
    two ulps of x / s; one correction q + (x - q * s) * r (two fmas) brings it within one ulp, where
    the remainder x - q * s is exact, and a second correction rounds to the correctly rounded
    quotient (Markstein's theorem: a correctly rounded reciprocal and a quotient within one ulp).
    The scale range keeps r normal and every remainder that matters out of the subnormals: a
    remainder can only underflow for |x / s| < 2^-42, whose code is 0 anyway. Kept as is: q where
    the remainder is 0 (q is exact; q + 0 would drop -0's sign), NaN (x infinite), and with
    MAY_OVERFLOW where q is infinite (x / s overflows: torch's inf, clamped to 448 like ours). A
    dynamic scale amax / 448 cannot overflow a quotient (an infinite x in a row holding a NaN,
    scale 1, gives a NaN remainder), so only static scales pay for that test: the quantizer is
    compute-bound, and the test with a branch yielding the quotients cost ~28% (H100, 8192 rows of
    21504 with relu²: ~385 against ~300 us a call in the engine; the branch alone 7%). A float32
    emulation with an exact fma (12 million quotients, x and s over the whole float32 range, half
    of them on e4m3 midpoints) gave torch's codes everywhere, with one correction as well; the
    theorem asks for the second. ``div_rn`` is ~15 operations a value and bound the quantizer
    (578-617 us a call on that shape)."""
    q = xv * r
    e = tl.fma(-q, s, xv)
    keep = (e == 0.0) | (e != e)
    if MAY_OVERFLOW:
        keep = keep | (tl.abs(q) == float("inf"))
    q = tl.where(keep, q, tl.fma(e, r, q))
    e = tl.fma(-q, s, xv)
    keep = (e == 0.0) | (e != e)
    if MAY_OVERFLOW:
        keep = keep | (tl.abs(q) == float("inf"))
    return tl.where(keep, q, tl.fma(e, r, q))


@triton.jit
def _quantize(xv, s, r, FAST_DIV: tl.constexpr, HW_ROUND: tl.constexpr, STATIC: tl.constexpr):
    """The e4m3 code bytes (uint8) of clamp(x / s, -448, 448), NaN kept as the NaN code 0x7F
    (torch.clamp keeps it; the interpreter's cast would not). FAST_DIV (CUDA, a scale in
    ``_fast_div_ok``'s range, r = 1 / s): divide with ``_divide_fast``; otherwise ``div_rn``.
    STATIC: s is a given per-tensor scale, not the row's amax / 448 (a quotient may overflow).
    HW_ROUND (CUDA): the cast rounds (the hardware conversion rounds to nearest even, as torch's
    does); otherwise the value is rounded in float32 first (``_round_to_e4m3``, for the
    interpreter), ~15 more operations per value: the quantizer was bound by them (H100, 8192 rows
    of 21504: 393 -> 271 us, codes equal)."""
    if FAST_DIV:
        q = _divide_fast(xv, s, r, STATIC)
    else:
        q = tl.math.div_rn(xv, s)
    q = tl.minimum(tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                   propagate_nan=tl.PropagateNan.ALL)
    if HW_ROUND:
        code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        code = _round_to_e4m3(q).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(q != q, 0x7F, code).to(tl.uint8)


@triton.jit
def _store_codes(ptrs, xv, s, mask, HW_ROUND: tl.constexpr, STATIC: tl.constexpr):
    """Stores the codes of the tile xv (float32) under the scale s (a scalar): divided fast on CUDA
    where s allows it (``_fast_div_ok``), by ``div_rn`` otherwise. The branch holds the store, so
    no tile of quotients flows out of it: a branch yielding the quotients made the quantizer 5-7%
    slower (H100, 8192 rows of 21504 with relu²: 292 against 272 us)."""
    if HW_ROUND:
        if _fast_div_ok(s):
            tl.store(ptrs, _quantize(xv, s, tl.math.div_rn(1.0, s), True, True, STATIC), mask=mask)
        else:
            tl.store(ptrs, _quantize(xv, s, s, False, True, STATIC), mask=mask)
    else:
        tl.store(ptrs, _quantize(xv, s, s, False, False, STATIC), mask=mask)


@triton.jit
def _quantize_tiles(x_row, q_row, K, s, FAST_DIV: tl.constexpr, HW_ROUND: tl.constexpr, STATIC: tl.constexpr,
                    RELU2: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The second pass of a wide row: its codes under the scale s, tile by tile."""
    r = tl.math.div_rn(1.0, s)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mk = offs < K
        xv = proj_input_f32(tl.load(x_row + offs, mask=mk, other=0.0), RELU2, BF16_BITS)
        tl.store(q_row + offs, _quantize(xv, s, r, FAST_DIV, HW_ROUND, STATIC), mask=mk)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, K, sxm, sqm,    # q_ptr: the codes as uint8
                          STATIC: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
                          HW_ROUND: tl.constexpr, RELU2: tl.constexpr = False, BF16_BITS: tl.constexpr = False):
    """One program per row. Dynamic: s = amax(|x|) / 448 (1 for an all-zero row or one holding a
    NaN), stored to s_ptr[row]; static: s = in_scale_ptr[0]. Then q = clamp(x / s) in
    float8_e4m3fn, x / s rounded to nearest (``_divide_fast`` on CUDA where the scale allows,
    ``div_rn`` elsewhere) so every code equals
    ``quantize_activations``' torch arithmetic, NaN and inf included (a NaN stays a NaN code, so
    the engine's non-finite check still sees it after the projection). RELU2: x is replaced by
    relu(x)² (in x's dtype) as it is read: the MLP's activation and down_proj's quantizer in one
    pass over the up projection's output, instead of a relu² kernel writing it and this one
    reading it back."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * sxm
    if ONE_PASS:        # the row fits one tile (K <= BLOCK_K): read it once
        offs = tl.arange(0, BLOCK_K)
        mk = offs < K
        xv = proj_input_f32(tl.load(x_row + offs, mask=mk, other=0.0), RELU2, BF16_BITS)
        if STATIC:
            s = tl.load(in_scale_ptr).to(tl.float32)
        else:
            s = _row_scale(tl.max(tl.abs(xv), axis=0), tl.max((xv != xv).to(tl.int32), axis=0))
            tl.store(s_ptr + row, s)
        _store_codes(q_ptr + row * sqm + offs, xv, s, mk, HW_ROUND, STATIC)
        return
    if STATIC:
        s = tl.load(in_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        nan_seen = tl.zeros([BLOCK_K], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            if RELU2:       # the largest relu(x)² is that of the largest x: no square per value here
                amax = tl.maximum(amax, xv)
            else:
                amax = tl.maximum(amax, tl.abs(xv))
            nan_seen = tl.maximum(nan_seen, (xv != xv).to(tl.int32))
        m = tl.max(amax, axis=0)
        if RELU2:
            m = relu2_rounded(m, x_ptr.dtype.element_ty, BF16_BITS)
        s = _row_scale(m, tl.max(nan_seen, axis=0))
        tl.store(s_ptr + row, s)
    if HW_ROUND:        # the scale's test outside the loop: each loop's body has no branch
        if _fast_div_ok(s):
            _quantize_tiles(x_row, q_ptr + row * sqm, K, s, True, True, STATIC, RELU2, BF16_BITS, BLOCK_K)
        else:
            _quantize_tiles(x_row, q_ptr + row * sqm, K, s, False, True, STATIC, RELU2, BF16_BITS, BLOCK_K)
    else:
        _quantize_tiles(x_row, q_ptr + row * sqm, K, s, False, False, STATIC, RELU2, BF16_BITS, BLOCK_K)


def quantize_rows_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None, *, relu2: bool = False,
                      block_k: int = 8192, two_pass_block_k: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill activations of the W8A8 path in one pass: x [M, K] (16- or 32-bit, unit inner
    stride) -> (x_q [M, K] float8_e4m3fn, scale float32 [M, 1] per token, or the static
    ``input_scale`` []). Equal code for code to ``fp8.quantize_activations`` (its torch twin), which
    takes ~6 float32 passes over x where this reads x once: a row of at most ``block_k`` is one
    tile; wider rows are read twice (the second time from L2) in tiles of
    ``min(block_k, two_pass_block_k)``. H100, 8192 rows of 21504 with relu², the division by the
    reciprocal and the hardware rounding (2026-11-27,
    benchmarks/results/2026-11-27-fp8-quantizer-h100.md): 273 us in 4096-wide tiles, 304 us in
    8192-wide ones, 374 us as a single 32768-wide tile. ``relu2``:
    quantize relu(x)² (rounded to x's dtype) instead of x, without writing it (twin:
    ``quantize_activations(relu2_ref(x))``)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fp8: x must be [M, K] with a unit inner stride, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"quantize_rows_fp8: input_scale must have one element (a per-tensor scale), got "
                         f"shape {tuple(input_scale.shape)}")
    M, K = x.shape
    x_q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    static = input_scale is not None
    scale = input_scale.float().reshape(()) if static else torch.empty((M, 1), dtype=torch.float32,
                                                                          device=x.device)
    if M == 0:
        return x_q, scale
    bk = max(16, next_pow2(K))
    one_pass = bk <= block_k
    if not one_pass:
        bk = min(block_k, two_pass_block_k)
    hw_round = x.is_cuda and not triton_interpreting()
    _quantize_rows_kernel[(M,)](x, x_q.view(torch.uint8), scale, scale, K, x.stride(0), x_q.stride(0),
                                STATIC=static, BLOCK_K=bk, ONE_PASS=one_pass, HW_ROUND=hw_round,
                                RELU2=bool(relu2), BF16_BITS=bool(relu2) and x.dtype == torch.bfloat16 and not hw_round,
                                num_warps=4)
    # 4 warps at every tile width: H100, 8192 rows (graph replays, 2026-11-27): 21504 wide with relu²
    # in 4096 tiles 273.0 us (8 warps 289.6, 16: 307.3); 8192 wide one pass 73.3 (75.8 / 85.4);
    # 4096 wide 40.0 (43.6 / 51.5)
    return x_q, scale
