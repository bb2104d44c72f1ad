"""Random cases for the model-side kernels (block RMSNorm, fused residual add + RMSNorm, relu²):
imported by test_rmsnorm_cuda.py (CUDA) and the interpreter subprocess (interpret_cases.py).

Each ``check_*`` builds inputs on ``device``, poisons the CUDA allocator (so an element a kernel
fails to write reads NaN), runs the Triton function and its torch twin, and asserts:
- the residual stream and relu² are bit-identical to torch (what the unfused path computed);
- the fused norm's output is bit-identical to the plain Triton rmsnorm of the same residual (the
  kernel the unfused CUDA path ran), and within the norm tolerance of ``rmsnorm_ref`` (not bitwise:
  Triton's tree-shaped row sum and approximate rsqrt differ from torch's by an ulp or so);
- no NaN where the reference is finite; inputs are left unchanged.
Returns a dict of the measured errors.
Under TRITON_INTERPRET=1 use float32/float16 only: the interpreter truncates float32 -> bf16
instead of rounding to nearest even (the GPU rounds, like torch), so bf16 bit checks fail there.
"""
from __future__ import annotations

import math

import torch

from kernel_cases import TOL, assert_close, poison_allocator
from hybrid_engine.models.activation import relu2_ref
from hybrid_engine.models.rmsnorm import fused_add_rmsnorm_ref, rmsnorm_ref

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same dtype, shape and NaN positions; every other element has the same bit pattern (so
    -0.0 vs +0.0 fails; NaN payloads may differ)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        (what, actual.dtype, expected.dtype, actual.shape, expected.shape)
    na, ne = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(na, ne), f"{what}: NaN pattern differs ({int((na != ne).sum())} places)"
    ia, ie = actual.view(_INT[actual.dtype]), expected.view(_INT[expected.dtype])
    diff = (ia != ie) & ~ne
    assert not bool(diff.any()), f"{what}: {int(diff.sum())} elements differ bitwise"


def _inputs(T, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * 0.5).to(dtype)                  # [T, D] block output
    res = (torch.randn(T, D, generator=g) * 4).to(dtype)                  # [T, D] residual stream
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)                 # [D]
    return x.to(device), res.to(device), w.to(device)


def check_rmsnorm(impl, device, dtype, T, D, eps=1e-5, seed=0):
    x, _, w = _inputs(T, D, dtype, device, seed)
    ref = rmsnorm_ref(x, w, eps)
    poison_allocator(device)
    out = impl(x, w, eps)
    assert out.dtype == dtype and out.shape == (T, D)
    assert bool(torch.isfinite(out).all()), "rmsnorm: non-finite output"
    return {"out": assert_close(out, ref, TOL["norm"][dtype], "rmsnorm")}


def check_add_rmsnorm(impl, plain_impl, device, dtype, T, D, eps=1e-5, seed=0):
    """impl: fused_add_rmsnorm-like (x, residual, w, eps) -> (normed, residual); plain_impl:
    rmsnorm-like, the unfused kernel the normed output must equal bitwise."""
    x, res, w = _inputs(T, D, dtype, device, seed)
    x0, res0 = x.clone(), res.clone()
    ref_out, ref_res = fused_add_rmsnorm_ref(x, res, w, eps)
    poison_allocator(device)
    out, new_res = impl(x, res, w, eps)
    assert_bits(new_res, ref_res, "residual")
    assert_bits(new_res, res0 + x0, "residual vs torch add")
    assert bool(torch.isfinite(out).all()), "fused norm: non-finite output"
    assert_bits(out, plain_impl(ref_res, w, eps), "normed vs the plain rmsnorm kernel")
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs modified"
    return {"out": assert_close(out, ref_out, TOL["norm"][dtype], "fused_add_rmsnorm")}


def check_relu2(impl, device, dtype, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g) * 3                                  # [T, D]
    special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-20, -1e-30, 3e38, 300.0])
    n = min(x.numel(), special.numel())
    x.view(-1)[:n] = special[:n]  # NaN, inf, signed zeros, fp32-subnormal square, overflow
    x = x.to(dtype).to(device)
    x0 = x.clone()
    ref = relu2_ref(x)
    poison_allocator(device)
    out = impl(x)
    assert_bits(out, ref, "relu2")
    assert torch.equal(torch.isnan(out), torch.isnan(x0)), "relu2: NaN where the input has none"
    assert torch.equal(x.nan_to_num(0.0), x0.nan_to_num(0.0)), "input modified"
    return {"out": 0.0}
