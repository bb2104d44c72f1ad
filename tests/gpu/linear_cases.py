"""Random cases for the decode-sized projections (``models/skinny_linear.py``): each kernel against
F.linear in float64, float32 rows' batch invariance, and relu² applied as x is loaded (the relu²
MLP's down_proj). Imported by test_skinny_linear_cuda.py (CUDA) and the interpreter subprocess
(interpret_cases.py); not a test module itself. Each ``check_*`` poisons the allocator first and
returns the measured errors."""
from __future__ import annotations

import math

import torch

from kernel_cases import BF16, F16, F32, _gen, assert_close, poison_allocator


def check_linear_rows_invariant(impl, device, M, N, K, seed=0):
    """float32 impl(x, weight, bias): each of M rows equals, bit for bit, the same row computed
    alone and within every shorter prefix of the rows (a verify step's rows vs a one-token step's)."""
    g = _gen(seed)
    x = torch.randn(M, K, generator=g).to(device)
    w = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(device)
    b = torch.randn(N, generator=g).to(device)
    poison_allocator(device)
    full = impl(x, w, b)
    assert_close(full.cpu().double(), torch.nn.functional.linear(x.cpu().double(), w.cpu().double(),
                                                                   b.cpu().double()), 1e-5, "rows")
    for m in range(1, M):
        part = impl(x[:m], w, b)
        assert torch.equal(part, full[:m]), f"rows 0..{m - 1} computed alone differ from within {M} rows"
    for r in range(M):
        assert torch.equal(impl(x[r:r + 1], w, b), full[r:r + 1]), f"row {r} alone differs"
    return {"rows": M}


def relu2_inputs(M, K, dtype, seed):
    """x [M, K] for the relu² projections: half negative, exact zeros and -0.0, values whose square
    rounds in 16 bits (x * 3), and some large enough that the square's rounding is coarse (their
    squares stay below float16's 65504)."""
    g = _gen(seed)
    x = torch.randn(M, K, generator=g) * 3
    x[:, ::5] = 0.0
    x[:, 1::5] = -0.0
    x[:, 2::11] *= 4 if dtype == F16 else 40
    return x.to(dtype)


def check_linear_relu2(impl, device, dtype, M, N, K, bias=True, seed=0, tol=None):
    """impl(x, w, b, relu2=True) is the projection of relu2(x) (the relu² MLP's down_proj): bit for
    bit what the same impl gives on ``relu2_ref(x)`` (relu² applied as x is loaded, rounded to x's
    dtype as the relu² kernel writes it), and close to F.linear of it in float64."""
    from hybrid_engine.models.activation import relu2_ref
    x = relu2_inputs(M, K, dtype, seed)
    g = _gen(seed + 1)
    w = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    act = relu2_ref(x)
    ref = torch.nn.functional.linear(act.double(), w.double(), b.double() if bias else None)
    x, act, w = x.to(device), act.to(device), w.to(device)
    b = b.to(device) if bias else None
    poison_allocator(device)
    fused = impl(x, w, b, relu2=True)
    poison_allocator(device)
    plain = impl(act, w, b)
    assert torch.equal(fused, plain), f"relu2 fused into the load differs from the relu2 tensor (M={M} N={N} K={K})"
    assert not torch.equal(fused, impl(x, w, b)), "relu2 was not applied"
    tol = tol or {F32: 1e-5, BF16: 1e-2, F16: 2e-3}[dtype]
    return {"y": assert_close(fused.cpu().double(), ref, tol, "relu2 projection")}


def check_linear(impl, device, dtype, M, N, K, bias=True, seed=0, tol=None):
    """impl(x, weight, bias) vs F.linear in float64 on the same (rounded) inputs; x is a strided
    row view (unit inner stride) as hidden-state slices are in the model."""
    g = _gen(seed)
    xbig = torch.randn(M, K + 5, generator=g).to(dtype)
    x = xbig[:, 2:2 + K]
    w = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    x, w = x.to(device), w.to(device)
    b = b.to(device) if bias else None
    poison_allocator(device)
    y = impl(x, w, b)
    assert y.dtype == dtype and y.shape == (M, N)
    # float32 accumulation, one rounding to dtype at the end
    tol = tol or {F32: 1e-5, BF16: 1e-2, F16: 2e-3}[dtype]
    return {"y": assert_close(y.cpu().double(), ref, tol, "skinny linear")}

