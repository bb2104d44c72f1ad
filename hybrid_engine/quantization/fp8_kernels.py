"""Decode-sized FP8-weight projections: y = (x @ w_q^T) * weight_scale (+ bias), Triton.

The weights are float8_e4m3fn [N, K] (1 byte each, half the bytes of bf16, so a memory-bound
decode step reads half as much); x [M <= 8, K] is bf16/fp16/fp32 and stays so (weight-only). Every
e4m3 value is exact in bf16/fp32, so converting a weight tile is lossless; the scale (float32,
[] per tensor or [N] per channel) multiplies each output once, after the float32 accumulation.
- ``_fp8_fma_kernel`` (1 row): BLOCK_N outputs per program, each [BLOCK_N, BLOCK_K] product tile
  reduced into a float32 [BLOCK_N] accumulator as it is made (few registers, many programs per SM).
- ``_fp8_dot_kernel`` (2..8 rows, padded to 16): the weight tile converted to x's dtype and fed
  to ``tl.dot`` with float32 accumulation. ``fp8_skinny_linear`` sends float32 rows to the FMA
  kernel at every row count instead (a grid row each), so they keep one-token steps' bits.
``fp8_linear_ref`` (``quantization/fp8.py``) is the exact twin. The prefill side's activation
quantizer is ``fp8_quantizer.quantize_rows_fp8``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv
from hybrid_engine.mamba_cache.ops.triton_pdl import first_weight_tile, pdl_enter, pdl_kwargs
from hybrid_engine.models.activation import proj_input_f32, relu2 as relu2_act, relu2_flags

from .slice_sum import slice_tiles, sum_slices


@triton.jit
def _fp8_fma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, swn, sxm,
                    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                    RELU2: tl.constexpr = False, BF16_BITS: tl.constexpr = False, ROWS: tl.constexpr = False):
    if PREFETCH:                  # issued before the wait, used after it (triton_pdl)
        w_first = first_weight_tile(w_ptr, swn, N, K, BLOCK_N, BLOCK_K)
    z = pdl_enter(PDL)            # x is addressed from the wait's zero (triton_pdl); z * 16 keeps
    pid = tl.program_id(0) + z
    x_ptr += z * 16               # the 16-element alignment Triton vectorises x loads on
    if ROWS:                      # grid axis 1 walks the rows of x (stride sxm) and y (contiguous):
        r = (tl.program_id(1) + z).to(tl.int64)   # each runs the one-row code: a one-row launch's sums
        x_ptr += r * sxm
        y_ptr += r * N
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
    """x [M, K] -> [M, N] in x.dtype (``relu2``: of ``activation.relu2(x)``, applied as x is loaded).
    Each row is a grid row running the one-row code, so a row's result does not depend on M."""
    _check(x, w_q, weight_scale)
    M, K = x.shape
    N = w_q.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    _fp8_fma_kernel[(cdiv(N, block_n), M)](
        x, w_q, weight_scale, bias if bias is not None else weight_scale, y, N, K, w_q.stride(0), x.stride(0),
        PER_CHANNEL=_per_channel(weight_scale, N),
        # float32 takes the row-grid code at every M (one compiled kernel for a one-token step and a
        # verify step's rows, so their bits cannot part through different codegen)
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        ROWS=M > 1 or x.dtype == torch.float32,
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
    k_s, slices = slice_tiles(K, k_slices, block_k)                     # inputs a slice, whole tiles
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    # launched without programmatic dependent launch (its PDL flag stays False): with it, 8B FP8
    # decode at batch 8 ran at 1418 tok/s against 1554 without (H100,
    # benchmarks/results/2026-11-26-pdl-h100.md)
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
    K = 2688 takes two tiles, 4096 lanes, a third masked). Such rows take (4, 1024, 4 warps) unless
    the weight is small (``_fma_config``'s first rule, before this one): the
    best, or within 2% of it, of 15 one-row configs on the three K = 2688 projections of the
    Nano-30B-A3B shape (mamba in_proj 13.8 -> 12.0 us, attention q_proj 7.3 -> 6.0, shared-expert up
    7.2 -> 5.7; H100, ``benchmarks/results/2026-11-27-fp8-gemv-nano-h100.md``). K = 3712 and 4096
    keep the 2048 tiles, best there in the same sweep. Other widths it takes (K < 1639, 3072,
    4480, ...) were not measured; it comes before the long-row and wide-N rules."""
    return cdiv(K, 2048) * 2048 * 4 > 5 * K


def fp8_skinny_linear(x, w_q, weight_scale, bias=None, relu2: bool = False):
    """x [M <= 8, K]: the FMA kernel for one row (``relu2`` applied as x loads), the dot kernel for
    more (after the relu² kernel, for ``relu2``). One row: ``_fma_config``; more rows 32-wide tiles,
    K tiles of 512 (``benchmarks/results/2026-11-26-fp8-h100.md``, and the sweep below)."""
    M, K = x.shape
    N = w_q.shape[0]
    if M == 1 or x.dtype == torch.float32:
        # float32 rows (a float32 FP8 model, an FP8 drafter of a float32 engine) take the one-row
        # kernel at every row count, a grid row each: a verify step's rows then get a one-token
        # step's bits, as unquantized float32 projections do (docs/design.md invariant 2)
        return fp8_skinny_linear_fma(x, w_q, weight_scale, bias, **_fma_config(N, K), relu2=relu2)
    # 2..8 rows: (32, 512, 3 stages) on every shape; the long-row projections took (32, 256, 4) until
    # an H100 sweep of 8 configs at 2, 4 and 8 rows (2026-11-26, results/2026-11-26-nvfp4-pair-decode-h100.md):
    # one 8B step's projections 3.918 -> 3.837 ms at 8 rows (down_proj 52.6 -> 48.4 us). K in slices
    # for the narrow long rows (N <= 8192, K >= 4096: 32-256 programs otherwise; N 4096 and 1024
    # swept, 4096 < N <= 8192 not), H200 sweep at 8 rows (benchmarks/results/2026-11-28-fp8-dot-slices-h200.md): down_proj 52.8 -> 37.8 us in 3
    # slices, out_proj 22.7 -> 17.5, q/o_proj 13.2 -> 11.6, k/v_proj 11.6 -> 6.4 in 4; one step's
    # projections 4.00 -> ~3.45 ms (bf16 4.27). The wide ones gain nothing (in_proj 34.5 -> 35.1 in 2)
    return fp8_skinny_linear_dot(relu2_act(x) if relu2 else x, w_q, weight_scale, bias, block_n=32,
                                 block_k=512, num_stages=3, k_slices=_dot_slices(N, K))


def _fma_config(N: int, K: int) -> dict:
    """The one-row kernel's config (``fp8_skinny_linear``'s rule). H200 sweep of 8 configs on the 8B
    and Nano projections (2026-11-29, ``benchmarks/results/2026-11-29-fp8-gemv-h200.md``):
    - small weights (N * K <= 2^22, the k/v projections): one 4096-wide K tile a program, 8 warps
      (8B k/v 3.6 -> 2.7 us, Nano's 256 x 2688 2.4 -> 1.7; the H100 had 4.0 -> 3.2 for the 8B);
    - K tiles of 2048 that would leave over a fifth of their lanes masked: (4, 1024, 4)
      (``_wastes_wide_k_tiles``, the Nano widths);
    - N <= 4096: the long rows (N * K >= 2^24: the 8B down_proj, out_proj, q/o_proj) (8, 2048, 8),
      as on the H100 (down_proj 32.5 -> 31.8 us there,
      ``benchmarks/results/2026-11-26-fp8-gemv-reduce-h100.md``; on the H200 (4, 2048, 4) was 0.2-0.4
      us faster on out_proj and q/o_proj and 0.6 us slower on down_proj, one call, not adopted);
      shorter ones (the Nano out_proj,
      o_proj, shared-expert down) (2, 2048, 4), 5.0 us against 5.3 at (8, 2048, 8);
    - wider N (the 8B in_proj, up_proj): (4, 2048, 4), 22.3 -> 20.1 us and 25.9 -> 23.0 against
      the (2, 2048, 4) of the H100 sweep, which did not try (4, 2048, 4)."""
    if N * K <= (1 << 22):
        return dict(block_n=2, block_k=4096, num_warps=8)
    if _wastes_wide_k_tiles(K):
        return dict(block_n=4, block_k=1024, num_warps=4)
    if N <= 4096:
        return dict(block_n=8, block_k=2048, num_warps=8) if N * K >= (1 << 24) else dict(block_n=2, block_k=2048,
                                                                                           num_warps=4)
    return dict(block_n=4, block_k=2048, num_warps=4)


def _dot_slices(N: int, K: int) -> int:
    """K slices of the 2-8-row dot kernel (``fp8_skinny_linear``'s rule, above)."""
    return (4 if N <= 2048 else 3) if N <= 8192 and K >= 4096 else 1
