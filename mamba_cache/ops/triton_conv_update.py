"""Triton causal conv1d decode/verify update (CONTRACT 2).

Update: one launch of ``_conv_update_cols_kernel`` over (row block, channel block): each program
loads the W-1 window columns at offset num_accepted-1 and the s tokens of its rows as [BLOCK_C]
vectors (each column once, the weights once per program as one contiguous vector, no layout
conversions), computes the s outputs, barrier, then writes columns 0..W-3+s.  Its options (rows
per program, cache hints, load order, grid order, programmatic dependent launch) and the previous
kernel ``_conv_update_kernel`` (``variant="window"``: [tokens, channels] tiles per row) are timed
by ``benchmarks/kernels.py --sweep-conv``.
NULL_SLOT rows write zeros to their output and leave the state untouched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops.triton_common import cdiv, device_ctx, next_pow2, tl_helpers
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs

_softplus, _silu = tl_helpers()


@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "acc_ptr"])
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, slot_ptr, acc_ptr, out_ptr,
    s, Cdim, ncols,
    sx_r, sx_t, sx_c, sw_c, sw_w, ss_s, ss_c, ss_k, so_r, so_t, so_c,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, NULL: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_WIN: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program per (row, channel block).  Two tiles, each as tall as it needs to be (a tile
    padded to the taller one left most threads masked at s = 1): outputs [BLOCK_S >= s, C] and the
    new window [BLOCK_WIN >= W-2+s, C].  xs[j] = window column off+j for j < W-1, else token
    j-(W-1); every load of a window column is one contiguous row of channels in MambaPool's
    token-major layout."""
    row = tl.program_id(0)
    cb = tl.program_id(1)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offs_c < Cdim
    t = tl.arange(0, BLOCK_S)
    m2 = (t < s)[:, None] & mc[None, :]
    # slot and accepted count are independent loads: issued together, no branch on the slot
    # between them (the kernel is a few microseconds long, so each serial latency shows)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    off = tl.load(acc_ptr + row).to(tl.int32) - 1
    # full-shape masks (a scalar & block mask trips the interpreter)
    m2s = m2 & ((tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.int64) + slot) != NULL)
    sbase = state_ptr + slot * ss_s + offs_c[None, :] * ss_c
    xbase = x_ptr + row * sx_r + offs_c[None, :] * sx_c
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    for w in tl.static_range(W):
        j = t + w
        in_win = j < W - 1
        col = tl.minimum(tl.maximum(off + j, 0), ncols - 1)
        sv = tl.load(sbase + col[:, None] * ss_k, mask=m2s & in_win[:, None], other=0.0)
        xv = tl.load(xbase + (j - (W - 1))[:, None] * sx_t, mask=m2 & (~in_win)[:, None],
                     other=0.0)
        v = tl.where(in_win[:, None], sv, xv.to(state_ptr.dtype.element_ty)).to(tl.float32)
        wt = tl.load(w_ptr + offs_c * sw_c + w * sw_w, mask=mc, other=0.0).to(tl.float32)
        acc += v * wt[None, :]
    # new window: column i (0 <= i <= W-3+s) = xs[i+1]
    i = tl.arange(0, BLOCK_WIN)
    mi = (i < W - 2 + s)[:, None] & mc[None, :]
    mi = mi & ((tl.zeros([BLOCK_WIN, BLOCK_C], dtype=tl.int64) + slot) != NULL)
    j = i + 1
    in_win = j < W - 1
    col = tl.minimum(tl.maximum(off + j, 0), ncols - 1)
    sv = tl.load(sbase + col[:, None] * ss_k, mask=mi & in_win[:, None], other=0.0)
    xv = tl.load(xbase + (j - (W - 1))[:, None] * sx_t, mask=mi & (~in_win)[:, None], other=0.0)
    new = tl.where(in_win[:, None], sv, xv.to(state_ptr.dtype.element_ty))
    # null-slot rows: outputs are unspecified by the contract; write zeros (finite, no NaN)
    out = tl.where(m2s, _silu(acc), 0.0)
    tl.store(out_ptr + row * so_r + t[:, None] * so_t + offs_c[None, :] * so_c,
             out.to(out_ptr.dtype.element_ty), mask=m2)
    tl.debug_barrier()                               # the whole window is read before any store
    tl.store(sbase + i[:, None] * ss_k, new, mask=mi)


