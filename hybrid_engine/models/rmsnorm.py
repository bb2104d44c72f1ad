"""Block RMSNorm: torch reference and a one-kernel Triton version (CUDA).

Semantics (transformers' NemotronHRMSNorm): out = (weight.float() * x.float() * rsqrt(mean(x^2) +
eps)).to(x.dtype). The torch form is ~8 small kernels per call; on the decode path of a 52-block
model that launch-bound tail is a visible share of the step, so CUDA takes one fused kernel.
"""
from __future__ import annotations

import torch

from mamba_cache.ops.triton_common import kernel_backend, next_pow2, triton_available


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()                                                         # [T, D]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, D, eps, sx, so, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * so + offs, (w * (x * r)).to(out_ptr.dtype.element_ty), mask=m)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same arguments and result as ``rmsnorm_ref`` for x [T, D] with a unit inner stride."""
    t, d = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if t == 0:
        return out
    block = next_pow2(d)
    _rmsnorm_kernel[(t,)](x, weight, out, d, float(eps), x.stride(0), out.stride(0), BLOCK_D=block,
                          num_warps=min(16, max(1, block // 256)))
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and x.stride(-1) == 1 and kernel_backend("rmsnorm", x.device) == "triton":
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)
