"""Random cases for the kernel-vs-reference checks (imported by test_kernels.py, attention_cases.py (the
paged-attention cases), the interpreter subprocess of test_kernels_interpret.py and benchmarks/kernels.py;
not a test module itself). The projection checks are in linear_cases.py.

Every ``check_*`` builds fresh random inputs on ``device``, poisons the pool (NaN in unused slots
and in the null slot / null block), runs the torch ``_ref`` and ``impl`` (a function with the
reference's signature) on separate copies of the pool, and asserts:
- outputs agree on every position the contract defines, as max|a-e| / max|e| <= tol;
- NaN never passes (a NaN where the reference is finite fails);
- pools agree: same NaN positions (unused and null slots untouched), values equal (conv windows
  are copies: bit-exact) or within tol (SSM states).
It returns a dict of the measured errors.
"""
from __future__ import annotations

import math
import sys

import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops import (causal_conv1d_update_ref, causal_conv1d_varlen_ref, gated_rmsnorm_ref,
                             selective_state_update_gated_ref, selective_state_update_ref,
                             ssd_scan_varlen_ref)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# max|a - e| / max|e| allowed, by op and model dtype
TOL = {
    "conv": {F32: 1e-5, BF16: 1e-2, F16: 2e-3},
    "ssu": {F32: 1e-4, BF16: 1e-4, F16: 1e-4},          # float32 math and outputs throughout
    "ssd": {F32: 1e-4, BF16: 1e-2, F16: 1e-2},          # TF32 dots for 16-bit models
    "norm": {F32: 1e-5, BF16: 1e-2, F16: 2e-3},
    "attn": {F32: 1e-4, BF16: 1e-2, F16: 4e-3},
    # FP8 caches: codes across the e4m3 range times k_scale 2.5 make scores of several hundred, where
    # one float32 ulp is ~3e-5; the kernel (K scale folded in after the dot) and the reference (K
    # dequantized first) round them differently: 1.2-5.1e-4 in float32 on the H200, 2026-11-26
    "attn_fp8": {F32: 1e-3, BF16: 1e-2, F16: 4e-3},
}


_ULP = {BF16: 2 ** -7, F16: 2 ** -10}     # relative spacing of 16-bit floats near 1


