"""Step 4 of the chunked SSD scan (``triton_ssd``), one head per program: ``_chunk_out_kernel``
(chunk, head, row block x P block), the chunk-output kernel for float32 models, for ``lowp=False``,
for one head per group and for ``heads_per_program=1``; C.B is recomputed per head (or read from
the ``cb_pre`` buffer). ``triton_ssd_heads._chunk_out_heads_kernel`` is the several-heads form.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_out_kernel(
    x_ptr, B_ptr, C_ptr, D_ptr, meta_ptr, dtc_ptr, cuma_ptr, hin_ptr, cb_ptr, y_ptr,
    H, P, N, G, nheads_per_group, n_pblocks,
    sx_t, sx_h, sx_p, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n, sy_t, sy_h, sy_p,
    PREC: tl.constexpr, LOWP: tl.constexpr, CB_PRE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    c = tl.program_id(0)               # grid (NC, H, row blocks * column blocks)
    mb = tl.program_id(2) // n_pblocks
    pb = tl.program_id(2) % n_pblocks
    h = tl.program_id(1)
    clen = tl.load(meta_ptr + c * 2 + 1)
    m0 = mb * BLOCK_M
    if m0 < clen:
        cstart = tl.load(meta_ptr + c * 2).to(tl.int64)
        g = h // nheads_per_group
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mm = offs_m < clen
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mp = offs_p < P
        mn = offs_n < N
        row = (c * H + h).to(tl.int64) * BLOCK_L
        tok_m = cstart + offs_m
        cm = tl.load(C_ptr + tok_m[:, None] * sc_t + g * sc_g + offs_n[None, :] * sc_n,
                     mask=mm[:, None] & mn[None, :], other=0.0)                       # [M, N]
        cum_m = tl.load(cuma_ptr + row + offs_m, mask=mm, other=0.0)
        # state entering the chunk
        hin = tl.load(hin_ptr + ((c * H + h).to(tl.int64) * P + offs_p[None, :]) * N
                      + offs_n[:, None], mask=mn[:, None] & mp[None, :], other=0.0)    # [N, P]
        if LOWP:
            acc = tl.dot(cm, hin.to(cm.dtype))                                          # [M, P]
        else:
            acc = tl.dot(cm.to(tl.float32), hin, input_precision=PREC)
        acc = acc * tl.exp(cum_m)[:, None]
        cb_row = cb_ptr + ((c * G + g).to(tl.int64) * BLOCK_L + offs_m[:, None]) * BLOCK_L
        for k0 in range(0, m0 + BLOCK_M, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < clen
            tok_k = cstart + offs_k
            if CB_PRE:
                cb = tl.load(cb_row + offs_k[None, :], mask=mm[:, None] & mk[None, :],
                             other=0.0).to(tl.float32)
            else:
                bk = tl.load(B_ptr + tok_k[None, :] * sb_t + g * sb_g + offs_n[:, None] * sb_n,
                             mask=mn[:, None] & mk[None, :], other=0.0)               # [N, K]
                if PREC != "tf32":
                    cb = tl.dot(cm.to(tl.float32), bk.to(tl.float32), input_precision=PREC)
                else:
                    cb = tl.dot(cm, bk)                                                # [M, K]
            cum_k = tl.load(cuma_ptr + row + offs_k, mask=mk, other=0.0)
            dt_k = tl.load(dtc_ptr + row + offs_k, mask=mk, other=0.0)
            causal = (offs_m[:, None] >= offs_k[None, :]) & mk[None, :]
            decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_k[None, :], -float("inf")))
            wgt = cb * decay * dt_k[None, :]
            xk = tl.load(x_ptr + tok_k[:, None] * sx_t + h * sx_h + offs_p[None, :] * sx_p,
                         mask=mk[:, None] & mp[None, :], other=0.0)                   # [K, P]
            if LOWP:
                acc = tl.dot(wgt.to(xk.dtype), xk, acc)
            else:
                acc = tl.dot(wgt, xk.to(tl.float32), acc, input_precision=PREC)
        xm = tl.load(x_ptr + tok_m[:, None] * sx_t + h * sx_h + offs_p[None, :] * sx_p,
                     mask=mm[:, None] & mp[None, :], other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + h).to(tl.float32) * xm
        tl.store(y_ptr + tok_m[:, None] * sy_t + h * sy_h + offs_p[None, :] * sy_p,
                 acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mp[None, :])
