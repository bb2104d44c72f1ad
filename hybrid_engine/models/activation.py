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

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, kernel_backend, triton_available, triton_interpreting

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

    @triton.jit
    def relu2_rounded(xf, dtype: tl.constexpr, BF16_BITS: tl.constexpr):
        """relu(x)² of float32 ``xf`` rounded to ``dtype`` (x's), back in float32, as ``relu2``
        writes it: the projections that apply relu² to x as they load it (the register-FMA kernels:
        ``skinny_linear``'s and the one-row FP8 one) give the projection of ``relu2(x)`` bit for bit. Non-decreasing in x (each rounding
        is), so the largest value of a row is this of the row's largest x. The interpreter's
        float32 -> bfloat16 cast does not round to nearest even, so there (BF16_BITS: bfloat16 x
        under the interpreter) the rounding is done on the bits: add 0x7FFF plus the kept lowest
        bit, drop the low 16 bits (the square is >= 0, inf or NaN, which this keeps)."""
        xf = tl.where(xf < 0.0, 0.0, xf)             # relu that keeps NaN (NaN < 0 is false)
        sq = xf * xf
        if BF16_BITS:
            b = sq.to(tl.int32, bitcast=True)
            return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return sq.to(dtype).to(tl.float32)

    @triton.jit
    def proj_input_f32(v, RELU2: tl.constexpr, BF16_BITS: tl.constexpr):
        """A loaded tile of a projection's input x in float32; RELU2: relu(x)² rounded to x's dtype
        first (``relu2_rounded``), so the projection is of ``relu2(x)`` bit for bit, without the
        relu² kernel's launch and its [M, K] round trip (``relu2_flags`` gives the launch's flags)."""
        if RELU2:
            return relu2_rounded(v.to(tl.float32), v.dtype, BF16_BITS)
        return v.to(tl.float32)


def relu2_flags(x: torch.Tensor, relu2: bool) -> dict:
    """Launch flags of a kernel that applies relu² to x as it loads it (``proj_input_f32``): RELU2, and
    BF16_BITS for bfloat16 x under the interpreter (``relu2_rounded``); none when not ``relu2``."""
    if not relu2:
        return {}
    return dict(RELU2=True, BF16_BITS=x.dtype == torch.bfloat16 and triton_interpreting())


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
