"""Triton sequential SSD scan: one program per (sequence, head, P block) walking the tokens with
the state in registers.  Same arguments and results as ``ssd_scan_varlen_ref``; kept for
comparison with the chunked kernels of ``triton_ssd`` and as a simple fallback.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, device_ctx, next_pow2, tl_helpers
from hybrid_engine.mamba_cache.ops.triton_ssd import _dt_args

_softplus, _silu = tl_helpers()


@triton.jit(do_not_specialize_on_alignment=["qsl_ptr"])
def _ssd_seq_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, qsl_ptr, init_ptr, y_ptr, final_ptr,
    P, N, nheads_per_group, dt_min, dt_max,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    si_b, si_h, si_p, si_n, sy_t, sy_h, sy_p, sf_b, sf_h, sf_p, sf_n,
    CLAMP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    g = h // nheads_per_group
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    m2 = mp[:, None] & mn[None, :]
    st = tl.load(init_ptr + b.to(tl.int64) * si_b + h * si_h + offs_p[:, None] * si_p
                 + offs_n[None, :] * si_n, mask=m2, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h).to(tl.float32)
    Dh = tl.load(D_ptr + h).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    t0 = tl.load(qsl_ptr + b).to(tl.int64)
    t1 = tl.load(qsl_ptr + b + 1).to(tl.int64)
    for tt in range(t0, t1):
        x = tl.load(x_ptr + tt * sx_t + h * sx_h + offs_p * sx_p, mask=mp, other=0.0).to(tl.float32)
        Bv = tl.load(B_ptr + tt * sb_t + g * sb_g + offs_n * sb_n, mask=mn,
                     other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + tt * sc_t + g * sc_g + offs_n * sc_n, mask=mn,
                     other=0.0).to(tl.float32)
        dt = _softplus(tl.load(dt_ptr + tt * sdt_t + h * sdt_h).to(tl.float32) + bias)
        if CLAMP:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        st = st * tl.exp(dt * A) + (x * dt)[:, None] * Bv[None, :]
        yv = tl.sum(st * Cv[None, :], axis=1) + Dh * x
        tl.store(y_ptr + tt * sy_t + h * sy_h + offs_p * sy_p, yv.to(y_ptr.dtype.element_ty),
                 mask=mp)
    tl.store(final_ptr + b.to(tl.int64) * sf_b + h * sf_h + offs_p[:, None] * sf_p
             + offs_n[None, :] * sf_n, st, mask=m2)


def triton_ssd_scan_sequential(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, initial_states,
                               chunk_size=None, dt_limit=(0.0, math.inf), *, max_seqlen=None,
                               out_dtype=torch.float32, block_p=16):
    """Sequential-recurrence kernel with the same arguments and results (chunk_size ignored)."""
    T, H, P = x.shape
    G, N = B.shape[-2:]
    Bn = query_start_loc.numel() - 1
    y = torch.empty((T, H, P), dtype=out_dtype, device=x.device)
    final = torch.empty((Bn, H, P, N), dtype=torch.float32, device=x.device)
    if Bn == 0:
        return y, final
    clamp, lo, hi = _dt_args(dt_limit)
    BLOCK_N = next_pow2(N)
    BLOCK_P = min(next_pow2(P), block_p)
    with device_ctx(x):
        _ssd_seq_kernel[(Bn, H, cdiv(P, BLOCK_P))](
            x, dt_raw, dt_bias, A, B, C, D, query_start_loc.to(x.device), initial_states, y, final,
            P, N, H // G, lo, hi,
            *x.stride(), *dt_raw.stride(), *B.stride(), *C.stride(), *initial_states.stride(),
            *y.stride(), *final.stride(),
            CLAMP=clamp, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=4,
        )
    return y, final
