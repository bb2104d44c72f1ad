"""y = x W^T (+ b) for decode-sized inputs (a few token rows): Triton kernels that stream the weight.

At batch 1 a decode step is a sequence of matrix-vector products that must each read their weight
at the copy bandwidth. cuBLAS picks split-K kernels for the tall-K shapes (out_proj, down_proj)
whose partial sums need an extra reduction kernel each, and every extra kernel in a CUDA graph
also costs a launch gap. These kernels give one launch per projection, float32 accumulation:
- ``_linear_dot_kernel``: one program per BLOCK_N output features; the rows of x (padded to 16)
  times the [BLOCK_K, BLOCK_N] weight tile with ``tl.dot``, so Triton's pipeliner prefetches the
  weight tiles ``num_stages`` deep.
- ``_linear_fma_kernel``: one program per BLOCK_N output features, products accumulated in a
  [BLOCK_N, BLOCK_K] register tile per x row (one walk over K for all rows) and reduced once at
  the end (no tensor cores; x rows <= 8).
  Each row runs the same code whatever the number of rows, so a row's result does not depend on
  the rows beside it: float32 models use it for 1-8 rows (``skinny_linear_f32``), and a verify step's
  rows then get the projections a one-token step computes, bit for bit.
``skinny_linear_ref`` (= ``F.linear``) is the reference twin. ``hybrid_engine.models.linear``
sends 1-8 rows here; ``skinny_linear`` then picks per shape (``_fma_config`` for one row,
``_multi_row_route`` for more, which sends the long-row projections back to cuBLAS: without
split-K these kernels have too few output tiles there), from H100 and H200 sweeps
(benchmarks/gemv.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs
from hybrid_engine.models.activation import proj_input_f32, relu2 as relu2_act, relu2_flags


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    return F.linear(x, weight, bias)


@triton.jit
def _linear_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    z = pdl_enter(PDL)            # x is addressed from the wait's zero (triton_pdl); z * 16 keeps
    pid = tl.program_id(0) + z
    x_ptr += z * 16               # the 16-element alignment Triton vectorises x loads on
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * swn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        xt = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :],
                     mask=mm[:, None] & mk[None, :], other=0.0)                  # [BM, BK]
        wt = tl.load(w_rows + offs_k[:, None], mask=mk[:, None] & mn[None, :],
                     other=0.0)                                                  # [BK, BN]
        if x_ptr.dtype.element_ty == tl.float32:
            acc = tl.dot(xt, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, wt, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@triton.jit
def _row_store(acc, b_ptr, y_ptr, m: tl.constexpr, M, sym, offs_n, mn, HAS_BIAS: tl.constexpr):
    if m < M:
        out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * sym + offs_n, out.to(y_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _linear_fma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym,
                       HAS_BIAS: tl.constexpr, M_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, RELU2: tl.constexpr = False,
                       BF16_BITS: tl.constexpr = False):
    # one walk over K for all M_ROWS (1, 2, 4 or 8) rows: each weight tile is loaded once and
    # multiplied into one [BLOCK_N, BLOCK_K] accumulator per row (named, not a [M_ROWS, ...] tile,
    # so each row's accumulator has the one-row kernel's layout). A row's sums are the same
    # whatever M_ROWS (tests/gpu/test_skinny_linear_cuda.py::test_skinny_linear_f32_rows_are_batch_invariant).
    # The rows used to walk K one after another, re-reading the tile from L1/L2: bench-large's
    # float32 projections at 4 rows 0.420 -> 0.352 ms (H100, 2026-11-26,
    # benchmarks/results/2026-11-26-f32-rows-h100.md; written inline: the same FMAs in a helper
    # function measured 0.434)
    z = pdl_enter(PDL)            # x is addressed from the wait's zero (triton_pdl); z * 16 keeps
    pid = tl.program_id(0) + z
    x_ptr += z * 16               # the 16-element alignment Triton vectorises x loads on
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * swn
    a0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a4 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a5 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a6 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a7 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        wt = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
        xp = x_ptr + offs_k
        # row m >= M reads zeros (its sums are computed, never stored): offs_k + m K < M K
        a0 += wt * proj_input_f32(tl.load(xp, mask=mk, other=0.0), RELU2, BF16_BITS)[None, :]
        if M_ROWS > 1:
            a1 += wt * proj_input_f32(tl.load(xp + sxm, mask=mk & (offs_k + K < M * K), other=0.0),
                                      RELU2, BF16_BITS)[None, :]
        if M_ROWS > 2:
            a2 += wt * proj_input_f32(tl.load(xp + 2 * sxm, mask=mk & (offs_k + 2 * K < M * K), other=0.0),
                                      RELU2, BF16_BITS)[None, :]
            a3 += wt * proj_input_f32(tl.load(xp + 3 * sxm, mask=mk & (offs_k + 3 * K < M * K), other=0.0),
                                      RELU2, BF16_BITS)[None, :]
        if M_ROWS > 4:
            a4 += wt * proj_input_f32(tl.load(xp + 4 * sxm, mask=mk & (offs_k + 4 * K < M * K), other=0.0),
                                      RELU2, BF16_BITS)[None, :]
            a5 += wt * proj_input_f32(tl.load(xp + 5 * sxm, mask=mk & (offs_k + 5 * K < M * K), other=0.0),
                                      RELU2, BF16_BITS)[None, :]
            a6 += wt * proj_input_f32(tl.load(xp + 6 * sxm, mask=mk & (offs_k + 6 * K < M * K), other=0.0),
                                      RELU2, BF16_BITS)[None, :]
            a7 += wt * proj_input_f32(tl.load(xp + 7 * sxm, mask=mk & (offs_k + 7 * K < M * K), other=0.0),
                                      RELU2, BF16_BITS)[None, :]
    _row_store(a0, b_ptr, y_ptr, 0, M, sym, offs_n, mn, HAS_BIAS)
    if M_ROWS > 1:
        _row_store(a1, b_ptr, y_ptr, 1, M, sym, offs_n, mn, HAS_BIAS)
    if M_ROWS > 2:
        _row_store(a2, b_ptr, y_ptr, 2, M, sym, offs_n, mn, HAS_BIAS)
        _row_store(a3, b_ptr, y_ptr, 3, M, sym, offs_n, mn, HAS_BIAS)
    if M_ROWS > 4:
        _row_store(a4, b_ptr, y_ptr, 4, M, sym, offs_n, mn, HAS_BIAS)
        _row_store(a5, b_ptr, y_ptr, 5, M, sym, offs_n, mn, HAS_BIAS)
        _row_store(a6, b_ptr, y_ptr, 6, M, sym, offs_n, mn, HAS_BIAS)
        _row_store(a7, b_ptr, y_ptr, 7, M, sym, offs_n, mn, HAS_BIAS)


def _check(x, weight):
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "must be [M, K] and [N, K]")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear: x and weight need a unit inner stride")


def _launch(kernel, x, weight, bias, max_rows, block_n, num_warps, num_stages, pdl=True, relu2=False,
            **consts):
    """Checks, allocates y [M, N] in x.dtype and launches ``kernel`` over N / block_n programs (with
    programmatic dependent launch where ``pdl`` and the device allow; ``relu2``: of relu2(x))."""
    _check(x, weight)
    M, K = x.shape
    N = weight.shape[0]
    assert M <= max_rows, f"{kernel.__name__} handles up to {max_rows} x rows"
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    kernel[(cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0),
        weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages, **consts, **relu2_flags(x, relu2),
        **(pdl_kwargs(x.device) if pdl else {}))
    return y


def skinny_linear_dot(x, weight, bias=None, *, block_n=64, block_k=128, num_warps=4,
                      num_stages=4):
    """x [M <= 16, K] @ weight[N, K]^T (+ bias) -> [M, N] in x.dtype (tl.dot kernel; x rows are
    padded to 16). No relu² on load here (``skinny_linear`` runs the relu² kernel first): in the FP8
    twin of this kernel, squaring each [16, BLOCK_K] x tile between its load and the dot made the 8B
    batch-8 step 27% longer (``fp8_kernels.fp8_skinny_linear_dot``)."""
    return _launch(_linear_dot_kernel, x, weight, bias, 16, block_n, num_warps, num_stages,
                   BLOCK_M=16, BLOCK_K=block_k)


def skinny_linear_fma(x, weight, bias=None, *, block_n=2, block_k=1024, num_warps=4,
                      num_stages=2, relu2=False, pdl: bool | None = None):
    """x [M <= 8, K] @ weight[N, K]^T (+ bias) -> [M, N] in x.dtype (register-FMA kernel).
    ``relu2``: the projection of ``activation.relu2(x)``, applied as x is loaded. ``pdl``:
    programmatic dependent launch (default: for one row only)."""
    M = x.shape[0]
    # PDL by default for one row only, as the FP8 dot kernel (PDL slowed its batch-8 steps); the
    # float32 rule passes it for every row count (below)
    return _launch(_linear_fma_kernel, x, weight, bias, 8, block_n, num_warps, num_stages,
                   pdl=M <= 1 if pdl is None else pdl,
                   relu2=relu2, M_ROWS=1 if M <= 1 else (2 if M <= 2 else (4 if M <= 4 else 8)),
                   BLOCK_K=block_k)


# configs from the H100 sweep (benchmarks/gemv.py, 2026-11-22; results/2026-11-22-gemv-h100.md);
# the one-row default moved from (8, 1024, 8 warps) to (2, 1024, 4 warps) after the H200 sweep of
# 2026-11-26 over the TP=1 and TP=2 shapes (results/2026-11-26-tensor-parallel-fused-h200x2.md):
# one 8B step's projections 3.899 -> ~3.79 ms at TP=1 and 2.137 -> ~2.06 ms per rank at TP=2
def _fma_config(N: int, K: int) -> dict:
    if N <= 4096 and N * K >= (1 << 24):        # out_proj, down_proj, q/o_proj: few, long rows
        return dict(block_n=4, block_k=1024, num_warps=4)
    return dict(block_n=2, block_k=1024, num_warps=4)


def _multi_row_route(M: int, N: int, K: int) -> tuple[str, dict]:
    """(kernel, config) for 2..16 rows: "dot", "fma" or "cublas" (F.linear). From the H100 and H200
    sweeps of 2026-11-26 (benchmarks/gemv.py --m 1 2 4 8; results/2026-11-26-gemv-rows-h100-h200.md):
    the long-row projections (out_proj, down_proj, q/o_proj) have too few output tiles for a
    kernel without split-K (down_proj at 4 rows: 71.7 us against cuBLAS's 64.4 on the H100, 71.8
    against 45.0 on the H200), and the small k/v projections are fastest on register FMAs up to 4
    rows. One 8B step's projections at 4 rows: 5.93 -> 5.68 ms (H100, two calls), 5.04 -> 4.17 ms
    (H200, summed from the sweep's per-shape rows)."""
    if N >= 16384:                               # in_proj, up_proj, lm_head: wide, short rows
        # (in_proj, N 18560, took the narrow config until the H200 sweep of 2026-11-26: 47.2 ->
        # 40.3 us at M = 4 there, 56.4 -> 57.2 us on the H100 of 2026-11-22)
        return "dot", dict(block_n=64, block_k=128, num_warps=4, num_stages=4)
    if N <= 4096 and N * K >= (1 << 24):         # few, long rows: cuBLAS splits K
        return "cublas", {}
    if N * K <= (1 << 22) and K >= 4096:         # k/v_proj: 8.8 -> 6.6 us at 4 rows (H100)
        if M > 4:
            return "cublas", {}
        return "fma", (dict(block_n=2, block_k=2048, num_warps=4) if M <= 2
                       else dict(block_n=4, block_k=1024, num_warps=4))
    return "dot", dict(block_n=16, block_k=512, num_warps=4, num_stages=3)


# float32 (the exact-comparison dtype): one config for every row count, so a row's sums are the same
# in a one-token step and in a verify step. From the H100 float32 sweep of 2026-11-26 over the
# bench-large projections (benchmarks/gemv.py --dtype float32 --model bench-large), kept when the rows
# came to share one walk over K (results/2026-11-26-f32-rows-h100.md): one step's projections
# 0.241 ms at 1 row (cuBLAS 0.297), 0.352 at 4 (cuBLAS 0.472), 0.675 at 8 (cuBLAS 0.578). 512-wide K
# tiles for the wide K = 1024 rows were 7% faster at 4 rows in the sweep of 2026-11-28 but made the
# one-token step 0.7-1.9% slower end to end, so they were not taken
# (results/2026-11-28-spec-step-glue-h100.md)
_F32_CONFIG = dict(block_n=2, block_k=1024, num_warps=4)
# Several output blocks per program with x loaded once (tried 2026-11-28, code in commit cbed4dd)
# made the n-gram K = 3 step 1.3-1.8% slower end to end (results/2026-11-28-fma-blocks-h100.md)


def skinny_linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      relu2: bool = False):
    """float32 x [M <= 8, K] @ weight[N, K]^T (+ bias): the FMA kernel with one config for all M.
    ``relu2``: the projection of ``activation.relu2(x)``."""
    # programmatic dependent launch for every row count (a verify step's rows too): the n-gram / MTP
    # K = 3 steps of the bench-large target 3-4% shorter (results/2026-11-28-spec-step-glue-h100.md)
    return skinny_linear_fma(x, weight, bias, relu2=relu2, pdl=True, **_F32_CONFIG)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  relu2: bool = False):
    """x [M <= 16, K] @ weight[N, K]^T (+ bias): the FMA kernel for one row; for 2..16 rows the dot
    kernel, the FMA kernel or cuBLAS by ``_multi_row_route``. ``relu2``: the projection of
    ``activation.relu2(x)`` (the relu² MLP's down_proj): the FMA kernel applies it as it loads x;
    the dot and cuBLAS routes run the relu² kernel first."""
    M, K = x.shape
    N = weight.shape[0]
    if M == 1:
        return skinny_linear_fma(x, weight, bias, relu2=relu2, **_fma_config(N, K))
    kernel, cfg = _multi_row_route(M, N, K)
    if kernel == "fma":
        return skinny_linear_fma(x, weight, bias, relu2=relu2, **cfg)
    x = relu2_act(x) if relu2 else x
    return F.linear(x, weight, bias) if kernel == "cublas" else skinny_linear_dot(x, weight, bias, **cfg)
