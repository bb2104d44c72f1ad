"""Step 4 of the chunked SSD scan (``triton_ssd``) for several heads of one group per program:
``_chunk_out_heads_kernel``, the chunk-output kernel that ``triton_ssd_scan_varlen`` runs by
default for bf16/fp16 models (16-bit dot operands, ``heads_per_program`` > 1).  The C rows and the
C.B tile of a (chunk, row block) are loaded / computed once per program and reused for its heads
instead of once per head as in ``triton_ssd_out._chunk_out_kernel``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _heads_intra(acc, cb, k0, cum_m, a_pos, row, x_h, clen, offs_p, mp, sx_t, sx_p, dtc_ptr,
                 cuma_ptr, PREC: tl.constexpr, LOWP: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += (C.B tile [M, K] x decay x dt) . x[k0:k0+K] for one head (the tile is causally
    masked already: zero above the diagonal and past the chunk's end)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mk = offs_k < clen
    cum_k = tl.load(cuma_ptr + row + offs_k, mask=mk, other=0.0)
    dt_k = tl.load(dtc_ptr + row + offs_k, mask=mk, other=0.0)
    # cum is monotone inside the chunk (non-increasing for A <= 0), so cum_i - cum_j has one sign
    # on the causal part and the other above it, where it is clamped to 0: exp(0) * 0 there
    # instead of inf * 0, and no [M, K] mask to keep live
    diff = cum_m[:, None] - cum_k[None, :]
    diff = tl.where(a_pos, tl.maximum(diff, 0.0), tl.minimum(diff, 0.0))
    wgt = cb.to(tl.float32) * tl.exp(diff) * dt_k[None, :]                             # [M, K]
    xk = tl.load(x_h + offs_k[:, None] * sx_t + offs_p[None, :] * sx_p,
                 mask=mk[:, None] & mp[None, :], other=0.0)                           # [K, P]
    if LOWP:
        acc = tl.dot(wgt.to(xk.dtype), xk, acc)
    else:
        acc = tl.dot(wgt, xk.to(tl.float32), acc, input_precision=PREC)
    return acc


@triton.jit
def _chunk_out_heads_kernel(
    x_ptr, B_ptr, C_ptr, D_ptr, A_ptr, meta_ptr, dtc_ptr, cuma_ptr, hin_ptr, cb_ptr, y_ptr,
    H, P, N, G, nheads_per_group, n_hblocks, n_pblocks,
    sx_t, sx_h, sx_p, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n, sy_t, sy_h, sy_p,
    PREC: tl.constexpr, LOWP: tl.constexpr, CB_PRE: tl.constexpr, CB_ROUND: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, N_MBLOCKS: tl.constexpr, HALVES: tl.constexpr,
):
    """Step 4 for up to BLOCK_H heads of one group (``heads_per_program``).

    Grid (NC * row blocks * column blocks, G * head blocks per group; the row / column blocks
    of a chunk are adjacent ids).  The C rows and the C.B tile [BLOCK_M, BLOCK_L] (all of the
    chunk's columns, in the model dtype with CB_ROUND) are loaded / computed once per program
    and kept in registers, causally masked; a loop over the heads then does, per head, C.h_in
    (one dot) and the decay / dt weighting of the C.B tile with its dot with x: with HALVES
    (chunks of 32 tokens and more) in two steps of half a chunk each (the tile split in two
    once; half the live temporaries, and the upper half is skipped when the row block ends
    before it), else in one step over the chunk.  Offsets inside a chunk are int32 (the wrapper
    checks the range)."""
    n_sub = N_MBLOCKS * n_pblocks
    c = tl.program_id(0) // n_sub
    sub = tl.program_id(0) % n_sub
    mb = sub // n_pblocks
    pb = sub % n_pblocks
    # head block: heads [h0, h1) of group g (blocks never straddle groups; the last may be short)
    g = tl.program_id(1) // n_hblocks
    h0 = g * nheads_per_group + (tl.program_id(1) % n_hblocks) * BLOCK_H
    h1 = tl.minimum(h0 + BLOCK_H, (g + 1) * nheads_per_group)
    clen = tl.load(meta_ptr + c * 2 + 1)
    m0 = mb * BLOCK_M
    if m0 < clen:
        cstart = tl.load(meta_ptr + c * 2).to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_j = tl.arange(0, BLOCK_L)
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mm = offs_m < clen
        mj = offs_j < clen
        mp = offs_p < P
        mn = offs_n < N
        # scalar (int64) chunk bases, int32 offsets inside the chunk
        x_c = x_ptr + cstart * sx_t
        y_c = y_ptr + cstart * sy_t
        off_xm = offs_m[:, None] * sx_t + offs_p[None, :] * sx_p                      # [M, P]
        off_ym = offs_m[:, None] * sy_t + offs_p[None, :] * sy_p
        off_h = offs_p[None, :] * N + offs_n[:, None]                                # [N, P]
        cm = tl.load(C_ptr + cstart * sc_t + g * sc_g + offs_m[:, None] * sc_t
                     + offs_n[None, :] * sc_n, mask=mm[:, None] & mn[None, :], other=0.0)  # [M, N]
        if CB_PRE:
            cb = tl.load(cb_ptr + ((c * G + g).to(tl.int64) * BLOCK_L + offs_m[:, None]) * BLOCK_L
                         + offs_j[None, :], mask=mm[:, None] & mj[None, :], other=0.0)  # [M, L]
        else:
            bt = tl.load(B_ptr + cstart * sb_t + g * sb_g + offs_j[None, :] * sb_t
                         + offs_n[:, None] * sb_n, mask=mn[:, None] & mj[None, :], other=0.0)
            if PREC != "tf32":
                cb = tl.dot(cm.to(tl.float32), bt.to(tl.float32), input_precision=PREC)
            else:
                cb = tl.dot(cm, bt)                                                    # [M, L]
            if CB_ROUND:
                cb = cb.to(x_ptr.dtype.element_ty)
        cb = tl.where((offs_m[:, None] >= offs_j[None, :]) & mj[None, :], cb, 0.0)
        if HALVES:      # columns [0, L/2) and [L/2, L)
            cb_lo, cb_hi = tl.split(tl.permute(tl.reshape(cb, (BLOCK_M, 2, BLOCK_L // 2)),
                                               (0, 2, 1)))
        for h in range(h0, h1):
            row = (c * H + h).to(tl.int64) * BLOCK_L
            a_pos = tl.load(A_ptr + h) > 0
            x_h = x_c + h * sx_h
            cum_m = tl.load(cuma_ptr + row + offs_m, mask=mm, other=0.0)
            hin = tl.load(hin_ptr + (c * H + h).to(tl.int64) * P * N + off_h,
                          mask=mn[:, None] & mp[None, :], other=0.0)                  # [N, P]
            if LOWP:
                acc = tl.dot(cm, hin.to(cm.dtype))                                      # [M, P]
            else:
                acc = tl.dot(cm.to(tl.float32), hin, input_precision=PREC)
            acc = acc * tl.exp(cum_m)[:, None]
            if HALVES:
                acc = _heads_intra(acc, cb_lo, 0, cum_m, a_pos, row, x_h, clen, offs_p, mp, sx_t,
                                   sx_p, dtc_ptr, cuma_ptr, PREC, LOWP, BLOCK_L // 2)
                if m0 + BLOCK_M > BLOCK_L // 2:     # rows reach the second half
                    acc = _heads_intra(acc, cb_hi, BLOCK_L // 2, cum_m, a_pos, row, x_h, clen,
                                       offs_p, mp, sx_t, sx_p, dtc_ptr, cuma_ptr, PREC, LOWP,
                                       BLOCK_L // 2)
            else:
                acc = _heads_intra(acc, cb, 0, cum_m, a_pos, row, x_h, clen, offs_p, mp, sx_t,
                                   sx_p, dtc_ptr, cuma_ptr, PREC, LOWP, BLOCK_L)
            xm = tl.load(x_h + off_xm, mask=mm[:, None] & mp[None, :], other=0.0).to(tl.float32)
            acc += tl.load(D_ptr + h).to(tl.float32) * xm
            tl.store(y_c + h * sy_h + off_ym, acc.to(y_ptr.dtype.element_ty),
                     mask=mm[:, None] & mp[None, :])
