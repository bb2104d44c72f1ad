"""The W8A8 prefill's activation quantizer, Triton: ``quantize_rows_fp8`` (twin
``fp8.quantize_activations``) quantizes each row to float8_e4m3fn codes with a per-token scale
(or the checkpoint's static ``input_scale``) in one pass per row, instead of ~6 float32 torch
passes, which made the W8A8 prefill slower than bf16. Its row scale and code store
(``_row_scale``, ``_store_codes``) are shared with the RMSNorm kernel's FP8 output
(``models/rmsnorm.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import next_pow2, triton_interpreting
from hybrid_engine.models.activation import proj_input_f32, relu2_rounded


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
                          HW_ROUND: tl.constexpr, RELU2: tl.constexpr = False, BF16_BITS: tl.constexpr = False,
                          rows_ptr=None, BOUNDED: tl.constexpr = False):
    """One program per row. Dynamic: s = amax(|x|) / 448 (1 for an all-zero row or one holding a
    NaN), stored to s_ptr[row]; static: s = in_scale_ptr[0]. Then q = clamp(x / s) in
    float8_e4m3fn, x / s rounded to nearest (``_divide_fast`` on CUDA where the scale allows,
    ``div_rn`` elsewhere) so every code equals
    ``quantize_activations``' torch arithmetic, NaN and inf included (a NaN stays a NaN code, so
    the engine's non-finite check still sees it after the projection). RELU2: x is replaced by
    relu(x)² (in x's dtype) as it is read: the MLP's activation and down_proj's quantizer in one
    pass over the up projection's output, instead of a relu² kernel writing it and this one
    reading it back. BOUNDED: rows from ``rows_ptr[0]`` on are not in use (the fused MoE's padding
    rows past its last expert tile) and their programs exit without reading or writing."""
    row = tl.program_id(0).to(tl.int64)
    if BOUNDED:
        if row >= tl.load(rows_ptr):
            return
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
                      block_k: int = 8192, two_pass_block_k: int = 4096,
                      rows_in_use: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    ``quantize_activations(relu2_ref(x))``). ``rows_in_use`` [1] int32 on x's device: only the
    rows before it are quantized (no host sync); the codes and scales of later rows are left
    unwritten (dynamic scales only)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fp8: x must be [M, K] with a unit inner stride, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"quantize_rows_fp8: input_scale must have one element (a per-tensor scale), got "
                         f"shape {tuple(input_scale.shape)}")
    M, K = x.shape
    x_q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    static = input_scale is not None
    if rows_in_use is not None and (static or rows_in_use.numel() != 1 or rows_in_use.dtype != torch.int32):
        raise ValueError("quantize_rows_fp8: rows_in_use must be a one-element int32 tensor, with dynamic scales")
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
                                rows_ptr=rows_in_use, BOUNDED=rows_in_use is not None, num_warps=4)
    # 4 warps at every tile width: H100, 8192 rows (graph replays, 2026-11-27): 21504 wide with relu²
    # in 4096 tiles 273.0 us (8 warps 289.6, 16: 307.3); 8192 wide one pass 73.3 (75.8 / 85.4);
    # 4096 wide 40.0 (43.6 / 51.5)
    return x_q, scale
