"""Quantized-weight linear kernels against their exact torch twins, on random inputs.

``check_fp8`` / ``check_nvfp4`` build random quantized weights (ragged rows, odd widths, strided x
rows, bias or not), run a kernel with every float output allocation poisoned with NaN (an element
the kernel forgets stays NaN and fails), and compare with ``fp8_linear_ref`` / ``nvfp4_linear_ref``
(exact float32 dequantization). Used by tests/quant/test_quant_kernels.py (CPU: run as a script under
TRITON_INTERPRET=1, which prints ``CASE name OK|FAIL``) and tests/gpu/test_quant_cuda.py (CUDA).
The interpreter cases use float32 / float16 x (bf16 ``tl.dot`` is wrong in the interpreter).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys

import torch

from hybrid_engine.quantization.fp8 import fp8_linear_ref, quantize_fp8
from hybrid_engine.quantization.nvfp4 import nvfp4_linear_ref, quantize_nvfp4


@contextlib.contextmanager
def poisoned_empty():
    """``torch.empty`` returns NaN-filled float tensors inside the block (float8_e4m3fn: its NaN
    byte 0x7F)."""
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        elif t.is_floating_point() and t.dtype.itemsize > 1:
            t.fill_(math.nan)
        return t
    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def _inputs(M, N, K, dtype, bias, seed, device):
    g = torch.Generator().manual_seed(seed)
    xbig = torch.randn(M, K + 7, generator=g).to(dtype)
    x = xbig[:, 3:3 + K]                                  # strided rows, unit inner stride
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g).add(0.1)   # row scales differ
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x.to(device), w, (b.to(device) if bias else None)


def _rel(y, ref):
    d = (y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    return float(d)


def check_fp8(impl, device, dtype, M, N, K, per_channel, bias=True, seed=0, tol=None):
    x, w, b = _inputs(M, N, K, dtype, bias, seed, device)
    w_q, s = quantize_fp8(w, per_channel)
    w_q, s = w_q.to(device), s.to(device)
    with poisoned_empty():
        y = impl(x, w_q, s, b)
    assert y.shape == (M, N) and y.dtype == dtype, (y.shape, y.dtype)
    assert not torch.isnan(y).any(), "unwritten (NaN) outputs"
    ref = fp8_linear_ref(x.float(), w_q, s, None if b is None else b.float())   # float32 twin
    err = _rel(y.cpu(), ref.cpu())
    tol = tol or {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert err <= tol, f"fp8 M={M} N={N} K={K} per_channel={per_channel}: rel err {err:.2e} > {tol:.0e}"
    return err


def _relu2_inputs(M, N, K, dtype, bias, seed):
    """x [M, K] in dtype with zeros and large values (squares below float16's 65504), relu2_ref(x),
    a float32 weight [N, K] and an optional bias, for the relu²-on-load checks."""
    from hybrid_engine.models.activation import relu2_ref
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 3)
    x[:, ::5] = 0.0
    x[:, 2::11] *= 4 if dtype == torch.float16 else 40
    x = x.to(dtype)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, relu2_ref(x), w, b


def check_fp8_relu2(impl, device, dtype, M, N, K, per_channel, bias=True, seed=0):
    """impl(x, w_q, s, b, relu2=True): bit for bit impl on ``relu2_ref(x)`` (relu² applied as x is
    loaded, rounded to x's dtype as the relu² kernel writes it), and close to the float32 twin."""
    x, act, w, b = _relu2_inputs(M, N, K, dtype, bias, seed)
    w_q, s = quantize_fp8(w, per_channel)
    x, act, w_q, s = x.to(device), act.to(device), w_q.to(device), s.to(device)
    b = b.to(device) if bias else None
    with poisoned_empty():
        fused = impl(x, w_q, s, b, relu2=True)
        plain = impl(act, w_q, s, b)
    assert torch.equal(fused, plain), f"fp8 relu2 M={M} N={N} K={K}: fused differs from the relu2 tensor"
    assert not torch.equal(fused, impl(x, w_q, s, b)), "relu2 was not applied"
    ref = fp8_linear_ref(act.float(), w_q, s, None if b is None else b.float())
    err = _rel(fused.cpu(), ref.cpu())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert err <= tol, f"fp8 relu2 M={M} N={N} K={K}: rel err {err:.2e} > {tol:.0e}"
    return err


def check_nvfp4(impl, device, dtype, M, N, K, bias=True, seed=0, tol=None):
    x, w, b = _inputs(M, N, K, dtype, bias, seed, device)
    packed, bs, gs = (t.to(device) for t in quantize_nvfp4(w))
    with poisoned_empty():
        y = impl(x, packed, bs, gs, b)
    assert y.shape == (M, N) and y.dtype == dtype, (y.shape, y.dtype)
    assert not torch.isnan(y).any(), "unwritten (NaN) outputs"
    ref = nvfp4_linear_ref(x.float(), packed, bs, gs, None if b is None else b.float())
    err = _rel(y.cpu(), ref.cpu())
    tol = tol or {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert err <= tol, f"nvfp4 M={M} N={N} K={K}: rel err {err:.2e} > {tol:.0e}"
    return err


def check_nvfp4_relu2(impl, device, dtype, M, N, K, bias=True, seed=0):
    """impl(x, packed, bs, gs, b, relu2=True): bit for bit impl on ``relu2_ref(x)`` (relu² applied
    as x is loaded, rounded to x's dtype as the relu² kernel writes it), and close to the float32
    twin."""
    x, act, w, b = _relu2_inputs(M, N, K, dtype, bias, seed)
    packed, bs, gs = (t.to(device) for t in quantize_nvfp4(w))
    x, act = x.to(device), act.to(device)
    b = b.to(device) if bias else None
    with poisoned_empty():
        fused = impl(x, packed, bs, gs, b, relu2=True)
        plain = impl(act, packed, bs, gs, b)
    assert torch.equal(fused, plain), f"nvfp4 relu2 M={M} N={N} K={K}: fused differs from the relu2 tensor"
    assert not torch.equal(fused, impl(x, packed, bs, gs, b)), "relu2 was not applied"
    ref = nvfp4_linear_ref(act.float(), packed.cpu(), bs.cpu(), gs.cpu(), None if b is None else b.float().cpu())
    err = _rel(fused.float().cpu(), ref)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert err <= tol, f"nvfp4 relu2 M={M} N={N} K={K}: rel err {err:.2e} > {tol:.0e}"
    return err


def check_nvfp4_x_range(impl, device, dtype, N, K, lo, hi, seed=0, tol=None, M=1):
    """M rows of x whose 16-input groups each have their own magnitude 10^u, u uniform in [lo, hi]
    (lo == hi: every group alike): the one-row kernel scales each group by a power of two before its
    float16 products, so groups far below float16's normal range (1e-7) or above its largest value
    (1e6 with bf16 x) must come out like the float32 twin, with no infinity or NaN; at 1e36 (float32
    x, outputs near 1e36) the float32 accumulator must not overflow either."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (lo + (hi - lo) * torch.rand(M, K // 16, generator=g, dtype=torch.float64))
    x = (torch.randn(M, K, generator=g, dtype=torch.float64) * mag.repeat_interleave(16, dim=1)).to(dtype)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    packed, bs, gs = (t.to(device) for t in quantize_nvfp4(w))
    with poisoned_empty():
        y = impl(x.to(device), packed, bs, gs)
    assert torch.isfinite(y).all(), "infinite or NaN outputs"
    ref = nvfp4_linear_ref(x.float(), packed.cpu(), bs.cpu(), gs.cpu())
    err = _rel(y.cpu(), ref)
    tol = tol or {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert err <= tol, f"nvfp4 x groups 1e{lo}..1e{hi} N={N} K={K}: rel err {err:.2e} > {tol:.0e}"
    return err


def check_nvfp4_zero_rows(device):
    """0-row x through the dispatch and the rows kernel: an empty [0, N] result, no launch error."""
    from hybrid_engine.quantization.nvfp4_fma_kernels import nvfp4_skinny_linear_rows
    from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear
    packed, bs, gs = (t.to(device) for t in quantize_nvfp4(torch.randn(40, 64)))
    x = torch.zeros(0, 64, device=device)
    for impl in (nvfp4_skinny_linear, nvfp4_skinny_linear_rows):
        y = impl(x, packed, bs, gs)
        assert y.shape == (0, 40), (impl.__name__, y.shape)
    return 0.0


def check_zero_k(device):
    """K = 0 (an empty reduction) through the dot kernels with K in slices: one program, y = the
    bias (zeros without), no division by an empty slice."""
    from hybrid_engine.quantization.fp8_kernels import fp8_skinny_linear_dot
    from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear, nvfp4_skinny_linear_dot
    packed, bs, gs = (t.to(device) for t in quantize_nvfp4(torch.randn(40, 32)))
    bias = torch.randn(40, device=device)
    x = torch.zeros(5, 0, device=device)
    p0, bs0 = packed[:, :0], bs[:, :0]
    w_q, s = quantize_fp8(torch.randn(40, 32), True)
    with poisoned_empty():
        got = ((nvfp4_skinny_linear(x, p0, bs0, gs, bias), bias.expand(5, 40)),
               (nvfp4_skinny_linear_dot(x, p0, bs0, gs, None, block_n=64, block_w=16, swap=True, k_slices=4),
                torch.zeros(5, 40)),
               (fp8_skinny_linear_dot(x, w_q[:, :0].to(device), s.to(device), bias, k_slices=3), bias.expand(5, 40)))
    for y, want in got:
        assert torch.equal(y, want.to(y)), (y, want)
    return 0.0


def check_fp8_experts(device, dtype, T, E, k, D, F, grouped, seed=0, tol=None):
    """routed_experts_triton with FP8 merged experts (per-expert scales) vs the reference with the
    weights dequantized exactly (float32 h: the same arithmetic up to summation order)."""
    from hybrid_engine.models.moe_ops import grouped_experts_ref, dequantize_experts
    from hybrid_engine.models.triton_moe import routed_experts_triton
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g).to(dtype)
    w_up = torch.randn(E, F, D, generator=g) / math.sqrt(D) * torch.rand(E, 1, 1, generator=g).add(0.5)
    w_down = torch.randn(E, D, F, generator=g) / math.sqrt(F)
    qs = [quantize_fp8(w.reshape(-1, w.shape[-1]), False) for w in (*w_up, *w_down)]
    up_q = torch.stack([q for q, _ in qs[:E]]).view(E, F, D)
    down_q = torch.stack([q for q, _ in qs[E:]]).view(E, D, F)
    up_s = torch.stack([s for _, s in qs[:E]])
    down_s = torch.stack([s for _, s in qs[E:]])
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, k, generator=g)
    ref = grouped_experts_ref(h.float(), dequantize_experts(up_q, up_s, torch.float32),
                              dequantize_experts(down_q, down_s, torch.float32), ids, wts)
    dev = lambda t: t.to(device)   # noqa: E731
    with poisoned_empty():
        y = routed_experts_triton(dev(h), dev(up_q), dev(down_q), dev(ids), dev(wts), force_grouped=grouped,
                                  up_scale=dev(up_s), down_scale=dev(down_s))
    assert y.shape == (T, D) and not torch.isnan(y).any()
    err = _rel(y.cpu(), ref)
    tol = tol or {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert err <= tol, f"fp8 experts T={T} grouped={grouped}: rel err {err:.2e} > {tol:.0e}"
    return err


def check_quantize_rows(impl, device, seed=0, shapes=((1, 5), (3, 130), (7, 1100), (2, 64)), relu2=False, **kw):
    """The W8A8 activation quantizer against ``quantize_activations`` (torch), code for code and
    scale for scale: rows spanning 1e-3..1e3, an all-zero row, strided rows, float32 / float16 /
    bfloat16, dynamic and static scales, and every e4m3 value, midpoint and near-midpoint (the
    rounding, ties and saturation) with a unit scale. ``relu2``: ``impl(..., relu2=True)`` against
    ``quantize_activations(relu2_ref(x))`` (the grid's square roots then give the e4m3 values and
    midpoints after the square, up to the rounding of the root). Returns the number of codes
    compared."""
    from hybrid_engine.models.activation import relu2_ref
    from hybrid_engine.quantization.fp8 import quantize_activations
    g = torch.Generator().manual_seed(seed)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = codes[torch.isfinite(codes)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    special = torch.tensor([1e-30, -1e-30, 600.0, -600.0, 2.0 ** -10, 2.0 ** -11 * 1.01, -0.0, 3e38, -3e38])
    edge = torch.cat([grid, mids, mids * (1 + 1e-7), mids * (1 - 1e-7), special])
    if relu2:           # the values before the square: roots of the edge cases, and negatives (-> 0)
        edge = torch.cat([edge.abs().sqrt(), -edge.abs().sqrt(), edge])
    inputs = [(edge[None], torch.ones(()))]
    nonfinite = torch.tensor([[float("nan"), 1.0, -2.0, 3.0, 0.5],            # NaN: torch's scale is 1
                              [float("inf"), 1.0, -2.0, 3.0, 0.5],            # inf: scale inf, codes 0 / NaN
                              [-float("inf"), float("nan"), 7.0, 0.0, -1.0],
                              [1.0, -2.0, 3.0, 250.0, 1e-3]])
    inputs += [(nonfinite, None), (nonfinite, torch.tensor(0.5)), (nonfinite.to(torch.bfloat16), None)]
    # the division by a scale that is not a power of two, where a quotient one ulp off flips a code:
    # x = t * s (float32) for t on and near the e4m3 midpoints, with random static scales, and rows
    # whose first value A sets the dynamic scale fl(A / 448)
    near = torch.cat([mids, mids * (1 + 1e-7), mids * (1 - 1e-7), -mids, grid])
    for _ in range(16):
        s = torch.exp(torch.randn((), generator=g) * 4).float()
        inputs.append(((near * s)[None], s))
        a = (torch.rand(3, generator=g) * 10 + 0.5).float()
        rows = torch.cat([a[:, None], near[None] * (a[:, None] / 448)], dim=1).float()
        inputs.append((rows.clamp(-a[:, None], a[:, None]), None))
    # scales beyond the fast division's [2^-60, 2^60] (tiny rows: amax ~1e-37; huge static scales)
    # and quotients that overflow float32 (x / 0.5 for x near the float32 maximum)
    for s in (2.0 ** -70, 2.0 ** -61, 2.0 ** -60, 2.0 ** -60 * 1.37, 2.0 ** 59 * 1.9, 2.0 ** 60, 2.0 ** 61 * 1.5, 2.0 ** 70):
        inputs.append(((near * s).float()[None], torch.tensor(s, dtype=torch.float32)))
    inputs.append(((near * 1e-37 / 448).float()[None], None))
    inputs.append((torch.tensor([[3e38, -3e38, 1.7e38, 2.0, -0.0, 1e-30]]), torch.tensor(0.5)))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for M, K in shapes:
            x = (torch.randn(M, K + 3, generator=g) * torch.logspace(-3, 3, M)[:, None]).to(dtype)[:, 3:]
            if M > 2:
                x[1] = 0
            inputs += [(x, None), (x, (x.float().abs().amax() / 300).reshape(()))]
    n = 0
    for x, in_scale in inputs:
        ref_q, ref_s = quantize_activations(relu2_ref(x) if relu2 else x, in_scale)
        with poisoned_empty():
            q, s = impl(x.to(device), None if in_scale is None else in_scale.to(device),
                        **(dict(kw, relu2=True) if relu2 else kw))
        assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape, (q.dtype, q.shape)
        assert torch.equal(s.cpu(), ref_s), f"scales differ for {tuple(x.shape)} {x.dtype}: {s.cpu()} {ref_s}"
        qf, rf = q.cpu().float(), ref_q.float()
        assert torch.equal(qf.isnan(), rf.isnan()), f"NaN codes differ for {tuple(x.shape)} {x.dtype}"
        finite = ~rf.isnan()                          # (the NaN byte's sign differs between devices)
        bad = (q.cpu().view(torch.uint8)[finite] != ref_q.view(torch.uint8)[finite]).sum().item()
        assert bad == 0, f"{bad} codes differ for {tuple(x.shape)} {x.dtype} static={in_scale is not None}"
        n += q.numel()
    return n


def check_add_rmsnorm_fp8(device, dtype, T, D, seed=0, residual=True):
    """``add_rmsnorm_fp8`` (the block norm quantizing its output for the W8A8 path) against the
    unfused path, ``quantize_rows_fp8`` of the Triton norm's 16-bit output: codes, scales and the
    residual stream bit for bit (poisoned outputs; rows spanning 1e-3..1e3, a zero row). And
    against the torch twin: the dequantized codes within half an e4m3 step of ``rmsnorm_ref``
    (the norm's float32 sum may round differently from torch's). Returns the codes compared."""
    from hybrid_engine.models.rmsnorm import (add_rmsnorm_fp8, fused_add_rmsnorm_ref, fused_add_rmsnorm_triton,
                                              rmsnorm_ref, rmsnorm_triton)
    from hybrid_engine.quantization.fp8_quantizer import quantize_rows_fp8
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * torch.logspace(-3, 3, T)[:, None]).to(dtype)
    r = torch.randn(T, D, generator=g).to(dtype) if residual else None
    if T > 2:
        x[1] = 0
        if r is not None:
            r[1] = 0
    w = (torch.rand(D, generator=g) * 2 - 0.5).to(dtype)
    x, w = x.to(device), w.to(device)
    r = None if r is None else r.to(device)
    with poisoned_empty():
        codes, scale, r_out = add_rmsnorm_fp8(x, r, w, 1e-5)
        normed, r_ref = fused_add_rmsnorm_triton(x, r, w, 1e-5) if residual else (rmsnorm_triton(x, w, 1e-5), x)
        q_ref, s_ref = quantize_rows_fp8(normed)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (T, D) and scale.shape == (T, 1)
    assert torch.equal(scale, s_ref), "scales differ from the unfused path"
    assert torch.equal(codes.view(torch.uint8), q_ref.view(torch.uint8)), "codes differ from the unfused path"
    assert torch.equal(r_out, r_ref), "residual stream differs"
    twin = (fused_add_rmsnorm_ref(x.cpu(), r.cpu(), w.cpu(), 1e-5)[0] if residual
            else rmsnorm_ref(x.cpu(), w.cpu(), 1e-5)).float()
    deq = codes.cpu().float() * scale.cpu()
    # e4m3 has 3 mantissa bits: half a step is 1/16 of the value's binade; + the scale's subnormal step
    tol = twin.abs() / 16 + scale.cpu() * 2.0 ** -9 + twin.abs() * 2e-2
    assert bool(((deq - twin).abs() <= tol).all()), (deq - twin).abs().max()
    return codes.numel()


# shapes: (M, N, K) with ragged rows and odd widths (N, K not multiples of the blocks)
FP8_FMA_SHAPES = [(1, 1, 5), (1, 37, 130), (1, 100, 1100)]
FP8_DOT_SHAPES = [(2, 37, 130), (3, 64, 96), (8, 100, 1100), (5, 1, 17)]
NVFP4_SHAPES = [(1, 33, 16), (2, 70, 48), (5, 1, 272), (8, 130, 544), (20, 40, 64), (70, 17, 32)]
NVFP4_FMA_SHAPES = [(1, 33, 16), (1, 70, 48), (1, 5, 272), (1, 130, 544)]   # groups not a multiple of BLOCK_G
NVFP4_ROWS_SHAPES = [(2, 33, 16), (3, 20, 48), (5, 19, 80), (8, 9, 272)]   # ROWS 2 / 4 / 8


def _cases():
    from hybrid_engine.quantization.fp8_kernels import fp8_skinny_linear, fp8_skinny_linear_dot, fp8_skinny_linear_fma
    from hybrid_engine.quantization.fp8_quantizer import quantize_rows_fp8
    from hybrid_engine.quantization.nvfp4_fma_kernels import nvfp4_skinny_linear_fma, nvfp4_skinny_linear_rows
    from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear, nvfp4_skinny_linear_dot
    cpu, f32, f16 = "cpu", torch.float32, torch.float16

    def run(fn, shapes, **kw):
        return lambda: max(fn(**kw, M=m, N=n, K=k, seed=i) for i, (m, n, k) in enumerate(shapes))

    def small(impl, **kw):
        return lambda x, w, s, b: impl(x, w, s, b, **kw)

    return {
        "fp8_fma_tensor": run(check_fp8, FP8_FMA_SHAPES, impl=small(fp8_skinny_linear_fma, block_n=8, block_k=64),
                              device=cpu, dtype=f32, per_channel=False),
        "fp8_fma_channel": run(check_fp8, FP8_FMA_SHAPES, impl=small(fp8_skinny_linear_fma, block_n=4, block_k=128),
                               device=cpu, dtype=f32, per_channel=True, bias=False),
        "fp8_fma_f16": run(check_fp8, FP8_FMA_SHAPES, impl=small(fp8_skinny_linear_fma, block_n=8, block_k=64),
                           device=cpu, dtype=f16, per_channel=True),
        "fp8_dot_tensor": run(check_fp8, FP8_DOT_SHAPES, impl=small(fp8_skinny_linear_dot, block_n=16, block_k=32),
                              device=cpu, dtype=f32, per_channel=False, bias=False),
        "fp8_dot_channel_f16": run(check_fp8, FP8_DOT_SHAPES, impl=small(fp8_skinny_linear_dot, block_n=16,
                                                                          block_k=64),
                                   device=cpu, dtype=f16, per_channel=True),
        # K in slices of whole 32-wide tiles (1100: 35 tiles asked for 4 slices -> 9 + 9 + 9 + 8;
        # 130: 5 tiles asked for 8 -> 5; 17: one tile, no split), per-tensor and per-channel scales
        "fp8_dot_slices": lambda: max(
            check_fp8(impl=lambda x, w, s, b, ks=ks: fp8_skinny_linear_dot(x, w, s, b, block_n=16, block_k=32,
                                                                         k_slices=ks),
                      device=cpu, dtype=f32, M=m, N=n, K=k, per_channel=pc, seed=i)
            for i, (m, n, k, ks, pc) in enumerate([(8, 100, 1100, 4, True), (2, 37, 130, 8, False),
                                                   (5, 1, 17, 3, True)])),
        # the 2-8-row dispatch with K in slices: 4 at N <= 2048, 3 at N <= 8192 (K >= 4096)
        "fp8_dispatch_slices": run(check_fp8, [(2, 40, 4096), (5, 2100, 4096)], impl=fp8_skinny_linear,
                                   device=cpu, dtype=f16, per_channel=True),
        "fp8_dispatch": run(check_fp8, [(m, 40, 96) for m in range(1, 9)], impl=fp8_skinny_linear,
                            device=cpu, dtype=f16, per_channel=True),
        "fp8_fma_relu2": run(check_fp8_relu2, FP8_FMA_SHAPES, impl=lambda x, w, s, b, **k: fp8_skinny_linear_fma(
            x, w, s, b, block_n=8, block_k=64, **k), device=cpu, dtype=torch.bfloat16, per_channel=True),
        # the dispatcher: relu² on load for one row, the relu² kernel then the dot kernel for more
        "fp8_dispatch_relu2": run(check_fp8_relu2, [(m, 40, 96) for m in range(1, 9)] + [(5, 2100, 4096), (8, 40, 4100)],
                                  impl=fp8_skinny_linear, device=cpu, dtype=f16, per_channel=True),
        "nvfp4_dot": run(check_nvfp4, NVFP4_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_dot(
            x, p, s, g, b, block_n=16, block_w=4), device=cpu, dtype=f32),
        "nvfp4_dot_swap": run(check_nvfp4, NVFP4_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_dot(
            x, p, s, g, b, block_n=16, block_w=2, swap=True), device=cpu, dtype=f32),
        # K in slices of whole tiles, the last one partial (68 words: 24 + 24 + 20; 34: 10 x 3 + 4;
        # 8 words in tiles of 4 asked for 5 slices: 2), added by the slice sum with the bias
        "nvfp4_dot_slices": lambda: max(
            check_nvfp4(impl=lambda x, p, s, g, b, kw=kw: nvfp4_skinny_linear_dot(x, p, s, g, b, **kw),
                        device=cpu, dtype=dt, M=m, N=n, K=k, seed=i)
            for i, (m, n, k, dt, kw) in enumerate([
                (3, 40, 544, f32, dict(block_n=16, block_w=4, k_slices=3)),
                (20, 17, 272, f16, dict(block_n=16, block_w=2, swap=True, k_slices=4)),
                (2, 9, 64, f32, dict(block_n=16, block_w=4, k_slices=5))])),
        "nvfp4_dot_f16": run(check_nvfp4, NVFP4_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_dot(
            x, p, s, g, b, block_n=32, block_w=4), device=cpu, dtype=f16, bias=False),
        "nvfp4_dot_swap_f16": run(check_nvfp4, NVFP4_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_dot(
            x, p, s, g, b, block_n=16, block_w=4, swap=True), device=cpu, dtype=f16),
        "nvfp4_fma": run(check_nvfp4, NVFP4_FMA_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_fma(
            x, p, s, g, b, block_n=8, block_g=4), device=cpu, dtype=f32),
        "nvfp4_fma_f16": run(check_nvfp4, NVFP4_FMA_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_fma(
            x, p, s, g, b, block_n=16, block_g=2), device=cpu, dtype=f16, bias=False),
        # the persistent kernel: a grid of 3 (2) programs over 1-17 (3-65) row tiles in all, with and
        # without the next tile's loads in flight (past N on the last tile)
        "nvfp4_fma_persistent": run(check_nvfp4, NVFP4_FMA_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_fma(
            x, p, s, g, b, block_n=8, block_g=None, pipeline=True, programs=3), device=cpu, dtype=f32),
        "nvfp4_fma_persistent_f16": run(check_nvfp4, NVFP4_FMA_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_fma(
            x, p, s, g, b, block_n=2, block_g=None, programs=2), device=cpu, dtype=f16, bias=False),
        "nvfp4_fma_persistent_x_range": lambda: max(check_nvfp4_x_range(
            lambda x, p, s, g: nvfp4_skinny_linear_fma(x, p, s, g, block_n=4, block_g=None, pipeline=True, programs=5),
            cpu, f32, 24, 160, lo, hi) for lo, hi in ((-7, -7), (6, 6), (-8, 8), (36, 36))),
        # K in 2-4 slices, a program a slice, the float32 sums added by a second launch: slices of
        # 12 / 2 / 5 / 1 groups (the last ones partial; (1, 33, 16)'s second slice holds no group)
        "nvfp4_fma_persistent_slices": lambda: max(
            check_nvfp4(impl=lambda x, p, s, g, b, kw=kw: nvfp4_skinny_linear_fma(x, p, s, g, b, block_g=None, **kw),
                        device=cpu, dtype=f32, M=1, N=n, K=k, seed=i)
            for i, (n, k, kw) in enumerate([(130, 544, dict(block_n=4, k_slices=3, programs=6, pipeline=True)),
                                            (70, 48, dict(block_n=8, k_slices=2, programs=4)),
                                            (5, 272, dict(block_n=2, k_slices=4, programs=9, pipeline=True)),
                                            (33, 16, dict(block_n=8, k_slices=2, programs=2))])),
        # the one-row dispatch at each kind of _fma_config: persistent in one slice (K 64, 8192) and in
        # slices (8208: 2 slices, the second of one group)
        "nvfp4_dispatch_one_row": run(check_nvfp4, [(1, 40, 64), (1, 9, 8192), (1, 9, 8208)], impl=nvfp4_skinny_linear,
                                      device=cpu, dtype=f32),
        # the multi-row dispatch: the rows kernel (2 rows; 3-4 at N <= 2048), else the dot kernel
        # with the weight on the MMA's M side and K in slices (N 40 at 6 rows: 8 asked, 4 whole
        # tiles; N 2100: 4 asked, 2 tiles; above 32 rows)
        "nvfp4_dispatch_rows": run(check_nvfp4, [(2, 40, 64), (4, 40, 64), (6, 40, 512), (3, 2100, 256), (40, 24, 32)],
                                   impl=nvfp4_skinny_linear, device=cpu, dtype=f32),
        "nvfp4_rows": run(check_nvfp4, NVFP4_ROWS_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_rows(
            x, p, s, g, b, block_n=8, block_g=4), device=cpu, dtype=f32),
        "nvfp4_rows_f16": run(check_nvfp4, NVFP4_ROWS_SHAPES[1:3], impl=lambda x, p, s, g, b: nvfp4_skinny_linear_rows(
            x, p, s, g, b, block_n=4, block_g=2), device=cpu, dtype=f16, bias=False),
        "nvfp4_fma_x_range": lambda: max(check_nvfp4_x_range(
            lambda x, p, s, g: nvfp4_skinny_linear_fma(x, p, s, g, block_n=8, block_g=4), cpu, f32, 24, 160, lo, hi)
            for lo, hi in ((-7, -7), (6, 6), (-8, 8), (36, 36))),
        # the rows kernel applies the global scale at the end (like the dot kernel): no 1e36 case
        "nvfp4_rows_x_range": lambda: max(check_nvfp4_x_range(
            lambda x, p, s, g: nvfp4_skinny_linear_rows(x, p, s, g, block_n=8, block_g=4), cpu, f32, 12, 96, lo, hi,
            M=3)
            for lo, hi in ((-8, 8), (20, 20))),
        "nvfp4_zero_rows": lambda: check_nvfp4_zero_rows(cpu),
        # relu² as the persistent one-row kernel loads x (one slice, and K in 3 slices), and the
        # dispatch: the one-row kernel, the relu² kernel first for more rows
        "nvfp4_persistent_relu2": lambda: max(
            check_nvfp4_relu2(lambda x, p, s, g, b, kw=kw, **k: nvfp4_skinny_linear_fma(
                x, p, s, g, b, block_g=None, programs=3, **kw, **k), cpu, dt, 1, n, kk, seed=i)
            for i, (dt, n, kk, kw) in enumerate([(f32, 33, 272, dict(block_n=4)), (f16, 20, 160, dict(block_n=2)),
                                                 (f32, 9, 96, dict(block_n=4, k_slices=3, pipeline=True)),
                                                 (torch.bfloat16, 33, 272, dict(block_n=4)),
                                                 (torch.bfloat16, 9, 96, dict(block_n=4, k_slices=3, pipeline=True))])),
        "nvfp4_dispatch_relu2": run(check_nvfp4_relu2, [(1, 40, 64), (3, 40, 64)], impl=nvfp4_skinny_linear,
                                    device=cpu, dtype=f16),
        "dot_zero_k": lambda: check_zero_k(cpu),
        "fp8_quantize_rows": lambda: check_quantize_rows(quantize_rows_fp8, cpu, block_k=256),
        "fp8_add_rmsnorm": lambda: check_add_rmsnorm_fp8(cpu, torch.bfloat16, 5, 96),
        "fp8_rmsnorm_no_residual": lambda: check_add_rmsnorm_fp8(cpu, f32, 3, 40, seed=1, residual=False),
        "fp8_quantize_rows_one_pass": lambda: check_quantize_rows(quantize_rows_fp8, cpu, block_k=2048),
        "fp8_quantize_rows_relu2": lambda: check_quantize_rows(quantize_rows_fp8, cpu, block_k=256, relu2=True),
        "fp8_quantize_rows_relu2_one_pass": lambda: check_quantize_rows(quantize_rows_fp8, cpu, block_k=2048,
                                                                        relu2=True),
        "fp8_experts_decode": lambda: check_fp8_experts(cpu, f32, 3, 6, 2, 40, 24, grouped=False),
        # one token: FP8 experts' down projection takes its own tile there (moe_tiles.gemv_tiles)
        "fp8_experts_decode_one": lambda: check_fp8_experts(cpu, f32, 1, 6, 3, 40, 600, grouped=False, seed=2),
        "fp8_experts_grouped": lambda: check_fp8_experts(cpu, f32, 11, 6, 3, 40, 24, grouped=True, seed=1),
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting"
    torch.set_num_threads(1)
    from triton_interpret import case_main
    cases = _cases()
    sys.exit(case_main(cases, sys.argv[1:], run=lambda case: f"result {case():.3g}"))
