"""Triton chunked SSD scan over packed varlen prefill (CONTRACT item 3).

Chunks of ``chunk_size`` tokens counted from each sequence's start; global chunk c belongs to the
sequence b with cum[b-1] <= c < cum[b] (cum = inclusive cumsum of ceil(L_b / chunk_size)); chunk
ids past cum[B-1] (the grid is an upper bound, no host sync) are empty.  Three launches with
steps 2 and 3 fused (the default), four without:

1. ``_chunk_dt_kernel``  (chunk, head block): chunk metadata (start token, length), dt =
   clamp(softplus(dt_raw + dt_bias)) and the inclusive cumsum of dt*A inside the chunk.
2. ``triton_ssd_state`` (chunk, head, P block): the state the chunk produces from
   zero, S_c = sum_j exp(cum_last - cum_j) dt_j x_j B_j^T   (tl.dot over the chunk's tokens).
3. ``triton_ssd_pass`` (sequence, head, state tile): sequential over the sequence's chunks,
   h_in(c) = h; h = exp(cum_last_c) h + S_c; final state out.  h_in is stored in the dtype the
   chunk-output dots take (the model dtype under ``lowp``: half the bytes written here and read
   by step 4; in place over S_c otherwise).
   Steps 2 and 3 as written run with ``fused_pass=False`` only.  By default
   ``triton_ssd_fused_pass`` (sequence, head, P block) does both in one launch, each program
   walking its sequence's chunks with S_c in registers (no float32 S round trip through memory):
   1.00-1.15x the whole scan on an H100 for one sequence of 128 to 8192 tokens, 1.07-1.19x in
   batches (``benchmarks/results/2026-11-28-ssd-fused-pass-h100.md``).  h_in then goes to its own
   buffer (the model dtype under ``lowp``, else float32), and a float32 copy for the emits only
   on steps that emit under ``lowp`` (none with ``fused_emits``: the fused kernel stores the
   emits itself).
4. Chunk output: y_i = exp(cum_i) C_i h_in^T + sum_{j<=i} exp(cum_i - cum_j) (C_i . B_j) dt_j x_j
   + D x_i   (tl.dot, causal blocks only).  Default path by dot operand dtype (``_DEFAULTS``):
   - bf16 / fp16 models (``lowp``): ``triton_ssd_heads._chunk_out_heads_kernel``, one program
     per (chunk, 64-row block, 4 heads of one group) reusing C and the C.B tile of its rows x
     the whole chunk (model dtype) for the 4 heads (1.11x the whole scan on an H100);
   - float32 models (and ``lowp=False``), one head per group, ``heads_per_program=1``:
     ``triton_ssd_out._chunk_out_kernel`` (chunk, head, 128-row block), C.B recomputed per head.
   Optionally ``_chunk_cb_kernel`` (chunk, group, row block) precomputes C.B (``cb_pre``).

All accumulation in float32.  For bf16/fp16 models every dot takes 16-bit operands by default
(``lowp``: the decay-weighted inputs and the chunk-entry states are rounded to the model dtype
for the dot, as mamba-ssm does; 1.3x faster on an H100 than TF32 dots over float32 operands,
which ``lowp=False`` gives); float32 models take ``triton_common.F32_DOT_PRECISION`` dots (three
TF32 products a dot, about float32's accuracy) and precompute C.B once per chunk and group (``cb_pre``).
``triton_ssd_sequential.triton_ssd_scan_sequential`` is the simple alternative: one program per
(sequence, head, P block) walking the tokens with the state in registers (kept for comparison and
as a fallback).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops.ssd import _grid_size, check_pooled_emits
from hybrid_engine.mamba_cache.ops.triton_common import (F32_DOT_PRECISION, cdiv, device_ctx, next_pow2, search_iters,
                                                         tl_helpers)
from hybrid_engine.mamba_cache.ops.triton_ssd_emit import emit_output, emit_states
from hybrid_engine.mamba_cache.ops.triton_ssd_heads import _chunk_out_heads_kernel
from hybrid_engine.mamba_cache.ops.triton_ssd_out import _chunk_out_kernel
from hybrid_engine.mamba_cache.ops.triton_ssd_pass import launch_state_pass
from hybrid_engine.mamba_cache.ops.triton_ssd_fused_pass import (FUSED_EMITS_DEFAULT, FUSED_PASS_DEFAULT,
                                                                   launch_chunk_pass, narrow_launch)
from hybrid_engine.mamba_cache.ops.triton_ssd_state import launch_chunk_state

_softplus, _silu = tl_helpers()


@triton.jit(do_not_specialize=["nseq"], do_not_specialize_on_alignment=["qsl_ptr"])
def _chunk_dt_kernel(
    dt_ptr, dt_bias_ptr, A_ptr, qsl_ptr, cum_ptr,
    meta_ptr, dtc_ptr, cuma_ptr,
    nseq, H, cs, dt_min, dt_max, sdt_t, sdt_h,
    CLAMP: tl.constexpr, SEARCH_ITERS: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
):
    c = tl.program_id(0)
    hb = tl.program_id(1)
    # sequence of chunk c: smallest b with cum[b] > c (binary search)
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + nseq
    for _ in tl.static_range(SEARCH_ITERS):
        act = lo < hi
        mid = (lo + hi) // 2
        gt = tl.load(cum_ptr + mid, mask=act, other=0) > c
        hi = tl.where(act & gt, mid, hi)
        lo = tl.where(act & (~gt), mid + 1, lo)
    valid = lo < nseq
    b = tl.minimum(lo, nseq - 1)
    first = tl.load(cum_ptr + b - 1, mask=b > 0, other=0)
    s0 = tl.load(qsl_ptr + b)
    s1 = tl.load(qsl_ptr + b + 1)
    cstart = s0 + (c - first) * cs
    clen = tl.where(valid, tl.minimum(cs, s1 - cstart), 0)
    if hb == 0:
        tl.store(meta_ptr + c * 2, cstart.to(tl.int32))
        tl.store(meta_ptr + c * 2 + 1, clen.to(tl.int32))

    offs_l = tl.arange(0, BLOCK_L)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = offs_h < H
    ml = offs_l < clen
    m2 = ml[:, None] & mh[None, :]
    raw = tl.load(dt_ptr + (cstart + offs_l)[:, None].to(tl.int64) * sdt_t
                  + offs_h[None, :] * sdt_h, mask=m2, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    dt = _softplus(raw + bias[None, :])
    if CLAMP:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(m2, dt, 0.0)
    A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    cuma = tl.cumsum(dt * A[None, :], axis=0)                        # [BLOCK_L, BLOCK_H]
    # layout [NC, H, BLOCK_L]
    out_off = (c * H + offs_h)[None, :].to(tl.int64) * BLOCK_L + offs_l[:, None]
    mo = (offs_l[:, None] < BLOCK_L) & mh[None, :]
    tl.store(dtc_ptr + out_off, dt, mask=mo)
    tl.store(cuma_ptr + out_off, cuma, mask=mo)


@triton.jit
def _chunk_cb_kernel(
    B_ptr, C_ptr, meta_ptr, cb_ptr, G, N,
    sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    PREC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """CB[c, g, i, j] = C_i . B_j for the chunk's tokens (float32 accumulation, stored in the
    buffer's dtype: float32, or the model dtype under ``cb_dtype="model"``), rows i in one M
    block."""
    c = tl.program_id(0)
    g = tl.program_id(1)
    mb = tl.program_id(2)
    clen = tl.load(meta_ptr + c * 2 + 1)
    m0 = mb * BLOCK_M
    if m0 < clen:
        cstart = tl.load(meta_ptr + c * 2).to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_j = tl.arange(0, BLOCK_L)
        offs_n = tl.arange(0, BLOCK_N)
        mm = offs_m < clen
        mj = (offs_j < clen) & (offs_j < m0 + BLOCK_M)
        mn = offs_n < N
        cm = tl.load(C_ptr + (cstart + offs_m)[:, None] * sc_t + g * sc_g + offs_n[None, :] * sc_n,
                     mask=mm[:, None] & mn[None, :], other=0.0)                       # [M, N]
        bt = tl.load(B_ptr + (cstart + offs_j)[None, :] * sb_t + g * sb_g + offs_n[:, None] * sb_n,
                     mask=mn[:, None] & mj[None, :], other=0.0)                       # [N, L]
        if PREC != "tf32":
            cb = tl.dot(cm.to(tl.float32), bt.to(tl.float32), input_precision=PREC)
        else:
            cb = tl.dot(cm, bt)
        out = ((c * G + g).to(tl.int64) * BLOCK_L + offs_m[:, None]) * BLOCK_L + offs_j[None, :]
        tl.store(cb_ptr + out, cb.to(cb_ptr.dtype.element_ty),
                 mask=mm[:, None] & (offs_j < BLOCK_L)[None, :])


def _dt_args(dt_limit):
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    clamp = lo > 0.0 or hi < math.inf
    return clamp, (lo if clamp else 0.0), (hi if (clamp and hi < math.inf) else 3.0e38)


def triton_ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, initial_states,
                           chunk_size, dt_limit=(0.0, math.inf), *, max_seqlen=None,
                           out_dtype=torch.float32, lowp=None, cb_pre=None, block_m=None,
                           block_k=None, num_warps=None, block_p=None, num_stages=None,
                           cb_dtype=None, heads_per_program=None, state_block_k=None,
                           state_num_warps=None, state_num_stages=None, state_block_p=None,
                           emit_at=None, state_indices=None, has_initial_state=None, chunk_layout=None,
                           emit_out=None, emit_rows=None, fused_pass=None, fused_block_k=None,
                           fused_block_p=None, fused_num_warps=None, fused_emits=None, emits_sorted=False):
    """Same arguments and results as ``ssd_scan_varlen_ref`` -> (y [T,H,P] out_dtype,
    final [B,H,P,N] f32), plus with ``emit_at`` [M] the states after those tokens [M,H,P,N] f32
    (``triton_ssd_emit.emit_states``: from the float32 chunk-entry states the state pass keeps and the chunk's
    own dt / cumulative decay; no second pass over the sequence).

    lowp: 16-bit dot operands (the model dtype) for the dots whose operands are float32 values
    (decay-weighted inputs, states); accumulation stays float32.  Ignored for float32 models.
    Chunk-output (step 4) options; None takes ``_DEFAULTS`` when the multi-head kernel runs
    with 16-bit dot operands, ``_PER_HEAD_DEFAULTS`` otherwise (``cb_pre``: on for float32 models):
    heads_per_program: heads of one group per program (``_chunk_out_heads_kernel``; rounded up
    to a power of two, capped at the heads per group; blocks never straddle groups; 1: the
    per-head ``_chunk_out_kernel``).  The C.B tile of the program's rows x the whole chunk is
    kept in registers and reused for its heads.  Default 4 under lowp, else 1; the per-head
    kernel runs anyway with float32 dot operands and chunks over 64 tokens, with one head per
    group, and when the in-chunk offsets of x / y do not fit int32.
    cb_pre: C.B once per (chunk, group) in its own launch instead of once per program.
    block_m / block_k: rows per program / tokens per K step of the per-head kernel.
    num_warps / num_stages: launch options.  block_p: head_dim columns per program (default
    all; pairs best with cb_pre, else C.B is recomputed per column block).
    cb_dtype: "float32" or "model": C.B rounded to the model dtype where it is kept (the cb_pre
    buffer, the multi-head kernel's registers); the decay / dt weighting stays float32.
    Chunk-state (step 2) options, with ``fused_pass=False`` only (a ValueError otherwise)
    (``triton_ssd_state.launch_chunk_state``; None: its defaults): state_block_k (tokens per K
    step), state_block_p (head_dim columns per program), state_num_warps, state_num_stages.
    state_indices [B] / has_initial_state [B] (``triton_ssd_scan_varlen_pooled``): initial_states is
    the pool view [S,H,P,N]; the state pass reads row b's start at its slot (zeros where it starts
    fresh) and writes its final state there; the second result is then None.
    chunk_layout: (query_start_loc int32 [B+1], cumulative chunk counts int32 [B]) made once a step
    (``MambaMetadata.ssd_chunk_layout``); None computes them here.
    emit_out [R,H,P,N] / emit_rows [M]: the emitted states go to emit_out[emit_rows] (checkpoint
    rows, in place; ``emit_states``' out / out_rows) and the third result is emit_out.
    fused_pass: steps 2 and 3 in one launch (``triton_ssd_fused_pass``: each program walks its
    sequence's chunks, S_c kept in registers; None: ``FUSED_PASS_DEFAULT``, on); False runs the
    chunk-state and state-pass kernels, which the chunk-state options configure.
    fused_block_k / fused_block_p / fused_num_warps: the fused kernel's options (None: its
    defaults; a ValueError with ``fused_pass=False``). fused_emits: the fused kernel also stores
    the emits (from the float32 entry state it holds in registers: no float32 copy of the entry
    states, no emit kernel); None: ``FUSED_EMITS_DEFAULT`` (on: faster than the emit kernel in
    every H100 row measured), except where the fused pass takes its narrow blocks
    (``narrow_launch``); needs the fused pass. Its kernel walks the emits in token order:
    ``emits_sorted`` says emit_at is non-decreasing (the engine's saves are), else it is sorted
    on the device first (an argsort and two gathers).
    """
    T, H, P = x.shape
    G, N = B.shape[-2:]
    fused_pass = FUSED_PASS_DEFAULT if fused_pass is None else bool(fused_pass)
    # options of the kernels that do not run would be dropped without a word: refuse them
    unused = {k: v for k, v in (("state_block_k", state_block_k), ("state_block_p", state_block_p),
                                ("state_num_warps", state_num_warps), ("state_num_stages", state_num_stages))
              if v is not None} if fused_pass else \
        {k: v for k, v in (("fused_block_k", fused_block_k), ("fused_block_p", fused_block_p),
                           ("fused_num_warps", fused_num_warps)) if v is not None}
    if fused_emits and not fused_pass:
        unused["fused_emits"] = fused_emits
    if unused:
        raise ValueError(f"triton_ssd_scan_varlen: {sorted(unused)} configure the "
                         + ("unfused chunk-state kernel, which this call does not run: pass fused_pass=False"
                            if fused_pass else "fused pass, which fused_pass=False turns off"))
    Bn = query_start_loc.numel() - 1
    dev = x.device
    cs = int(chunk_size)
    y = torch.empty((T, H, P), dtype=out_dtype, device=dev)
    pooled = state_indices is not None
    final = initial_states if pooled else torch.empty((Bn, H, P, N), dtype=torch.float32, device=dev)
    if Bn == 0:
        final = None if pooled else final
        return (y, final) if emit_at is None else \
            (y, final, emit_out if emit_rows is not None else torch.empty((0, H, P, N), device=dev))
    _, NC = _grid_size(query_start_loc, T, cs, max_seqlen)
    NC = max(NC, 1)
    if chunk_layout is not None and T < 2**31:
        qsl, cum = chunk_layout
    else:
        qsl = query_start_loc.to(dev)
        lens = qsl[1:] - qsl[:-1]
        cum = torch.cumsum((lens + (cs - 1)) // cs, 0).to(torch.int32)           # [B]
        qsl = qsl.to(torch.int32) if T < 2**31 else qsl.long()

    BLOCK_L = max(16, next_pow2(cs))
    BLOCK_N = max(16, next_pow2(N))
    BLOCK_P = max(16, next_pow2(P))
    clamp, lo, hi = _dt_args(dt_limit)
    prec = F32_DOT_PRECISION if x.dtype == torch.float32 else "tf32"
    lowp = _DEFAULTS["lowp"] if lowp is None else lowp
    lowp = bool(lowp) and x.dtype in (torch.bfloat16, torch.float16) and B.dtype == x.dtype \
        and C.dtype == x.dtype
    if fused_emits is None:     # inside the narrow blocks the emits were slower (_FUSED_NARROW)
        fused_emits = FUSED_EMITS_DEFAULT and not narrow_launch(Bn, H, P, lowp, dev)
    fused_emits = fused_pass and bool(fused_emits)
    # step 4: which kernel, then its defaults
    BP_OUT = min(BLOCK_P, max(16, next_pow2(block_p or _DEFAULTS["block_p"] or P)))
    hpg = H // G
    hpp = heads_per_program or (_DEFAULTS["heads_per_program"] if lowp else 1)
    hpp = max(1, min(next_pow2(int(hpp)), next_pow2(hpg)))     # a power of two
    # float32 dot operands: the multi-head kernel's whole-chunk tiles need more shared memory
    # than an SM has past 64-token chunks (and minutes of compile)
    if not lowp and BLOCK_L > 64:
        hpp = 1
    # the multi-head kernel takes int32 offsets inside a chunk (x / y rows, the state tile);
    # past that range the per-head kernel (int64 offsets) runs
    lim = max(BLOCK_L * abs(st) + BP_OUT * abs(sp) + 1
              for st, sp in ((x.stride(0), x.stride(2)), (y.stride(0), y.stride(2))))
    if max(lim, BLOCK_P * N + BLOCK_N) >= 2**31:
        hpp = 1
    dflt = _DEFAULTS if (lowp and hpp > 1) else _PER_HEAD_DEFAULTS
    opt = lambda v, k: dflt[k] if v is None else v                 # noqa: E731
    # float32: C.B once per (chunk, group) in its own launch, not once per head (8 heads a group on
    # the bench-large shape): with tf32x3 dots 5.60 -> 5.27 ms for a 256-token prefill (H200)
    cb_pre = (x.dtype == torch.float32 or dflt["cb_pre"]) if cb_pre is None else cb_pre
    cb_dtype = opt(cb_dtype, "cb_dtype")
    assert cb_dtype in ("float32", "model"), cb_dtype
    cb_round = cb_dtype == "model" and x.dtype != torch.float32      # C.B in the model dtype
    BLOCK_K = min(block_k or dflt["block_k"], BLOCK_L)
    BLOCK_M = min(block_m or dflt["block_m"], BLOCK_L)
    stages = num_stages or dflt["num_stages"]
    launch = dict(num_warps=num_warps or dflt["num_warps"])
    if stages:
        launch["num_stages"] = stages

    meta = torch.empty((NC, 2), dtype=torch.int32, device=dev)
    dtc = torch.empty((NC, H, BLOCK_L), dtype=torch.float32, device=dev)
    cuma = torch.empty((NC, H, BLOCK_L), dtype=torch.float32, device=dev)
    # S: the chunk states (unfused), then the float32 entry states the emits read; the fused pass
    # needs it only for the emits under lowp (else h_in itself is float32)
    need_s = not fused_pass or (emit_at is not None and lowp and not fused_emits)
    S = torch.empty((NC, H, P, N), dtype=torch.float32, device=dev) if need_s else None
    # chunk-entry states: rounded to the dot operand dtype anyway under lowp, so stored that way
    hin = torch.empty((NC, H, P, N), dtype=x.dtype if lowp else torch.float32, device=dev) \
        if (lowp or S is None) else S
    cb = torch.empty((NC, G, BLOCK_L, BLOCK_L) if cb_pre else (1,),
                     dtype=x.dtype if cb_round else torch.float32, device=dev)
    BLOCK_H = max(1, min(next_pow2(H), 4096 // BLOCK_L))
    if pooled:      # bool -> uint8 (a view when contiguous): Triton loads bytes
        has_init = has_initial_state.view(torch.uint8) if has_initial_state.is_contiguous() \
            else has_initial_state.to(torch.uint8)
    with device_ctx(x):
        _chunk_dt_kernel[(NC, cdiv(H, BLOCK_H))](
            dt_raw, dt_bias, A, qsl, cum, meta, dtc, cuma,
            Bn, H, cs, lo, hi, *dt_raw.stride(),
            CLAMP=clamp, SEARCH_ITERS=search_iters(Bn),
            BLOCK_L=BLOCK_L, BLOCK_H=BLOCK_H, num_warps=4,
        )
        if cb_pre:
            BM_CB = min(64, BLOCK_L)
            _chunk_cb_kernel[(NC, G, cdiv(BLOCK_L, BM_CB))](
                B, C, meta, cb, G, N, *B.stride(), *C.stride(),
                PREC=prec, BLOCK_L=BLOCK_L, BLOCK_M=BM_CB, BLOCK_N=BLOCK_N, num_warps=4,
            )
        if fused_pass:
            emits_k = {}
            if emit_at is not None and fused_emits:
                emit_out = emit_output(emit_at, emit_out, emit_rows, H, P, N, dev)
                emits_k = dict(emit_at=emit_at, emit_out=emit_out, emit_rows=emit_rows, emits_sorted=emits_sorted)
            launch_chunk_pass(x, B, meta, dtc, cuma, cum, hin, S,       # S: only for emits under lowp
                              initial_states, final, state_indices, has_init if pooled else None, Bn,
                              prec, lowp, BLOCK_L, BLOCK_N, pooled, NULL_SLOT, fused_block_k,
                              fused_block_p, fused_num_warps, **emits_k)
        else:
            launch_chunk_state(x, B, meta, dtc, cuma, S, NC, prec, lowp, BLOCK_L, BLOCK_N,
                               state_block_k, state_num_warps, state_num_stages, state_block_p)
            launch_state_pass(S, hin, cuma, cum, initial_states, final, state_indices,
                              has_init if pooled else None, Bn, BLOCK_L, BLOCK_P, BLOCK_N,
                              store32=emit_at is not None and hin is not S, pooled=pooled, null_slot=NULL_SLOT)
        npb = cdiv(P, BP_OUT)
        nmb = cdiv(cs, BLOCK_M)
        strides = (*x.stride(), *B.stride(), *C.stride(), *y.stride())
        if hpp > 1:
            nhb = cdiv(hpg, hpp)
            _chunk_out_heads_kernel[(NC * nmb * npb, G * nhb)](
                x, B, C, D, A, meta, dtc, cuma, hin, cb, y, H, P, N, G, hpg, nhb, npb, *strides,
                PREC=prec, LOWP=lowp, CB_PRE=cb_pre, CB_ROUND=cb_round, BLOCK_L=BLOCK_L,
                BLOCK_M=BLOCK_M, BLOCK_P=BP_OUT, BLOCK_N=BLOCK_N, BLOCK_H=hpp,
                N_MBLOCKS=nmb, HALVES=BLOCK_L >= 32, **launch,
            )
        else:
            _chunk_out_kernel[(NC, H, nmb * npb)](
                x, B, C, D, meta, dtc, cuma, hin, cb, y, H, P, N, G, hpg, npb, *strides,
                PREC=prec, LOWP=lowp, CB_PRE=cb_pre, BLOCK_L=BLOCK_L, BLOCK_M=BLOCK_M,
                BLOCK_K=BLOCK_K, BLOCK_P=BP_OUT, BLOCK_N=BLOCK_N, **launch,
            )
    final = None if pooled else final
    if emit_at is None:
        return y, final
    if fused_emits:                 # stored by the fused pass
        return y, final, emit_out
    # S now holds every chunk's float32 entry state (in place over S_c: STORE32, or hin is S; the
    # fused pass's h32, or its float32 hin)
    h32 = S if S is not None else hin
    return y, final, emit_states(x, B, qsl, cum, meta, dtc, cuma, h32, emit_at, cs, out=emit_out, out_rows=emit_rows)


def triton_ssd_scan_varlen_pooled(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, states, state_indices,
                                  has_initial_state, chunk_size, dt_limit=(0.0, math.inf), *, max_seqlen=None,
                                  out_dtype=torch.float32, emit_at=None, emit_out=None, emit_rows=None,
                                  **options):
    """Same arguments and results as ``ssd_scan_varlen_pooled_ref`` (the emits stored straight into
    emit_out's rows by the emit kernel); ``options``: the tuning keywords of
    ``triton_ssd_scan_varlen``."""
    # metadata checks only (no host sync): the state pass reads slot_ptr + b and has_init_ptr + b
    nb = query_start_loc.numel() - 1
    if state_indices.dim() != 1 or state_indices.shape[0] != nb or has_initial_state.shape != state_indices.shape:
        raise ValueError(f"state_indices {tuple(state_indices.shape)} and has_initial_state "
                         f"{tuple(has_initial_state.shape)} must both be [B] = [{nb}]")
    if has_initial_state.dtype != torch.bool:
        raise TypeError(f"has_initial_state must be a bool tensor, got {has_initial_state.dtype}")
    if state_indices.dtype not in (torch.int32, torch.int64) or state_indices.stride(0) != 1:
        raise ValueError(f"state_indices must be a contiguous int32/int64 tensor, got {state_indices.dtype} "
                         f"with stride {state_indices.stride()}")
    layout = options.get("chunk_layout")
    if layout is not None and (layout[0].numel() != nb + 1 or layout[1].numel() != nb):
        raise ValueError(f"chunk_layout holds {layout[1].numel()} rows, the call {nb}")
    check_pooled_emits(emit_at, emit_out, emit_rows)
    out = triton_ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, states, chunk_size, dt_limit,
                                 max_seqlen=max_seqlen, out_dtype=out_dtype, emit_at=emit_at,
                                 state_indices=state_indices, has_initial_state=has_initial_state,
                                 emit_out=emit_out, emit_rows=emit_rows, **options)
    return out[0]


# Defaults.  16-bit dot operands (lowp: bf16 / fp16 models) with more than one head per group:
# the multi-head kernel, from the H100 sweep of 2026-11-22 (benchmarks/vs_mamba_ssm.py
# --variants; T=8192, Nemotron-H-8B shape, bf16, eager): 4 heads per program, 64 rows, C.B kept
# in bf16, 2 stages: 0.740 ms for the whole scan, 1.11x the per-head kernel (0.822 ms) and 1.13x
# mamba-ssm (0.838 ms); chunk output 319 us vs 414 us (mamba-ssm's chunk scan + bmm: 338 us).
# Runner-up configs (C.B precomputed, 2 or 8 heads per program) were 0.767-0.783 ms.
_DEFAULTS = dict(lowp=True, cb_pre=False, block_m=64, block_k=32, num_warps=4, block_p=None,
                 num_stages=2, cb_dtype="model", heads_per_program=4)
# Everything else (float32 dot operands: float32 models or lowp=False; one head per group;
# heads_per_program=1; the fallbacks above) runs the per-head kernel with the defaults of the
# H100 sweep in benchmarks/kernels.py (session 2; unchanged): 128 rows, Triton's stages, C.B in
# float32.
_PER_HEAD_DEFAULTS = dict(_DEFAULTS, block_m=128, num_stages=None, cb_dtype="float32",
                          heads_per_program=1)