@triton.jit
def _cols_weights(w_ptr, bias_ptr, offs_c, mc, c0, Cdim, sw_c, sw_w, W: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, WFLAT: tl.constexpr,
                  KEEP_EV: tl.constexpr):
    """-> (tuple of W tap weights, bias): float32 [BLOCK_C] vectors, shared by the rows.
    WFLAT (weight [C, W] contiguous, W in 2, 4, 8): the BLOCK_C*W weights of the block are one
    contiguous run, loaded as one vector (each thread gets whole channels: 16 bytes for 2
    channels at W = 4) and taken apart with reshape + split, which keep every value in its
    thread; else one strided load per tap (2-byte loads for a [C, W] weight, vector loads for
    a tap-major one)."""
    wts = ()
    if WFLAT:
        e = tl.arange(0, BLOCK_C * W)
        wt = tl.load(w_ptr + c0 * W + e, mask=(c0 * W + e) < Cdim * W, other=0.0,
                     eviction_policy=KEEP_EV).to(tl.float32)
        if W == 2:
            w0, w1 = tl.split(tl.reshape(wt, [BLOCK_C, 2]))
            wts = (w0, w1)
        elif W == 4:
            a, b = tl.split(tl.reshape(wt, [BLOCK_C, 2, 2]))      # a[:, i] = tap 2i, b: 2i+1
            a0, a1 = tl.split(a)
            b0, b1 = tl.split(b)
            wts = (a0, b0, a1, b1)
        else:
            a, b = tl.split(tl.reshape(wt, [BLOCK_C, 4, 2]))      # a[:, i] = tap 2i, b: 2i+1
            aa, ab = tl.split(tl.reshape(a, [BLOCK_C, 2, 2]))     # aa[:, i] = tap 4i, ab: 4i+2
            ba, bb = tl.split(tl.reshape(b, [BLOCK_C, 2, 2]))     # ba: 4i+1, bb: 4i+3
            aa0, aa1 = tl.split(aa)
            ab0, ab1 = tl.split(ab)
            ba0, ba1 = tl.split(ba)
            bb0, bb1 = tl.split(bb)
            wts = (aa0, ba0, ab0, bb0, aa1, ba1, ab1, bb1)
    else:
        for w in tl.static_range(W):
            wts = wts + (tl.load(w_ptr + offs_c * sw_c + w * sw_w, mask=mc, other=0.0,
                                 eviction_policy=KEEP_EV).to(tl.float32),)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=mc, other=0.0,
                       eviction_policy=KEEP_EV).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    return wts, bias


@triton.jit
def _cols_x(x_ptr, row0, N, offs_c, mc, zero, sx_r, sx_t, sx_c, dt: tl.constexpr,
            S: tl.constexpr, ROWS: tl.constexpr, LD_CM: tl.constexpr, LD_EV: tl.constexpr):
    """-> the S tokens of the ROWS rows ([BLOCK_C] each, row-major), cast to the state dtype."""
    xt = ()
    for r in tl.static_range(ROWS):
        ok = ((zero + row0 + r) < N) & mc
        xb = x_ptr + (row0 + r).to(tl.int64) * sx_r + offs_c * sx_c
        for t in tl.static_range(S):
            xt = xt + (tl.load(xb + t * sx_t, mask=ok, other=0.0, cache_modifier=LD_CM,
                               eviction_policy=LD_EV).to(dt),)
    return xt