def rel_err(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> float:
    """max|a-e| / max|e| over positions where e is finite; NaN/inf in a there -> inf."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = actual.double(), expected.double()
    fin = torch.isfinite(e)
    if not bool(fin.any()):
        return 0.0
    a, e = a[fin], e[fin]
    if not bool(torch.isfinite(a).all()):
        return math.inf
    scale = max(float(e.abs().max()), 1e-6)
    return float((a - e).abs().max()) / scale


def assert_close(actual, expected, tol, what):
    err = rel_err(actual, expected, what)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}"
    return err


def assert_pool(actual, expected, tol, what):
    """Same NaN positions; values bit-equal (tol None) or within tol."""
    na, ne = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(na, ne), f"{what}: NaN pattern differs ({int((na != ne).sum())} places)"
    if tol is None:
        assert torch.equal(actual.nan_to_num(0.0), expected.nan_to_num(0.0)), \
            f"{what}: not bit-equal"
        return 0.0
    return assert_close(actual.nan_to_num(0.0), expected.nan_to_num(0.0), tol, what)


def poison_allocator(device):
    """Fill recently freed CUDA-caching-allocator blocks with NaN so that torch.empty outputs of
    the kernels start as NaN (best effort: an unwritten element then shows up as NaN)."""
    if torch.device(device).type != "cuda":
        return
    bufs = [torch.full((n,), math.nan, device=device) for n in (1 << 16, 1 << 18, 1 << 20, 1 << 24)]
    del bufs


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _qsl(lens, dtype=torch.int32):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def _slots(num_rows, num_slots, gen, null_rows=()):
    """Distinct slots in 1..num_slots-1 per row; rows in null_rows get NULL_SLOT."""
    s = torch.randperm(num_slots - 1, generator=gen)[:num_rows] + 1
    for r in null_rows:
        if r < num_rows:
            s[r] = NULL_SLOT
    return s.to(torch.int32)


def _conv_pool(S, C, ncols, dtype, token_major):
    """NaN conv pool [S, C, ncols]: channel-major storage, or token-major storage [S, ncols, C]
    seen through a transposed view (MambaPool's layout)."""
    if token_major:
        return torch.full((S, ncols, C), math.nan).to(dtype).transpose(1, 2)
    return torch.full((S, C, ncols), math.nan).to(dtype)


def _clone_like(t):
    """A copy with the same strides (clone() of a transposed view keeps them too; be explicit)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


# ----------------------------------------------------------------------------- conv varlen

def check_conv_varlen(impl, device, dtype, lens, C, W=4, K=0, bias=True, seed=0, pad=3,
                      tol=None, token_major=True, x_row_extra=0):
    """x_row_extra > 0: x is a column slice of wider rows (as the in_proj output's xBC part)."""
    g = _gen(seed)
    Bn, T = len(lens), sum(lens)
    S = Bn + 3
    null_rows = (1,) if Bn > 1 else ()
    x = torch.randn(T + pad, C + x_row_extra, generator=g).to(dtype)
    w = (torch.randn(C, W, generator=g) * 0.5).to(dtype)
    b = torch.randn(C, generator=g).to(dtype) if bias else None
    slots = _slots(Bn, S, g, null_rows)
    pool = _conv_pool(S, C, W - 1 + K, dtype, token_major)
    live = slots[slots != NULL_SLOT].long()
    pool[live] = torch.randn(len(live), C, W - 1 + K, generator=g).to(dtype)
    has_init = torch.rand(Bn, generator=g) < 0.5
    has_init[0] = True
    qsl = _qsl(lens, torch.int64 if seed % 2 else torch.int32)
    tok_ok = torch.zeros(T + pad, dtype=torch.bool)              # tokens whose output is defined
    for r in range(Bn):
        if int(slots[r]) != NULL_SLOT:
            tok_ok[int(qsl[r]):int(qsl[r + 1])] = True
    d = lambda t: t.to(device) if t is not None else None        # noqa: E731
    x, w, b, pool, slots, has_init, qsl = map(d, (x, w, b, pool, slots, has_init, qsl))
    x = x[:, x_row_extra // 2:x_row_extra // 2 + C]
    p_ref, p_k = _clone_like(pool), _clone_like(pool)
    out_ref = causal_conv1d_varlen_ref(x, w, b, p_ref, qsl, slots, has_init)
    poison_allocator(device)
    out = impl(x, w, b, p_k, qsl, slots, has_init)
    assert out.dtype == dtype and out.shape == (T + pad, C)
    tol = tol or TOL["conv"][dtype]
    ok = tok_ok.to(device)
    return {"out": assert_close(out[ok], out_ref[ok], tol, "conv_varlen out"),
            "state": assert_pool(p_k, p_ref, None, "conv_varlen state")}


# ----------------------------------------------------------------------------- conv update

def check_conv_update(impl, device, dtype, N, s, C, W=4, K=3, bias=True, seed=0, tol=None,
                      token_major=True, tap_major_weight=False):
    """tap_major_weight: the weight is a [C, W] view of [W, C] storage (strides (1, C))."""
    g = _gen(seed)
    S = N + 3
    null_rows = tuple(r for r in (1, N - 2) if 0 <= r < N and N > 2)
    x = torch.randn(N, s, C, generator=g).to(dtype)
    w = (torch.randn(C, W, generator=g) * 0.5).to(dtype)
    if tap_major_weight:
        w = w.t().contiguous().t()
    b = torch.randn(C, generator=g).to(dtype) if bias else None
    slots = _slots(N, S, g, null_rows)
    pool = _conv_pool(S, C, W - 1 + K, dtype, token_major)
    live = slots[slots != NULL_SLOT].long()
    pool[live] = torch.randn(len(live), C, W - 1 + K, generator=g).to(dtype)
    acc = torch.randint(1, K + 2, (N,), generator=g, dtype=torch.int32)   # a_prev in 1..K+1
    rows_ok = (slots != NULL_SLOT)
    d = lambda t: t.to(device) if t is not None else None        # noqa: E731
    x, w, b, pool, slots, acc = map(d, (x, w, b, pool, slots, acc))
    assert not tap_major_weight or (W == 1 or w.stride(0) == 1), w.stride()
    p_ref, p_k = _clone_like(pool), _clone_like(pool)
    out_ref = causal_conv1d_update_ref(x, w, b, p_ref, slots, acc)
    poison_allocator(device)
    out = impl(x, w, b, p_k, slots, acc)
    assert out.dtype == dtype and out.shape == (N, s, C)
    tol = tol or TOL["conv"][dtype]
    ok = rows_ok.to(device)
    return {"out": assert_close(out[ok], out_ref[ok], tol, "conv_update out"),
            "state": assert_pool(p_k, p_ref, None, "conv_update state")}


# ----------------------------------------------------------------------------- ssd

def ssm_params(H, gen, small_dt=False):
    dt_bias = torch.randn(H, generator=gen) * 0.5 - (4.0 if small_dt else 1.0)
    A = -torch.exp(torch.rand(H, generator=gen) * 2 - 1)
    D = torch.randn(H, generator=gen)
    return dt_bias, A, D


def check_ssd(impl, device, dtype, lens, H=4, G=2, P=16, N=16, chunk_size=16,
              dt_limit=(0.0, math.inf), seed=0, pad=2, tol=None, qsl_on_device=True,
              out_dtype=F32):
    g = _gen(seed)
    Bn, T = len(lens), sum(lens)
    x = torch.randn(T + pad, H, P, generator=g).to(dtype)
    dt = (torch.randn(T + pad, H, generator=g) * 0.5).to(dtype)
    B = torch.randn(T + pad, G, N, generator=g).to(dtype)
    C = torch.randn(T + pad, G, N, generator=g).to(dtype)
    dt_bias, A, D = ssm_params(H, g)
    init = torch.randn(Bn, H, P, N, generator=g)
    qsl = _qsl(lens, torch.int64 if seed % 2 else torch.int32)
    d = lambda t: t.to(device)                                   # noqa: E731
    x, dt, B, C, dt_bias, A, D, init = map(d, (x, dt, B, C, dt_bias, A, D, init))
    qsl_d = d(qsl) if qsl_on_device else qsl
    y_ref, f_ref = ssd_scan_varlen_ref(x, dt, dt_bias, A, B, C, D, qsl_d, init, chunk_size,
                                       dt_limit, out_dtype=out_dtype)
    poison_allocator(device)
    init_k = init.clone()
    y, f = impl(x, dt, dt_bias, A, B, C, D, qsl_d, init_k, chunk_size, dt_limit,
                out_dtype=out_dtype)
    assert y.dtype == out_dtype and f.dtype == F32 and y.shape == (T + pad, H, P)
    assert torch.equal(init_k, init), "initial_states modified"
    tol = tol or TOL["ssd"][dtype] + _ULP.get(out_dtype, 0.0)
    return {"y": assert_close(y[:T], y_ref[:T], tol, "ssd y"),
            "final": assert_close(f, f_ref, tol, "ssd final")}


# ----------------------------------------------------------------------------- state update

def _ssu_case(g, device, dtype, N, s, K, H, G, P, Nst):
    """Random state-update inputs on ``device``: (x, dt, B, C, dt_bias, A, D, slots, pool, acc);
    two rows on the null slot (N > 2), the pool NaN everywhere no live slot owns."""
    S = N + 3
    null_rows = tuple(r for r in (1, N - 2) if 0 <= r < N and N > 2)
    x = torch.randn(N, s, H, P, generator=g).to(dtype)
    dt = (torch.randn(N, s, H, generator=g) * 0.5).to(dtype)
    B = torch.randn(N, s, G, Nst, generator=g).to(dtype)
    C = torch.randn(N, s, G, Nst, generator=g).to(dtype)
    dt_bias, A, D = ssm_params(H, g)
    slots = _slots(N, S, g, null_rows)
    pool = torch.full((S, 1 + K, H, P, Nst), math.nan)
    live = slots[slots != NULL_SLOT].long()
    pool[live] = torch.randn(len(live), 1 + K, H, P, Nst, generator=g)
    acc = torch.randint(1, K + 2, (N,), generator=g, dtype=torch.int32)
    return tuple(t.to(device) for t in (x, dt, B, C, dt_bias, A, D, slots, pool, acc))


def check_ssu(impl, device, dtype, N, s, K, H=4, G=2, P=16, Nst=16, dt_limit=(0.0, math.inf),
              seed=0, tol=None, out_dtype=F32):
    x, dt, B, C, dt_bias, A, D, slots, pool, acc = _ssu_case(_gen(seed), device, dtype, N, s, K, H, G,
                                                             P, Nst)
    rows_ok = slots != NULL_SLOT
    p_ref, p_k = pool.clone(), pool.clone()
    y_ref = selective_state_update_ref(p_ref, x, dt, dt_bias, A, B, C, D, slots, acc, dt_limit,
                                       out_dtype)
    poison_allocator(device)
    y = impl(p_k, x, dt, dt_bias, A, B, C, D, slots, acc, dt_limit, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (N, s, H, P)
    # a 16-bit y is one rounding of the float32 value: allow one unit in the last place
    tol = tol or TOL["ssu"][dtype] + _ULP.get(out_dtype, 0.0)
    ok = rows_ok.to(device)
    return {"y": assert_close(y[ok], y_ref[ok], tol, "ssu y"),
            "state": assert_pool(p_k, p_ref, tol, "ssu state")}


def check_ssu_load_ahead_bitwise(device, dtype, N, s, K, gated, H=4, G=2, P=16, Nst=16, seed=0,
                                 dt_limit=(0.0, math.inf), block_p=None):
    """The state update with next-token load-ahead (the rule's s > 1 path) against the plain loop,
    forced both ways on the same inputs: outputs and every checkpoint bit for bit the same."""
    from hybrid_engine.mamba_cache.ops import triton_state_update as tsu
    x, dt, B, C, dt_bias, A, D, slots, pool, acc = _ssu_case(_gen(seed), device, dtype, N, s, K, H, G,
                                                             P, Nst)
    z = torch.randn(N, s, H * P, generator=_gen(seed + 1)).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(H * P, generator=_gen(seed + 2))).to(dtype).to(device)
    results = []
    rule = tsu._load_ahead
    try:
        for forced in (False, True):
            asked = []
            tsu._load_ahead = lambda *_a, _f=forced: asked.append(_f) or _f
            p_k = pool.clone()
            poison_allocator(device)
            if gated:
                y = tsu.triton_selective_state_update_gated(p_k, x, dt, dt_bias, A, B, C, D, slots, acc,
                                                            z, w, P * (H // G), 1e-5, dt_limit, block_p=block_p)
            else:
                y = tsu.triton_selective_state_update(p_k, x, dt, dt_bias, A, B, C, D, slots, acc, dt_limit,
                                                      out_dtype=dtype, block_p=block_p)
            assert asked == [forced], f"the launch did not take the forced rule ({asked})"
            results.append((y, p_k))
    finally:
        tsu._load_ahead = rule
    ok = (slots != NULL_SLOT).to(device)
    (y0, p0), (y1, p1) = results
    assert torch.equal(y0[ok], y1[ok]), "load-ahead changed y"
    live = slots[slots != NULL_SLOT].long()
    assert torch.equal(p0[live], p1[live]), "load-ahead changed the checkpoints"
    return {"y": 0.0, "state": 0.0}


# ----------------------------------------------------------------------------- state update + norm

def ssu_norm_counters_zero():
    """True if every counter buffer of the fused kernel (current and kept-alive) is all zero."""
    mod = sys.modules.get("hybrid_engine.mamba_cache.ops.triton_state_update")      # never imports Triton
    bufs = [] if mod is None else list(mod._counters.values()) + mod._retired
    return all(not bool(b.any()) for b in bufs)


def check_ssu_norm(impl, device, dtype, N, s, K, H=4, G=2, P=16, Nst=16, norm_groups=None,
                   dt_limit=(0.0, math.inf), eps=1e-5, seed=0, tol=None, z_3d=False):
    """impl: selective_state_update_gated's signature; called twice, each on a fresh copy of the
    pool (the second launch relies on the counters the first left at zero)."""
    g = _gen(seed)
    I = H * P
    gs = I // (norm_groups or G)
    x, dt, B, C, dt_bias, A, D, slots, pool, acc = _ssu_case(g, device, dtype, N, s, K, H, G, P, Nst)
    zbig = torch.randn(N * s, I + 8, generator=g).to(dtype).to(device)   # z: a strided view of it
    w = (1 + 0.1 * torch.randn(I, generator=g)).to(dtype).to(device)
    ok = slots != NULL_SLOT
    z = zbig[:, 3:3 + I]                                         # [N*s, I], row stride I + 8
    if z_3d:
        z = z.unflatten(0, (N, s))                               # [N, s, I]
    p_ref = pool.clone()
    ref = selective_state_update_gated_ref(p_ref, x, dt, dt_bias, A, B, C, D, slots, acc, z, w, gs,
                                           eps, dt_limit)
    # Tolerance: the norm's own (same math on the same y) plus the state update's float32 error,
    # plus one unit in the last place of a 16-bit y: y is rounded to the model dtype before the
    # norm, and a float32 y within 1e-4 of the reference can round to the neighbouring value;
    # out_i is linear in y_i (a one-element change barely moves the group's rms), so that moves
    # out_i by at most one ulp of out_i <= _ULP * max|out|.
    tol = tol or TOL["norm"][dtype] + TOL["ssu"][dtype] + _ULP.get(dtype, 0.0)
    errs, outs = {}, []
    for k in range(2):
        p_k = pool.clone()
        poison_allocator(device)
        out = impl(p_k, x, dt, dt_bias, A, B, C, D, slots, acc, z, w, gs, eps, dt_limit)
        assert out.dtype == dtype and out.shape == (N, s, I), (out.dtype, out.shape)
        assert ssu_norm_counters_zero(), "counters not all zero after the call"
        assert bool(torch.isfinite(out[~ok]).all()), "null rows: output not finite"
        errs[f"out{k}"] = assert_close(out[ok], ref[ok], tol, f"ssu_norm out (call {k})")
        errs[f"state{k}"] = assert_pool(p_k, p_ref, TOL["ssu"][dtype], f"ssu_norm state (call {k})")
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "two identical calls differ (not deterministic)"
    return errs


# ----------------------------------------------------------------------------- gated norm

def check_norm(impl, device, dtype, T, I, group_size, eps=1e-5, seed=0, tol=None, mode="gate_then_norm"):
    """impl(y, z, w, group_size, eps[, mode=...]) against gated_rmsnorm_ref; the Falcon-H1 modes
    (norm_then_gate, gate_only) pass ``mode`` on."""
    g = _gen(seed)
    y = torch.randn(T, I, generator=g).to(dtype)
    zbig = torch.randn(T, I + 8, generator=g).to(dtype)
    z = zbig[:, 3:3 + I]                                        # a strided view, as in the model
    w = (1 + 0.1 * torch.randn(I, generator=g)).to(dtype)
    y, z, w = y.to(device), z.to(device), w.to(device)
    ref = gated_rmsnorm_ref(y, z, w, group_size, eps, mode)
    poison_allocator(device)
    out = impl(y, z, w, group_size, eps) if mode == "gate_then_norm" else impl(y, z, w, group_size, eps, mode=mode)
    assert out.dtype == dtype and out.shape == (T, I)
    return {"out": assert_close(out, ref, tol or TOL["norm"][dtype], "gated_rmsnorm")}


# ----------------------------------------------------------------------------- skinny linear
