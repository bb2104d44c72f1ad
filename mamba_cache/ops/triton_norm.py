"""Triton gated RMSNorm, grouped (CONTRACT item 5; the modes of gated_norm.py).

One program per (block of tokens, group): g = y * silu(z) in float32, g *= rsqrt(mean(g^2) + eps)
over the group's channels, cast to y.dtype, times weight (rounded as torch rounds weight * g).
MODE 1 (norm_then_gate): norm(y) * weight * silu(z) in float32, one cast; MODE 2 (gate_only):
y * silu(z), no norm (the weight is not read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, device_ctx, next_pow2, tl_helpers

_softplus, _silu = tl_helpers()


@triton.jit(do_not_specialize=["T"])
def _gated_rmsnorm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, T, gs, eps,
    sy_t, sy_c, sz_t, sz_c, so_t, so_c,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, LD_EV: tl.constexpr, ST_CM: tl.constexpr,
    MODE: tl.constexpr = 0,
):
    tb = tl.program_id(0)
    grp = tl.program_id(1)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = grp * gs + tl.arange(0, BLOCK_G)
    mt = offs_t < T
    mc = tl.arange(0, BLOCK_G) < gs
    m2 = mt[:, None] & mc[None, :]
    rows = offs_t[:, None].to(tl.int64)
    y = tl.load(y_ptr + rows * sy_t + offs_c[None, :] * sy_c, mask=m2, other=0.0,
                eviction_policy=LD_EV).to(tl.float32)
    z = tl.load(z_ptr + rows * sz_t + offs_c[None, :] * sz_c, mask=m2, other=0.0,
                eviction_policy=LD_EV).to(tl.float32)
    if MODE == 2:                       # gate only
        out = y * _silu(z)
    elif MODE == 1:                     # norm, weight, then gate; all float32
        ms = tl.sum(y * y, axis=1) / gs
        w = tl.load(w_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
        out = y * tl.rsqrt(ms + eps)[:, None] * w[None, :] * _silu(z)
    else:
        g = y * _silu(z)
        ms = tl.sum(g * g, axis=1) / gs
        g = g * tl.rsqrt(ms + eps)[:, None]
        g = g.to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
        out = g * w[None, :]
    tl.store(out_ptr + rows * so_t + offs_c[None, :] * so_c,
             out.to(out_ptr.dtype.element_ty), mask=m2, cache_modifier=ST_CM)


# From the H100 sweeps of 2026-11-22 (benchmarks/norm_sweep.py, intermediate 8192, group 1024,
# bf16): one token per program with 4 warps took 2.5-2.6 / 3.1 / 5.4 / 9.9 / 18.8 us at
# T = 64 / 128 / 256 / 512 / 1024 against 3.0 / 3.7-4.1 / 6.1-6.3 / 9.7 / 19.8 us for 4 tokens
# per program (the rule kept for longer inputs, 85-94% of the copy bandwidth at 2k-8k tokens).
_SMALL_T = 1024


_MODES = {"gate_then_norm": 0, "norm_then_gate": 1, "gate_only": 2}


def triton_gated_rmsnorm(y, z, weight, group_size, eps, *, block_t=None, num_warps=None,
                         streaming=False, mode: str = "gate_then_norm"):
    """Same arguments and results as ``gated_rmsnorm_ref``. block_t (tokens per program) and
    num_warps: launch options, None for the defaults below; streaming: y and z loads marked
    evict_first and the output stored with .cs (read once / written once)."""
    T, I = y.shape
    assert I % group_size == 0
    # torch's weight * g.to(y.dtype) rounds to the promoted dtype first; we round to y.dtype only,
    # which is the same number whenever weight.dtype == y.dtype (the model's case)
    out = torch.empty((T, I), dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    BLOCK_G = next_pow2(group_size)
    if T <= _SMALL_T:       # decode / verify sizes: one token per program, more programs in flight
        BLOCK_T, nw = 1, 4
    else:
        BLOCK_T = max(1, min(16, 4096 // BLOCK_G))
        nw = 4 if BLOCK_T * BLOCK_G <= 4096 else 8
    BLOCK_T, nw = block_t or BLOCK_T, num_warps or nw
    with device_ctx(y):
        _gated_rmsnorm_kernel[(cdiv(T, BLOCK_T), I // group_size)](
            y, z, weight if weight is not None else y, out, T, group_size, float(eps),
            *y.stride(), *z.stride(), *out.stride(),
            BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, LD_EV="evict_first" if streaming else "",
            ST_CM=".cs" if streaming else "", MODE=_MODES[mode], num_warps=nw,
        )
    return out
