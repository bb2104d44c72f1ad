"""Quantized-weight linear kernels against their exact torch twins, on random inputs: the checks.

``check_fp8`` / ``check_nvfp4`` build random quantized weights (ragged rows, odd widths, strided x
rows, bias or not), run a kernel with every float output allocation poisoned with NaN (an element
the kernel forgets stays NaN and fails), and compare with ``fp8_linear_ref`` / ``nvfp4_linear_ref``
(exact float32 dequantization); the others check relu² on load, x ranges, empty shapes, the
activation quantizer and the FP8 norm (FP8 experts: ``expert_checks.py``). Run on the CPU by ``quant_cases.py`` (the
interpreter cases) and on CUDA by tests/gpu/test_quant_cuda.py and test_nvfp4_kernels_cuda.py.
"""
from __future__ import annotations

import math

import torch

from poisoned import nan_filled
from hybrid_engine.quantization.fp8 import fp8_linear_ref, quantize_fp8
from hybrid_engine.quantization.nvfp4 import nvfp4_linear_ref, quantize_nvfp4


def poisoned_empty():
    """``torch.empty`` returns NaN-filled float tensors inside the block (float8_e4m3fn: its NaN
    byte 0x7F)."""
    return nan_filled("empty")


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


def check_fp8_rows_invariant(impl, device, M, N, K, per_channel, relu2=False, seed=0):
    """float32 impl(x, w_q, s, b[, relu2=True]) on M rows: close to the float32 twin, and each row
    equal, bit for bit, to the same row computed alone and within every shorter prefix of the rows
    (a verify step's rows against a one-token step's)."""
    from hybrid_engine.models.activation import relu2_ref
    x, w, b = _inputs(M, N, K, torch.float32, True, seed, device)
    w_q, s = quantize_fp8(w, per_channel)
    w_q, s = w_q.to(device), s.to(device)
    kw = dict(relu2=True) if relu2 else {}
    with poisoned_empty():
        full = impl(x, w_q, s, b, **kw)
    assert full.shape == (M, N) and full.dtype == torch.float32 and not torch.isnan(full).any()
    ref = fp8_linear_ref(relu2_ref(x) if relu2 else x, w_q, s, b)
    err = _rel(full.cpu(), ref.cpu())
    assert err <= 1e-5, f"fp8 rows M={M} N={N} K={K}: rel err {err:.2e}"
    for m in range(1, M):
        assert torch.equal(impl(x[:m], w_q, s, b, **kw), full[:m]), f"rows 0..{m - 1} alone differ from within {M}"
    for r in range(M):
        assert torch.equal(impl(x[r:r + 1], w_q, s, b, **kw), full[r:r + 1]), f"row {r} alone differs"
    return err


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
    ref = nvfp4_linear_ref(act.float().cpu(), packed.cpu(), bs.cpu(), gs.cpu(), None if b is None else b.float().cpu())
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


def check_quantize_rows_bounded(device, seed=0):
    """``quantize_rows_fp8(..., rows_in_use=n)``: the first n rows code for code the twin's, the
    rest untouched (their poisoned codes and scales stay NaN), for n = 0, some and all, one and two
    passes; bad arguments are a ValueError."""
    from hybrid_engine.quantization.fp8 import quantize_activations
    from hybrid_engine.quantization.fp8_quantizer import quantize_rows_fp8
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(9, 300, generator=g) * torch.logspace(-2, 2, 9)[:, None]).to(torch.float16)
    ref_q, ref_s = quantize_activations(x, None)
    for n in (0, 4, 9):
        for block_k in (256, 1024):
            with poisoned_empty():
                q, sc = quantize_rows_fp8(x.to(device), block_k=block_k,
                                          rows_in_use=torch.tensor([n], dtype=torch.int32, device=device))
            q, sc = q.cpu(), sc.cpu()
            assert torch.equal(q[:n].view(torch.uint8), ref_q[:n].view(torch.uint8)), (n, block_k)
            assert torch.equal(sc[:n], ref_s[:n]), (n, block_k)
            assert q[n:].float().isnan().all() and sc[n:].isnan().all(), f"rows past {n} were written"
    for bad in (dict(rows_in_use=torch.tensor([1, 2], dtype=torch.int32)), dict(rows_in_use=torch.tensor([2])),
                dict(rows_in_use=torch.tensor([2], dtype=torch.int32), input_scale=torch.tensor(1.0))):
        try:
            quantize_rows_fp8(x.to(device), **{k: v.to(device) for k, v in bad.items()})
        except ValueError as e:
            assert "rows_in_use" in str(e), e
        else:
            raise AssertionError(f"no ValueError for {bad}")
    return 0.0


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


def check_fp8_every_code(impl, device, dtype, x_values):
    """impl(x [1, 1], w_q [254, 1], s [254], None) on a weight holding every finite float8_e4m3fn code
    (both signs, the subnormals and the largest, 448) times each x of ``x_values``: each output equals
    the code's value (torch's own e4m3 conversion) times x times its scale. x and the scales are
    powers of two chosen so that every product is exact in ``dtype`` (no rounding below its
    subnormals, no overflow), so any wrong code shows. Zero's sign is not checked (a sum of +0 and -0
    is +0)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~torch.isnan(codes.float())]                            # 0x7F and 0xFF are NaN
    w_q = codes.reshape(-1, 1).to(device)                                 # [254, 1]
    s = torch.tensor([2.0 ** (i % 5 - 2) for i in range(w_q.shape[0])], device=device)   # per channel
    for xv in x_values:
        x = torch.full((1, 1), xv, dtype=dtype, device=device)
        with poisoned_empty():
            y = impl(x, w_q, s, None)
        want = (codes.float().to(device) * s * xv).to(dtype)
        assert torch.equal(y[0], want), (f"fp8 every code, x={xv}: {int((y[0] != want).sum())} codes differ, "
                                         f"first at {int((y[0] != want).nonzero()[0])}")
    return 0.0


def check_nvfp4_dequant_16bit(device, dtype, N, K, seed=0):
    """The prefill path's one-pass decode to 16 bits (``nvfp4_dequant``) equals its torch twin bit for
    bit: every byte value (random codes) under every finite e4m3 block scale (random scale bytes,
    NaN codes left out), since e2m1 * scale is exact in bfloat16, float16 and float32; outputs
    poisoned, N and K ragged against the kernel's tiles."""
    from hybrid_engine.quantization.nvfp4_dequant import dequantize_nvfp4_16bit_ref, dequantize_nvfp4_16bit_triton
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    codes = torch.randint(0, 256, (N, K // 16), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38                                  # e4m3's NaN codes -> 1.0
    bs = codes.view(torch.float8_e4m3fn)
    with poisoned_empty():
        y = dequantize_nvfp4_16bit_triton(packed.to(device), bs.to(device), dtype)
    ref = dequantize_nvfp4_16bit_ref(packed, bs, dtype)
    assert y.shape == (N, K) and y.dtype == dtype and torch.isfinite(y).all()
    assert torch.equal(y.cpu(), ref), f"nvfp4 dequant {dtype} N={N} K={K}: {int((y.cpu() != ref).sum())} values differ"
    return 0.0
