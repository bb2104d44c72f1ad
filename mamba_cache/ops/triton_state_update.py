"""Triton multi-token selective state update (decode / speculative verify), CONTRACT item 4.

One program per (row, head, block of head_dim): the float32 state tile [BLOCK_P, N] lives in
registers.  It is loaded whole from checkpoint num_accepted-1 of the row's slot (then a barrier),
and for each of the s tokens: dt = clamp(softplus(dt_raw + dt_bias)), h = exp(dt A) h + dt x B^T,
store h to checkpoint t, y_t = h C_t + D x_t.  Rows on NULL_SLOT start from a zero state and store
nothing (their y is unspecified, but finite for finite inputs).  Any input strides.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mamba_cache import NULL_SLOT
from mamba_cache.ops.triton_common import device_ctx, next_pow2, tl_helpers

_softplus, _silu = tl_helpers()


@triton.jit
def _ssu_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, slot_ptr, acc_ptr, y_ptr,
    s, H, P, N, nheads_per_group, max_ckpt, dt_min, dt_max,
    st_s, st_k, st_h, st_p, st_n,
    sx_r, sx_t, sx_h, sx_p,
    sdt_r, sdt_t, sdt_h,
    sb_r, sb_t, sb_g, sb_n,
    sc_r, sc_t, sc_g, sc_n,
    sy_r, sy_t, sy_h, sy_p,
    NULL: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    pb = tl.program_id(2)
    grp = head // nheads_per_group

    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    m2 = mp[:, None] & mn[None, :]

    slot = tl.load(slot_ptr + row).to(tl.int64)
    # full-shape mask (a scalar & block mask trips the interpreter)
    mst = m2 & ((tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.int64) + slot) != NULL)
    src = tl.load(acc_ptr + row).to(tl.int64) - 1
    src = tl.minimum(tl.maximum(src, 0), max_ckpt)

    tile = offs_p[:, None] * st_p + offs_n[None, :] * st_n            # [BLOCK_P, BLOCK_N]
    base = state_ptr + slot * st_s + head * st_h
    h = tl.load(base + src * st_k + tile, mask=mst, other=0.0).to(tl.float32)
    # the whole source tile is in registers before any checkpoint of this tile is overwritten
    tl.debug_barrier()

    A = tl.load(A_ptr + head).to(tl.float32)
    Dh = tl.load(D_ptr + head).to(tl.float32)
    bias = tl.load(dt_bias_ptr + head).to(tl.float32)

    x_base = x_ptr + row * sx_r + head * sx_h + offs_p * sx_p
    dt_base = dt_ptr + row * sdt_r + head * sdt_h
    b_base = B_ptr + row * sb_r + grp * sb_g + offs_n * sb_n
    c_base = C_ptr + row * sc_r + grp * sc_g + offs_n * sc_n
    y_base = y_ptr + row * sy_r + head * sy_h + offs_p * sy_p
    for t in range(0, s):
        x = tl.load(x_base + t * sx_t, mask=mp, other=0.0).to(tl.float32)          # [BLOCK_P]
        Bv = tl.load(b_base + t * sb_t, mask=mn, other=0.0).to(tl.float32)         # [BLOCK_N]
        Cv = tl.load(c_base + t * sc_t, mask=mn, other=0.0).to(tl.float32)         # [BLOCK_N]
        dt = _softplus(tl.load(dt_base + t * sdt_t).to(tl.float32) + bias)
        if CLAMP:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        dA = tl.exp(dt * A)
        h = h * dA + (x * dt)[:, None] * Bv[None, :]
        tl.store(base + t * st_k + tile, h, mask=mst)
        y = tl.sum(h * Cv[None, :], axis=1) + Dh * x
        tl.store(y_base + t * sy_t, y.to(y_ptr.dtype.element_ty), mask=mp)


# (BLOCK_P, num_warps) per (head_dim, d_state); measured on an H100 (benchmarks/kernels.py)
def _config(P: int, N: int, rows_x_heads: int):
    BLOCK_N = max(16, next_pow2(N))
    BLOCK_P = min(next_pow2(P), max(1, 4096 // BLOCK_N))        # 32 for N=128
    BLOCK_P = max(BLOCK_P, 1)
    num_warps = 4
    return BLOCK_P, BLOCK_N, num_warps


def triton_selective_state_update(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                  num_accepted, dt_limit=(0.0, math.inf), *,
                                  out_dtype=torch.float32, block_p=None, num_warps=None):
    """Same arguments and result as ``selective_state_update_ref`` (y [N, s, H, P] out_dtype)."""
    nrows, s, H, P = x.shape
    G, Nst = B.shape[-2:]
    assert ssm_state.dtype == torch.float32
    assert 1 <= s <= ssm_state.shape[1], "need 1 <= s <= 1+K"
    assert ssm_state.shape[2:] == (H, P, Nst)
    y = torch.empty((nrows, s, H, P), dtype=out_dtype, device=x.device)
    if nrows == 0:
        return y
    BLOCK_P, BLOCK_N, nw = _config(P, Nst, nrows * H)
    if block_p is not None:
        BLOCK_P = block_p
    if num_warps is not None:
        nw = num_warps
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    clamp = lo > 0.0 or hi < math.inf
    grid = (nrows, H, triton.cdiv(P, BLOCK_P))
    with device_ctx(x):
        _ssu_kernel[grid](
            ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices, num_accepted, y,
            s, H, P, Nst, H // G, ssm_state.shape[1] - 1, lo if clamp else 0.0,
            hi if (clamp and hi < math.inf) else 3.0e38,
            *ssm_state.stride(), *x.stride(), *dt_raw.stride(), *B.stride(), *C.stride(),
            *y.stride(),
            NULL=NULL_SLOT, CLAMP=clamp, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=nw,
        )
    return y
