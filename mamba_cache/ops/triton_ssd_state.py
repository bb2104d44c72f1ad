"""Step 2 of the chunked SSD scan (``triton_ssd``): the state each chunk produces from zero,

    S[c, h] = sum_k (x[k, h, :] w[k, h])^T B[k, g(h), :],   w[k, h] = exp(cum_last - cum_k) dt_k

stored float32 in S [NC, H, P, N]; float32 accumulation, 16-bit dot operands under ``lowp``.
``_chunk_state_kernel``: one program per (chunk, head, P block), K steps of ``block_k`` tokens.

Defaults (``_STATE_DEFAULTS``), from the H100 sweep of 2026-11-22 (``benchmarks/vs_mamba_ssm.py
--state-variants --profile``; T=8192, Nemotron-H-8B shape, bf16): 32-token K steps under lowp,
165 us per call against 193 us with 64-token steps and mamba-ssm's 176 us. Programs taking 2 or
4 heads of a group (one B tile shared along the dot's M dimension, or a loop over the heads with
the whole chunk's B tile) lost in every configuration tried (201-1104 us) and were removed.
float32 dot operands keep the earlier 64-token steps.
"""
from __future__ import annotations

import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, next_pow2


@triton.jit
def chunk_state_tile(x_ptr, B_ptr, dtc_ptr, cuma_ptr, lrow, cstart, clen, h, g, offs_p, offs_n, mp, mn,
                     sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
                     PREC: tl.constexpr, LOWP: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """S_c [BLOCK_P, BLOCK_N] float32 of one (chunk, head, P block): the chunk's clen tokens from
    packed token cstart in K steps of BLOCK_K; lrow = (c * H + h) * BLOCK_L indexes dtc / cuma.
    Shared by ``_chunk_state_kernel`` and the fused pass (``triton_ssd_fused_pass``)."""
    cum_last = tl.load(cuma_ptr + lrow + clen - 1)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, clen, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < clen
        tok = cstart + offs_k
        xk = tl.load(x_ptr + tok[:, None] * sx_t + h * sx_h + offs_p[None, :] * sx_p,
                     mask=mk[:, None] & mp[None, :], other=0.0)                   # [K, P]
        bk = tl.load(B_ptr + tok[:, None] * sb_t + g * sb_g + offs_n[None, :] * sb_n,
                     mask=mk[:, None] & mn[None, :], other=0.0)                   # [K, N]
        dtk = tl.load(dtc_ptr + lrow + offs_k, mask=mk, other=0.0)
        cumk = tl.load(cuma_ptr + lrow + offs_k, mask=mk, other=0.0)
        wk = tl.where(mk, tl.exp(cum_last - cumk) * dtk, 0.0)
        xw = xk.to(tl.float32) * wk[:, None]
        if LOWP:       # 16-bit operands, float32 accumulation
            acc = tl.dot(tl.trans(xw.to(bk.dtype)), bk, acc)
        else:
            acc = tl.dot(tl.trans(xw), bk.to(tl.float32), acc, input_precision=PREC)
    return acc


@triton.jit
def _chunk_state_kernel(
    x_ptr, B_ptr, meta_ptr, dtc_ptr, cuma_ptr, S_ptr,
    H, P, N, nheads_per_group,
    sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
    PREC: tl.constexpr, LOWP: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    clen = tl.load(meta_ptr + c * 2 + 1)
    if clen > 0:
        cstart = tl.load(meta_ptr + c * 2).to(tl.int64)
        g = h // nheads_per_group
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mp = offs_p < P
        mn = offs_n < N
        row = (c * H + h).to(tl.int64) * BLOCK_L
        acc = chunk_state_tile(x_ptr, B_ptr, dtc_ptr, cuma_ptr, row, cstart, clen, h, g, offs_p, offs_n,
                               mp, mn, sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
                               PREC, LOWP, BLOCK_K, BLOCK_P, BLOCK_N)
        S_off = ((c * H + h).to(tl.int64) * P + offs_p[:, None]) * N + offs_n[None, :]
        tl.store(S_ptr + S_off, acc, mask=mp[:, None] & mn[None, :])


_STATE_DEFAULTS = dict(block_k=32, num_warps=4, num_stages=None, block_p=64)   # lowp
_STATE_DEFAULTS_F32 = dict(_STATE_DEFAULTS, block_k=64)


def launch_chunk_state(x, B, meta, dtc, cuma, S, NC, prec, lowp, BLOCK_L, BLOCK_N,
                       block_k=None, num_warps=None, num_stages=None, block_p=None):
    """Step 2 into S [NC, H, P, N] (float32).  Options (None: ``_STATE_DEFAULTS`` under lowp,
    else ``_STATE_DEFAULTS_F32``): block_k (tokens per K step), block_p (head_dim columns per
    program), num_warps / num_stages (launch options; stages None: Triton's default)."""
    H, P = x.shape[1:]
    G = B.shape[-2]
    d = _STATE_DEFAULTS if lowp else _STATE_DEFAULTS_F32
    BLOCK_P = max(16, next_pow2(P))
    BP = min(BLOCK_P, max(16, next_pow2(block_p or d["block_p"])))
    BK = min(BLOCK_L, max(16, next_pow2(block_k or d["block_k"])))
    launch = dict(num_warps=num_warps or d["num_warps"])
    stages = num_stages or d["num_stages"]
    if stages:
        launch["num_stages"] = stages
    _chunk_state_kernel[(NC, H, cdiv(P, BP))](
        x, B, meta, dtc, cuma, S, H, P, B.shape[-1], H // G, *x.stride(), *B.stride(),
        PREC=prec, LOWP=lowp, BLOCK_L=BLOCK_L, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=BLOCK_N, **launch)
