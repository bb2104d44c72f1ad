"""Block RMSNorm, plain and fused with the residual add: torch references and one Triton kernel
(CUDA) that serves both.

Semantics (transformers' NemotronHRMSNorm): out = (weight.float() * x.float() * rsqrt(mean(x^2) +
eps)).to(x.dtype). The torch form is ~8 small kernels per call; on the decode path of a 52-block
model that launch-bound tail is a visible share of the step, so CUDA takes one fused kernel.

Residual stream (vLLM style): a pre-norm block computes ``h + mixer(norm(h))``. Instead of a
separate add kernel per block, the next norm does the add: ``fused_add_rmsnorm(delta, residual)``
returns ``(norm(residual + delta), residual + delta)``. The sum is taken in float32 and rounded once
to the model dtype, which is exactly what torch's add does for bf16/fp16 (and is the fp32 add for
float32), so the residual stream is bit-identical to the unfused ``h + delta``; the normed output
then comes from the very same kernel code as the plain ``rmsnorm``.
The new residual is written to a fresh tensor (out of place): neither input is modified, so callers
may keep using them, and under CUDA graphs the buffer comes from the graph's pool like any other
intermediate (same bytes moved as an in-place update).
"""
from __future__ import annotations

import torch

from hybrid_engine.mamba_cache.ops.triton_common import (kernel_backend, next_pow2, triton_available,
                                                         triton_interpreting)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()                                                         # [T, D]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (the previous block's output), residual [T, D] -> (rmsnorm(r) [T, D], r [T, D]) with
    r = residual + x computed by torch in the model dtype (the unfused residual add)."""
    r = residual + x                                                      # [T, D]
    return rmsnorm_ref(r, weight, eps), r


if triton_available():
    import triton
    import triton.language as tl

    from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs
    from hybrid_engine.quantization.fp8_quantizer import _row_scale, _store_codes

    @triton.jit
    def _rmsnorm_kernel(x_ptr, r_ptr, r_out_ptr, w_ptr, out_ptr, s_ptr, D, eps, sx, sr, sro, so,
                        ADD_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
                        FP8_OUT: tl.constexpr = False, HW_ROUND: tl.constexpr = True):
        # One program per row. With ADD_RESIDUAL the row is first replaced by residual + x
        # (float32 add, one rounding to the residual dtype = torch's add), which is stored; the
        # norm below is then the same code for both variants, so their outputs agree bitwise.
        # FP8_OUT (W8A8 prefill, ``fp8.Fp8Rows``): the normed row, rounded to x's dtype as the
        # plain kernel stores it, is quantized per token as ``quantize_rows_fp8`` does it
        # (s_ptr[row] = amax / 448, out_ptr the e4m3 codes as uint8): the same codes, without
        # writing the 16-bit row and reading it back.
        row = (tl.program_id(0) + pdl_enter(PDL)).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
        if ADD_RESIDUAL:
            r = tl.load(r_ptr + row * sr + offs, mask=m, other=0.0)
            x = (r.to(tl.float32) + x.to(tl.float32)).to(r_out_ptr.dtype.element_ty)
            tl.store(r_out_ptr + row * sro + offs, x, mask=m)
        dtype = x.dtype
        x = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if FP8_OUT:
            y = (w * (x * inv)).to(dtype).to(tl.float32)
            s = _row_scale(tl.max(tl.abs(y), axis=0), tl.max((y != y).to(tl.int32), axis=0))
            tl.store(s_ptr + row, s)
            _store_codes(out_ptr + row * so + offs, y, s, m, HW_ROUND, False)
        else:
            tl.store(out_ptr + row * so + offs, (w * (x * inv)).to(out_ptr.dtype.element_ty), mask=m)


def _launch(x, residual, residual_out, weight, out, eps, scale=None) -> None:
    """x [T, D] (unit inner stride); residual/residual_out [T, D] or None (plain norm); scale
    [T, 1] float32 or None: out holds e4m3 codes (FP8_OUT) and scale their per-token scales
    (otherwise the unused s_ptr is out)."""
    t, d = x.shape
    if t == 0:
        return
    add = residual is not None
    r, ro = (residual, residual_out) if add else (x, out)    # unused pointers when not adding
    block = next_pow2(d)
    fp8 = scale is not None
    _rmsnorm_kernel[(t,)](x, r, ro, weight, out.view(torch.uint8) if fp8 else out, scale if fp8 else out,
                          d, float(eps), x.stride(0), r.stride(0), ro.stride(0), out.stride(0),
                          ADD_RESIDUAL=add, BLOCK_D=block, num_warps=min(16, max(1, block // 256)),
                          FP8_OUT=fp8, HW_ROUND=not triton_interpreting(), **pdl_kwargs(x.device))


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same arguments and result as ``rmsnorm_ref`` for x [T, D] with a unit inner stride."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)   # [T, D]
    _launch(x, None, None, weight, out, eps)
    return out


def fused_add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as ``fused_add_rmsnorm_ref`` for x, residual [T, D] of one
    dtype with unit inner strides. Both outputs are fresh contiguous tensors."""
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)      # [T, D]
    new_residual = torch.empty_like(residual, memory_format=torch.contiguous_format)
    _launch(x, residual, new_residual, weight, out, eps)
    return out, new_residual