@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["slot_ptr", "acc_ptr"])
def _conv_update_cols_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, slot_ptr, acc_ptr, out_ptr,
    N, Cdim, ncols,
    sx_r, sx_t, sx_c, sw_c, sw_w, ss_s, ss_c, ss_k, so_r, so_t, so_c,
    W: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr, NULL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, WFLAT: tl.constexpr,
    INPUTS_FIRST: tl.constexpr, PDL: tl.constexpr, CHANNELS_FAST: tl.constexpr,
    LD_CM: tl.constexpr, LD_EV: tl.constexpr, KEEP_EV: tl.constexpr,
    ST_CM: tl.constexpr, ST_EV: tl.constexpr,
):
    """The update as [BLOCK_C] column vectors (selectable variant; see
    triton_causal_conv1d_update).  One program per (ROWS rows, BLOCK_C channels); s is a
    compile-time constant S.  Per row: W-1 window columns and S tokens, each loaded exactly once
    into a [BLOCK_C] vector (a contiguous run of channels in MambaPool's token-major layout);
    outputs are sums of those vectors; the new window is a store of vectors 1..W-2+S.  Every
    vector, the weights and the bias share one layout: no shared memory, no layout conversion.
    The weights and bias are loaded once per program and shared by its rows; the ROWS slot
    indices are independent scalar loads, so their latencies overlap.
    Issue order: weights, bias, [PDL=1: grid-dependency wait], [INPUTS_FIRST: x tokens], slot
    indices and accepted counts, windows, [PDL=2: wait], [else: x tokens]; outputs; barrier;
    windows.  PDL=1 reads only the weights and bias before the wait; PDL=2 also state_indices,
    num_accepted and conv_state (the caller guarantees that no kernel launched since the last
    launch without PDL writes them: a PDL kernel lets its successor start before it waits, so
    any of them may still be running).  LD_*: cache modifier / eviction policy of the read-once loads
    (windows, x), KEEP_EV: of the weights, bias, slots and counts, ST_*: of the window stores."""
    if CHANNELS_FAST:
        cb = tl.program_id(0)
        rb = tl.program_id(1)
    else:
        rb = tl.program_id(0)
        cb = tl.program_id(1)
    row0 = rb * ROWS
    c0 = cb * BLOCK_C
    offs_c = c0 + tl.arange(0, BLOCK_C)
    mc = offs_c < Cdim
    zero = tl.zeros([BLOCK_C], dtype=tl.int32)       # full-shape masks (the interpreter needs them)
    dt = state_ptr.dtype.element_ty

    wts, bias = _cols_weights(w_ptr, bias_ptr, offs_c, mc, c0, Cdim, sw_c, sw_w, W, HAS_BIAS,
                              BLOCK_C, WFLAT, KEEP_EV)
    if PDL == 1:                                     # every later address depends on row0
        row0 += pdl_enter(True)
    X_EARLY: tl.constexpr = INPUTS_FIRST and PDL != 2
    if X_EARLY:
        xt = _cols_x(x_ptr, row0, N, offs_c, mc, zero, sx_r, sx_t, sx_c, dt, S, ROWS, LD_CM,
                     LD_EV)
    slots = ()
    offs = ()
    for r in tl.static_range(ROWS):
        row = tl.minimum(row0 + r, N - 1)            # rows past N: masked below
        slots = slots + (tl.load(slot_ptr + row, eviction_policy=KEEP_EV).to(tl.int64),)
        offs = offs + (tl.load(acc_ptr + row, eviction_policy=KEEP_EV).to(tl.int32) - 1,)
    win = ()                                         # win[r*(W-1) + j]: column off_r + j
    lives = ()
    sbases = ()
    for r in tl.static_range(ROWS):
        live = ((zero + slots[r]) != NULL) & ((zero + row0 + r) < N) & mc
        sb = state_ptr + slots[r] * ss_s + offs_c * ss_c
        for j in tl.static_range(W - 1):
            col = tl.minimum(tl.maximum(offs[r] + j, 0), ncols - 1)
            win = win + (tl.load(sb + col * ss_k, mask=live, other=0.0, cache_modifier=LD_CM,
                                 eviction_policy=LD_EV),)
        lives = lives + (live,)
        sbases = sbases + (sb,)
    if PDL == 2:                                     # the x loads and stores depend on row0
        row0 += pdl_enter(True)
    if not X_EARLY:
        xt = _cols_x(x_ptr, row0, N, offs_c, mc, zero, sx_r, sx_t, sx_c, dt, S, ROWS, LD_CM,
                     LD_EV)

    for r in tl.static_range(ROWS):
        ok = ((zero + row0 + r) < N) & mc
        ob = out_ptr + (row0 + r).to(tl.int64) * so_r + offs_c * so_c
        for t in tl.static_range(S):
            a = bias
            for w in tl.static_range(W):
                if t + w < W - 1:
                    v = win[r * (W - 1) + t + w]
                else:
                    v = xt[r * S + t + w - (W - 1)]
                a += v.to(tl.float32) * wts[w]
            # null-slot rows: outputs are unspecified by the contract; write zeros (no NaN)
            o = tl.where(lives[r], _silu(a), 0.0)
            tl.store(ob + t * so_t, o.to(out_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()                               # every window is read before any store
    for r in tl.static_range(ROWS):
        for i in tl.static_range(W - 2 + S):         # new column i = xs[i + 1]
            if i + 1 < W - 1:
                v = win[r * (W - 1) + i + 1]
            else:
                v = xt[r * S + i + 1 - (W - 1)]
            tl.store(sbases[r] + i * ss_k, v, mask=lives[r], cache_modifier=ST_CM,
                     eviction_policy=ST_EV)


_HINT_TOKENS = ("evict", "cg", "cs")


def _cache_hints(spec):
    """'+'-joined tokens (None / 'none': no hints) -> the cols kernel's LD_CM, LD_EV, KEEP_EV,
    ST_CM, ST_EV.  evict: the read-once loads (window, x) and the window stores evict_first,
    weights / bias / slots / counts evict_last; cg: the read-once loads bypass L1 (.cg);
    cs: the window stores are streaming (.cs).  ptxas refuses an eviction policy next to .cg /
    .cs, so cg (cs) replaces evict on those loads (stores).  The outputs keep the default policy
    (the next kernel reads them)."""
    toks = set() if spec in (None, "", "none") else set(spec.split("+"))
    bad = toks - set(_HINT_TOKENS)
    assert not bad, f"unknown cache hint(s) {sorted(bad)}: use {'+'.join(_HINT_TOKENS)}"
    ev, cg, cs = "evict" in toks, "cg" in toks, "cs" in toks
    return dict(LD_CM=".cg" if cg else "", LD_EV="evict_first" if ev and not cg else "",
                KEEP_EV="evict_last" if ev else "", ST_CM=".cs" if cs else "",
                ST_EV="evict_first" if ev and not cs else "")


def _launch_cols(x, weight, bias, conv_state, state_indices, num_accepted, out, *, block_c,
                 num_warps, rows_per_program, inputs_first, cache_hints, pdl, channels_fast,
                 weight_load):
    N, s, Cdim = x.shape
    W = weight.shape[-1]
    rows = int(rows_per_program or 1)
    assert rows >= 1 and rows & (rows - 1) == 0, "rows_per_program: a power of 2"
    if pdl is None:                               # the engine-wide choice (triton_pdl): mode 1
        pdl = 1 if pdl_kwargs(x.device)["PDL"] else 0
    pdl = int(pdl)
    assert pdl in (0, 1, 2), "pdl: 0, 1 or 2"
    if not x.is_cuda:
        pdl = 0                                   # the interpreter has no grid-dependency control
    BLOCK_C = block_c or min(512, next_pow2(Cdim))
    # default: 4 bytes of a vector per thread (2 channels in 16-bit), up to 16 warps
    nw = num_warps or max(1, min(16, BLOCK_C * conv_state.element_size() // 128))
    # flat weight load: needs a contiguous [C, W] weight, W in 2/4/8, and (for the split values
    # to sit in the data layout) each thread's vector chunk to hold whole channels
    per_thread = max(1, BLOCK_C // (32 * nw))
    flat_possible = tuple(weight.stride()) == (W, 1) and W in (2, 4, 8)
    weight_load = weight_load or "auto"
    assert weight_load in ("auto", "flat", "taps"), "weight_load: auto, flat or taps"
    wflat = flat_possible and (weight_load == "flat" or (
        weight_load == "auto" and per_thread * W * weight.element_size() <= 16))
    nrb, ncb = cdiv(N, rows), cdiv(Cdim, BLOCK_C)
    grid = (ncb, nrb) if channels_fast else (nrb, ncb)
    launch = dict(launch_pdl=True) if pdl else {}
    with device_ctx(x):
        _conv_update_cols_kernel[grid](
            x, weight, bias if bias is not None else weight, conv_state, state_indices,
            num_accepted, out, N, Cdim, conv_state.shape[-1], *x.stride(), *weight.stride(),
            *conv_state.stride(), *out.stride(),
            W=W, S=s, HAS_BIAS=bias is not None, NULL=NULL_SLOT, ROWS=rows, BLOCK_C=BLOCK_C,
            WFLAT=wflat, INPUTS_FIRST=bool(inputs_first), PDL=pdl,
            CHANNELS_FAST=bool(channels_fast), **_cache_hints(cache_hints), num_warps=nw,
            **launch,
        )
    return out


def triton_causal_conv1d_update(x, weight, bias, conv_state, state_indices, num_accepted, *,
                                block_c=None, num_warps=None, variant=None, rows_per_program=None,
                                inputs_first=None, cache_hints=None, pdl=None,
                                channels_fast=None, weight_load=None):
    """Same arguments and result as ``causal_conv1d_update_ref``.

    Default: ``_conv_update_cols_kernel`` with ``_COLS_DEFAULTS`` (2 rows per program, 512
    channels, 8 warps in 16-bit, streaming ``.cs`` cache hints): the H100 sweep of 2026-11-22
    (``benchmarks/kernels.py --sweep-conv``, Nemotron-H-8B conv_dim 10240, bf16) measured 77-89%
    of copy bandwidth at B = 64 / 128 / 256 for s = 1 and 85-90% for s = 4, against 62-82% for
    the previous kernel.  ``variant="window"`` runs that previous kernel, ``_conv_update_kernel``
    (block_c / num_warps override its block shape; the other options do not apply to it).
    Options of the cols kernel; unset ones take the value in brackets:
      rows_per_program   rows per program, a power of 2; weights loaded once for all [2]
      inputs_first       issue the x loads before the slot-index loads [False]
      cache_hints        '+'-joined 'evict' / 'cg' / 'cs' (see _cache_hints) ['cs']
      pdl                programmatic dependent launch (CUDA, sm_90+; ignored on CPU): 0 off,
                         1: only weights / bias are read before the grid-dependency wait,
                         2: also state_indices, num_accepted and conv_state, so the caller must
                         know that no kernel launched since the last launch without PDL
                         writes them (tests and benchmarks only)
                         [1 where ``triton_pdl.pdl_kwargs`` turns PDL on, else 0]
      channels_fast      grid (channel blocks, row blocks) instead of (row blocks, channel
                         blocks): consecutive programs share rows [False]
      weight_load        'flat': one contiguous load of the block's weights, split into taps
                         (where possible: a contiguous [C, W] weight, W in 2, 4, 8; else taps);
                         'taps': a strided load per tap; 'auto': flat where it also keeps the
                         data layout (W = 4: at most 2 channels per thread) [auto]
    block_c [512]; num_warps [4 bytes of each vector per thread, at most 16 warps]."""
    N, s, Cdim = x.shape
    W = weight.shape[-1]
    ncols = conv_state.shape[-1]
    assert 1 <= s and W - 2 + s <= ncols, "need 1 <= s <= 1+K"
    out = torch.empty_like(x)
    if N == 0:
        return out
    assert variant in (None, "cols", "window"), f"unknown conv update variant {variant!r}"
    if variant != "window":
        opts = dict(rows_per_program=rows_per_program, inputs_first=inputs_first,
                    cache_hints=cache_hints, pdl=pdl, channels_fast=channels_fast,
                    weight_load=weight_load)
        opts = {k: (_COLS_DEFAULTS.get(k) if v is None else v) for k, v in opts.items()}
        return _launch_cols(x, weight, bias, conv_state, state_indices, num_accepted, out,
                            block_c=block_c, num_warps=num_warps, **opts)
    bias_arg = bias if bias is not None else weight
    # H100 sweep (benchmarks/kernels.py --sweep-conv, token-major pool, 2026-11-22):
    # 512 channels; 8 warps for one token per row, 4 for verify rows
    BLOCK_C = block_c or min(512, next_pow2(Cdim))
    with device_ctx(x):
        _conv_update_kernel[(N, cdiv(Cdim, BLOCK_C))](
            x, weight, bias_arg, conv_state, state_indices, num_accepted, out,
            s, Cdim, ncols, *x.stride(), *weight.stride(), *conv_state.stride(), *out.stride(),
            W=W, HAS_BIAS=bias is not None, NULL=NULL_SLOT, BLOCK_S=next_pow2(s),
            BLOCK_WIN=next_pow2(W - 2 + s), BLOCK_C=BLOCK_C,
            num_warps=num_warps or (8 if s == 1 else 4),
        )
    return out


# the conv-update default (see triton_causal_conv1d_update's docstring for the measurement)
_COLS_DEFAULTS = dict(rows_per_program=2, cache_hints="cs")
