"""relu² (Nemotron-H's MLP activation): torch reference and a one-kernel Triton version (CUDA).

``F.relu(x).square()`` is two elementwise kernels (and a full intermediate) per MLP; on the decode
path they are pure launch overhead, so CUDA takes one kernel. Bit-identical to torch: torch's
``square`` is ``pow(x, 2)``, which its CUDA kernel specialises to ``base * base`` in the tensor's
type; for bf16/fp16 that is the product in float32 rounded once to the dtype (the float32 product
of two bf16/fp16 values is exact), which is what the kernel computes. NaN propagates as in
``F.relu``; -0.0 squares to +0.0 either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, kernel_backend, triton_available

BLOCK = 1024                      # elements per program


def relu2_ref(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _relu2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        x = tl.where(x < 0.0, 0.0, x)                 # relu that keeps NaN (NaN < 0 is false)
        tl.store(out_ptr + offs, (x * x).to(out_ptr.dtype.element_ty), mask=m)


def relu2_triton(x: torch.Tensor) -> torch.Tensor:
    """Same argument and result as ``relu2_ref`` for a contiguous x (any shape)."""
    out = torch.empty_like(x)                       # [..., I]
    n = x.numel()
    if n:
        _relu2_kernel[(cdiv(n, BLOCK),)](x, out, n, BLOCK=BLOCK, num_warps=4)
    return out


def relu2(x: torch.Tensor) -> torch.Tensor:
    if x.is_contiguous() and kernel_backend("relu2", x.device) == "triton":
        return relu2_triton(x)
    return relu2_ref(x)
