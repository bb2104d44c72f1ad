"""Triton causal depthwise conv1d over packed varlen prefill (CONTRACT 1).

Prefill: two launches.
  1. ``_conv_varlen_kernel`` over (token block, channel block): a block inside one sequence, past
     its first W-1 tokens (nearly every block of a long prompt), sums its W taps of x with
     vectorised loads and no per-token work; otherwise each token finds its sequence by a binary
     search in query_start_loc, then sums its W taps; taps before the sequence start read the
     sequence's initial window (conv_state[slot, :, :W-1]) or zeros.
  2. ``_conv_varlen_state_kernel`` over (sequence, channel block): writes the new window (the last
     W-1 inputs, reaching into the old window for sequences shorter than W-1), after loading it
     whole.  It runs after launch 1 (same stream), so launch 1 always sees the old windows.
The decode/verify update lives in ``triton_conv_update.py``.
NULL_SLOT rows: prefill output is computed as the reference does, state untouched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops.triton_common import cdiv, device_ctx, next_pow2, search_iters, tl_helpers

_softplus, _silu = tl_helpers()


@triton.jit
def _seq_of(qsl_ptr, nseq, t, valid, SEARCH_ITERS: tl.constexpr):
    """The sequence of token t (a scalar or a vector of tokens): the smallest b with
    qsl[b + 1] > t, by a binary search of SEARCH_ITERS steps, clamped to nseq - 1 (tokens past the
    packed end; ``valid`` False: no loads for that token)."""
    lo = t * 0
    hi = lo + nseq
    for _ in tl.static_range(SEARCH_ITERS):
        act = lo < hi
        mid = (lo + hi) // 2
        gt = tl.load(qsl_ptr + mid + 1, mask=act & valid, other=0) > t
        hi = tl.where(act & gt, mid, hi)
        lo = tl.where(act & (~gt), mid + 1, lo)
    return tl.minimum(lo, nseq - 1)


@triton.jit(do_not_specialize=["T", "nseq"],
            do_not_specialize_on_alignment=["qsl_ptr", "slot_ptr", "init_ptr"])
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr, out_ptr,
    T, Cdim, nseq,
    sx_t, sx_c, sw_c, sw_w, ss_s, ss_c, ss_k, so_t, so_c,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SEARCH_ITERS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, OFFS_I32: tl.constexpr = False,
):
    tb = tl.program_id(0)
    cb = tl.program_id(1)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offs_c < Cdim
    if OFFS_I32:        # every element offset of x and out fits int32 (checked by the launcher)
        x_off = (offs_t - (W - 1))[:, None] * sx_t + offs_c[None, :] * sx_c
        o_off = offs_t[:, None] * so_t + offs_c[None, :] * so_c
    else:
        x_off = (offs_t - (W - 1))[:, None].to(tl.int64) * sx_t + offs_c[None, :] * sx_c
        o_off = offs_t[:, None].to(tl.int64) * so_t + offs_c[None, :] * so_c

    # The sequence of the block's first token t0 (a scalar binary search): if the whole block lies
    # in it at positions >= W - 1 (every block but those holding a sequence's first W - 1 tokens
    # or running past its end), no tap reaches before a sequence's start and the block reads x
    # alone, without a search per token, the initial window's gathered addresses and the token
    # masks, which made the kernel bound by instructions (H100, 8192 tokens x 10240 channels: 26%
    # of the copy bandwidth). The same values are summed in the same order as the general branch's.
    t0 = tb * BLOCK_T
    seq0 = _seq_of(qsl_ptr, nseq, t0, True, SEARCH_ITERS)
    if (t0 - tl.load(qsl_ptr + seq0) >= W - 1) & (t0 + BLOCK_T <= tl.load(qsl_ptr + seq0 + 1)):
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
        for w in tl.static_range(W):
            xv = tl.load(x_ptr + x_off + w * sx_t, mask=mc[None, :], other=0.0)
            wt = tl.load(w_ptr + offs_c * sw_c + w * sw_w, mask=mc, other=0.0).to(tl.float32)
            acc += xv.to(state_ptr.dtype.element_ty).to(tl.float32) * wt[None, :]
        tl.store(out_ptr + o_off, _silu(acc).to(out_ptr.dtype.element_ty), mask=mc[None, :])
    else:
        end = tl.load(qsl_ptr + nseq)
        mt = (offs_t < T) & (offs_t < end)
        seq = _seq_of(qsl_ptr, nseq, offs_t, mt, SEARCH_ITERS)
        start = tl.load(qsl_ptr + seq, mask=mt, other=0)
        pos = offs_t - start
        slot = tl.load(slot_ptr + seq, mask=mt, other=0).to(tl.int64)
        has_init = tl.load(init_ptr + seq, mask=mt, other=0) != 0

        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
        m2 = mt[:, None] & mc[None, :]
        for w in tl.static_range(W):
            q = pos - (W - 1) + w                                       # source position [BLOCK_T]
            from_x = q >= 0
            xv = tl.load(x_ptr + x_off + w * sx_t, mask=m2 & from_x[:, None], other=0.0)
            wcol = tl.maximum(q + (W - 1), 0)
            sv = tl.load(state_ptr + slot[:, None] * ss_s + offs_c[None, :] * ss_c
                         + wcol[:, None] * ss_k,
                         mask=m2 & ((~from_x) & has_init)[:, None], other=0.0)
            # the reference casts x to the state dtype before the taps
            v = tl.where(from_x[:, None], xv.to(state_ptr.dtype.element_ty), sv).to(tl.float32)
            wt = tl.load(w_ptr + offs_c * sw_c + w * sw_w, mask=mc, other=0.0).to(tl.float32)
            acc += v * wt[None, :]
        tl.store(out_ptr + o_off, _silu(acc).to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit(do_not_specialize_on_alignment=["qsl_ptr", "slot_ptr", "init_ptr"])
def _conv_varlen_state_kernel(
    x_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr,
    Cdim, sx_t, sx_c, ss_s, ss_c, ss_k,
    WM1: tl.constexpr, BLOCK_W: tl.constexpr, NULL: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    cb = tl.program_id(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot != NULL:
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        mc = offs_c < Cdim
        j = tl.arange(0, BLOCK_W)
        mj = j < WM1
        start = tl.load(qsl_ptr + b)
        L = tl.load(qsl_ptr + b + 1) - start
        has_init = (tl.zeros([BLOCK_W], dtype=tl.int32) + tl.load(init_ptr + b).to(tl.int32)) != 0
        p = L - WM1 + j                                                  # source position [BLOCK_W]
        from_x = p >= 0
        m2 = mj[:, None] & mc[None, :]
        xv = tl.load(x_ptr + (start + p)[:, None].to(tl.int64) * sx_t + offs_c[None, :] * sx_c,
                     mask=m2 & from_x[:, None], other=0.0)
        base = state_ptr + slot * ss_s + offs_c[None, :] * ss_c
        old = tl.load(base + tl.maximum(p + WM1, 0)[:, None] * ss_k,
                      mask=m2 & ((~from_x) & has_init)[:, None], other=0.0)
        new = tl.where(from_x[:, None], xv.to(state_ptr.dtype.element_ty), old)
        tl.debug_barrier()                           # every old column read before any store
        tl.store(base + j[:, None] * ss_k, new, mask=m2)


def _offsets_fit_int32(x, out, W) -> bool:
    """Whether every element offset the conv kernel forms for x and out (rows from -(W - 1) to a
    padded token block past the end) fits int32, so it can skip 64-bit address arithmetic."""
    rows = x.shape[0] + 1024 + W                     # token blocks round T up (BLOCK_T <= 1024)
    return all(rows * abs(t.stride(0)) + t.shape[1] * abs(t.stride(1)) < 2 ** 31 for t in (x, out))


def triton_causal_conv1d_varlen(x, weight, bias, conv_state, query_start_loc, state_indices,
                                has_initial_state, *, block_t=None, block_c=None, num_warps=None):
    """Same arguments and result as ``causal_conv1d_varlen_ref``."""
    T, Cdim = x.shape
    W = weight.shape[-1]
    Bn = state_indices.shape[0]
    out = torch.empty_like(x)
    if Bn == 0:
        return out
    qsl = query_start_loc
    if qsl.dtype not in (torch.int32, torch.int64):
        qsl = qsl.long()
    init = has_initial_state
    if init.dtype == torch.bool:
        init = init.view(torch.uint8) if init.is_contiguous() else init.to(torch.uint8)
    # 16 tokens x 256 channels, 4 warps: of 10 block shapes swept on the H100 (2026-11-27,
    # benchmarks/results/2026-11-27-conv-varlen-h100.md: 8B and Nano conv widths, 2048 and 8192
    # tokens) the fastest in three rows and 3.5% behind 64 x 128 in the fourth (8192 x 10240:
    # 219 us, 269 at 16 x 64)
    BLOCK_C = block_c or min(256, next_pow2(Cdim))
    BLOCK_T = block_t or 16
    bias_arg = bias if bias is not None else weight
    with device_ctx(x):
        if T > 0:       # no tokens: no output, but the windows below are still written (zeroed
            #             for rows without an initial state)
            _conv_varlen_kernel[(cdiv(T, BLOCK_T), cdiv(Cdim, BLOCK_C))](
                x, weight, bias_arg, conv_state, qsl, state_indices, init, out,
                T, Cdim, Bn, *x.stride(), *weight.stride(), *conv_state.stride(), *out.stride(),
                W=W, HAS_BIAS=bias is not None, SEARCH_ITERS=search_iters(Bn),
                BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, OFFS_I32=_offsets_fit_int32(x, out, W),
                num_warps=num_warps or 4,
            )
        if W > 1:
            BC = min(256, next_pow2(Cdim))
            _conv_varlen_state_kernel[(Bn, cdiv(Cdim, BC))](
                x, conv_state, qsl, state_indices, init,
                Cdim, *x.stride(), *conv_state.stride(),
                WM1=W - 1, BLOCK_W=next_pow2(W - 1), NULL=NULL_SLOT, BLOCK_C=BC, num_warps=4,
            )
    return out
