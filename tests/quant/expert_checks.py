"""Quantized merged experts (the fused MoE) against their torch twins: FP8 weight-only (decode and
grouped paths) and W8A8 (rows quantized per token); NVFP4 weight-only (decode and grouped paths).
Run on the CPU by ``quant_cases.py`` (the interpreter cases) and on CUDA by
tests/gpu/test_quant_cuda.py and tests/gpu/test_nvfp4_kernels_cuda.py."""
from __future__ import annotations

import math

import torch

from hybrid_engine.quantization.fp8 import quantize_fp8
from hybrid_engine.quantization.nvfp4 import quantize_nvfp4
from quant_checks import _rel, poisoned_empty


def check_fp8_experts(device, dtype, T, E, k, D, F, grouped, seed=0, tol=None):
    """routed_experts_triton with FP8 merged experts (per-expert scales), weight-only (the decode
    path, and the grouped path with ``w8a8=False``), vs the reference with the weights dequantized
    exactly (float32 h: the same arithmetic up to summation order)."""
    from hybrid_engine.models.moe_ops import grouped_experts_ref, dequantize_experts
    from hybrid_engine.models.triton_moe import routed_experts_triton
    h, up_q, down_q, up_s, down_s, ids, wts = _fp8_expert_inputs(dtype, T, E, k, D, F, seed, spread=False)
    ref = grouped_experts_ref(h.float(), dequantize_experts(up_q, up_s, torch.float32),
                              dequantize_experts(down_q, down_s, torch.float32), ids, wts)
    dev = lambda t: t.to(device)   # noqa: E731
    with poisoned_empty():
        y = routed_experts_triton(dev(h), dev(up_q), dev(down_q), dev(ids), dev(wts), force_grouped=grouped,
                                  up_scale=dev(up_s), down_scale=dev(down_s), w8a8=False)
    assert y.shape == (T, D) and not torch.isnan(y).any()
    err = _rel(y.cpu(), ref)
    tol = tol or {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert err <= tol, f"fp8 experts T={T} grouped={grouped}: rel err {err:.2e} > {tol:.0e}"
    return err


def _fp8_expert_inputs(dtype, T, E, k, D, F, seed, swiglu=False, one_expert=False, spread=True):
    """Random rows and FP8 merged experts (per-expert scales, amax / 448), ids, weights.
    ``spread``: the rows' scales span 0.1..10 (each row's own FP8 scale then matters)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g)
    if spread:
        h = h * torch.logspace(-1, 1, T)[:, None]
    h = h.to(dtype)
    w_up = torch.randn(E, (2 if swiglu else 1) * F, D, generator=g) / math.sqrt(D) * torch.rand(E, 1, 1, generator=g).add(0.5)
    w_down = torch.randn(E, D, F, generator=g) / math.sqrt(F)
    qs = [quantize_fp8(w, False) for w in (*w_up, *w_down)]
    up_q, down_q = torch.stack([q for q, _ in qs[:E]]), torch.stack([q for q, _ in qs[E:]])
    up_s, down_s = torch.stack([s for _, s in qs[:E]]), torch.stack([s for _, s in qs[E:]])
    return h, up_q, down_q, up_s, down_s, _ids(g, T, E, k, one_expert), torch.rand(T, k, generator=g)


def check_fp8_experts_w8a8(device, dtype, T, E, k, D, F, seed=0, swiglu=False, one_expert=False, tol=None):
    """The W8A8 grouped path (rows quantized per token, FP8 dot) against its twin
    ``grouped_experts_w8a8_ref`` (same codes, float32 sums): ragged experts, experts with no token
    when E > T k, ``one_expert`` (every token on expert 0), SwiGLU. Under the interpreter (FP8 dots
    exact) the two agree to float32 summation order; on CUDA within 1e-2, a quarter of the 4e-2
    between the twin and the weight-only product (so a kernel that skipped the activations'
    quantization fails). That the compiled dots promote their partial sums is checked on the
    compiled kernel (tests/quant/test_quant_kernels.py), not by this tolerance."""
    from hybrid_engine.models.moe_ops import grouped_experts_w8a8_ref
    from hybrid_engine.models.triton_moe import routed_experts_triton
    act = "swiglu" if swiglu else "relu2"
    h, up_q, down_q, up_s, down_s, ids, wts = _fp8_expert_inputs(dtype, T, E, k, D, F, seed, swiglu, one_expert)
    twin = grouped_experts_w8a8_ref(h, up_q, down_q, up_s, down_s, ids, wts, act).float()
    dev = lambda t: t.to(device)   # noqa: E731
    with poisoned_empty():
        y = routed_experts_triton(dev(h), dev(up_q), dev(down_q), dev(ids), dev(wts), force_grouped=True,
                                  activation=act, up_scale=dev(up_s), down_scale=dev(down_s), w8a8=True)
    assert y.shape == (T, D) and y.dtype == dtype and torch.isfinite(y).all()
    err = _rel(y.cpu().float(), twin)
    # the interpreter's FP8 dots are exact (0 in every case here); a Hopper GPU's FP8 tensor cores
    # keep fewer bits than float32 within each 128 products (PROMOTE_K), and a 16-bit rounding of
    # the up projection that lands the other way moves that row's FP8 codes: 3.6e-3..5.8e-3 at Nano
    # widths (H200, 2026-11-29)
    tol = tol or (1e-6 if torch.device(device).type == "cpu" else 1e-2)
    assert err <= tol, f"w8a8 experts T={T} E={E} k={k}: rel err {err:.2e} against the twin > {tol:.0e}"
    return err


def _ids(g, T, E, k, one_expert):
    if one_expert:          # every token's first choice is expert 0; the rest spread over the others
        return torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(E - 1, generator=g)[:k - 1]])
                            for _ in range(T)]).to(torch.int32)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)


def nvfp4_expert_inputs(dtype, T, E, k, D, F, seed, swiglu=False, one_expert=False, device="cpu"):
    """Random rows, NVFP4 merged experts (each expert's projections quantized on their own, so
    every expert has its own global scale: the rows' scales span 0.5..1.5), ids and weights ->
    (h, (up, up_blocks, up_scale, down, down_blocks, down_scale), ids, weights). The weights are drawn
    on ``device`` (Nano-sized sets are ~1 G draws)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(T, D, generator=g, device=device).to(dtype)
    spread = torch.rand(E, 1, 1, generator=g, device=device).add(0.5)
    w_up = torch.randn(E, (2 if swiglu else 1) * F, D, generator=g, device=device) / math.sqrt(D) * spread
    w_down = torch.randn(E, D, F, generator=g, device=device) / math.sqrt(F)
    packed = []
    for w in (w_up, w_down):
        qs = [quantize_nvfp4(x) for x in w]
        packed += [torch.stack([q[i] for q in qs]) for i in range(3)]
    gi = torch.Generator().manual_seed(seed + 1)
    ids = _ids(gi, T, E, k, one_expert).to(device)
    return h, tuple(packed), ids, torch.rand(T, k, generator=gi).to(device)


def check_nvfp4_experts(device, dtype, T, E, k, D, F, path, seed=0, swiglu=False, one_expert=False, tol=None,
                        decode_tiles=None):
    """``routed_experts_nvfp4_triton`` on ``path`` (``gemv``: decode GEMVs, ``grouped``: the grouped GEMM) against
    the twin on the exactly dequantized weights in float32 (``nvfp4_experts_ref``), outputs
    poisoned: ragged experts, experts with no token when E > T k, ``one_expert``, SwiGLU.
    ``decode_tiles`` (BLOCK_N, BLOCK_G, warps): the decode kernel's tiles instead of the rule's
    (several K tiles at widths the interpreter runs quickly)."""
    from hybrid_engine.quantization import nvfp4_experts as nx
    act = "swiglu" if swiglu else "relu2"
    h, w, ids, wts = nvfp4_expert_inputs(dtype, T, E, k, D, F, seed, swiglu, one_expert, device=device)
    ref = nx.nvfp4_experts_ref(h.float(), *w, ids, wts, act).cpu()      # float32 on the device (full precision)
    rule = nx.DECODE_TILES
    try:
        nx.DECODE_TILES = decode_tiles or rule
        with poisoned_empty():
            y = nx.routed_experts_nvfp4_triton(h, *w, ids, wts, activation=act, path=path)
    finally:
        nx.DECODE_TILES = rule
    assert y.shape == (T, D) and y.dtype == dtype and torch.isfinite(y).all()
    err = _rel(y.cpu().float(), ref)
    # float32: the twin's arithmetic up to summation order (and tf32x3 dots on CUDA); 16 bits: the
    # up projection rounded to the rows' dtype before the activation, as the 16-bit experts do
    tol = tol or {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert err <= tol, f"nvfp4 experts T={T} E={E} k={k} {path} {act}: rel err {err:.2e} > {tol:.0e}"
    return err