# The widest row (next power of two) whose FP8_OUT kernel sums the row in the plain kernel's layout:
# beyond it the codes' uint8 store makes Triton vectorise the row 16 wide instead of 8, which sums in
# another order (tests/engine/test_norm_fp8_layouts.py compiles both for sm_90 and compares)
FP8_OUT_MAX_BLOCK = 4096


def fp8_out_supported(d: int) -> bool:
    """Whether ``add_rmsnorm_fp8`` gives the plain kernel's codes for rows of width d."""
    return next_pow2(d) <= FP8_OUT_MAX_BLOCK


def add_rmsnorm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-norm step of ``fused_add_rmsnorm`` (``rmsnorm`` when residual is None) with the
    normed rows quantized for the W8A8 prefill path in the same kernel (CUDA, bf16 x [T, D] of unit
    inner stride): -> (codes [T, D] float8_e4m3fn, per-token scales [T, 1] float32, the residual
    stream [T, D]). The codes and scales equal ``quantize_rows_fp8`` of the 16-bit normed rows
    (tests/gpu/test_quant_cuda.py::test_add_rmsnorm_fp8_equals_norm_then_quantizer)."""
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)      # [T, D]
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)    # [T, 1]
    if residual is None:
        _launch(x, None, None, weight, codes, eps, scale)
        return codes, scale, x
    new_residual = torch.empty_like(residual, memory_format=torch.contiguous_format)
    _launch(x, residual, new_residual, weight, codes, eps, scale)
    return codes, scale, new_residual


def _rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(-1) == 1


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _rows(x) and kernel_backend("rmsnorm", x.device) == "triton":
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def rmsnorm_into(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """``rmsnorm(x)`` written into ``out`` [T, D] (a view with unit inner stride, e.g. one half of a
    wider buffer that two norms fill side by side instead of a ``torch.cat``): the same values."""
    if _rows(x) and _rows(out) and out.dtype == x.dtype and kernel_backend("rmsnorm", x.device) == "triton":
        _launch(x, None, None, weight, out, eps)
    else:
        out.copy_(rmsnorm_ref(x, weight, eps))
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rmsnorm(residual + x), residual + x); inputs are left unchanged (module docstring)."""
    if (_rows(x) and _rows(residual) and x.shape == residual.shape and x.dtype == residual.dtype
            and kernel_backend("fused_add_rmsnorm", x.device) == "triton"):
        return fused_add_rmsnorm_triton(x, residual, weight, eps)
    return fused_add_rmsnorm_ref(x, residual, weight, eps)
