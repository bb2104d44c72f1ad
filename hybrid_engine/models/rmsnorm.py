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

from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend, next_pow2, triton_available


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

    @triton.jit
    def _rmsnorm_kernel(x_ptr, r_ptr, r_out_ptr, w_ptr, out_ptr, D, eps, sx, sr, sro, so,
                        ADD_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        # One program per row. With ADD_RESIDUAL the row is first replaced by residual + x
        # (float32 add, one rounding to the residual dtype = torch's add), which is stored; the
        # norm below is then the same code for both variants, so their outputs agree bitwise.
        row = (tl.program_id(0) + pdl_enter(PDL)).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0)
        if ADD_RESIDUAL:
            r = tl.load(r_ptr + row * sr + offs, mask=m, other=0.0)
            x = (r.to(tl.float32) + x.to(tl.float32)).to(r_out_ptr.dtype.element_ty)
            tl.store(r_out_ptr + row * sro + offs, x, mask=m)
        x = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * so + offs, (w * (x * inv)).to(out_ptr.dtype.element_ty), mask=m)


def _launch(x, residual, residual_out, weight, out, eps) -> None:
    """x [T, D] (unit inner stride); residual/residual_out [T, D] or None (plain norm)."""
    t, d = x.shape
    if t == 0:
        return
    add = residual is not None
    r, ro = (residual, residual_out) if add else (x, out)    # unused pointers when not adding
    block = next_pow2(d)
    _rmsnorm_kernel[(t,)](x, r, ro, weight, out, d, float(eps), x.stride(0), r.stride(0),
                          ro.stride(0), out.stride(0), ADD_RESIDUAL=add, BLOCK_D=block,
                          num_warps=min(16, max(1, block // 256)), **pdl_kwargs(x.device))


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


def _rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(-1) == 1


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _rows(x) and kernel_backend("rmsnorm", x.device) == "triton":
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rmsnorm(residual + x), residual + x); inputs are left unchanged (module docstring)."""
    if (_rows(x) and _rows(residual) and x.shape == residual.shape and x.dtype == residual.dtype
            and kernel_backend("fused_add_rmsnorm", x.device) == "triton"):
        return fused_add_rmsnorm_triton(x, residual, weight, eps)
    return fused_add_rmsnorm_ref(x, residual, weight, eps)
