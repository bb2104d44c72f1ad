"""Triton paged attention for packed prefill chunks and decode/verify rows (see CONTRACT.md).

One program per (row, kv head, block of query tokens).  The program's M tile is BLOCK_Q query
tokens x G_PAD query heads of that kv head (GQA: the g heads share every K/V load), so a decode
or verify row (1+K queries) is one tile.  Keys are walked in blocks of BLOCK_N positions through
the block table (position s -> block_tables[row, s // bs], offset s % bs), only up to the last
position any query of the tile may see; online softmax in float32 (exp2, scale folded in).
Small decode/verify batches split the key range over several programs (flash-decoding) and a
second launch combines the partial (max, sum, weighted-V) triples; so do prefill chunks whose
query tiles are fewer than the SMs (a short chunk after a long context). Ranges are cut from each
row's own length (ROW_SPLIT: n_splits ranges of cdiv(len, n_splits) keys rounded up to BLOCK_N),
not from the batch's length bound, so a short row gets short ranges under any bound (cut from a
bound of 262k keys, each range was ~4100 keys long: one program per KV head for a context of a
few thousand). Only ranges that start inside the row are stored and combined; a decode token's
combine (and a verify token's, with more than 8 ranges) reads all its ranges in one load (up to
16384 partial values); otherwise one range per loop step, as prefill tiles do
(``_combine_in_one_load``). Explicit ``num_splits`` (sweeps, tests) cuts a decode row's ranges
from the bound instead.
Output dtype = q.dtype; tokens no row owns (past query_start_loc[B]) come back as zeros.
FP8 caches (KV_FP8): the K / V tiles are converted to q's dtype before each dot (exact: every
float8_e4m3fn value is a bf16 / fp16 / fp32 value); the per-layer K scale, read from device memory,
joins the softmax scale, and the V scale multiplies the accumulator (linear in V) before it is
normalised or stored as a split's partial. The 16/32-bit specialisation has none of this.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import F32_DOT_PRECISION, cdiv, device_ctx, next_pow2, num_sms
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs


@triton.jit
def _row_split_len(seq_len, n_splits, BLOCK_N: tl.constexpr):
    """ROW_SPLIT's range length: cdiv(seq_len, n_splits) keys rounded up to BLOCK_N (at least 1,
    so an empty row's range count, cdiv(0, length), is 0). The attention and combine kernels both
    take it from here: the combine reads exactly the ranges the attention stored."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N, 1)


@triton.jit(do_not_specialize=["split_len", "n_splits", "T", "sbt_b"],
            do_not_specialize_on_alignment=["qsl_ptr", "sl_ptr", "bt_ptr"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, qsl_ptr, sl_ptr, bt_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, ks_ptr, vs_ptr,
    qk_scale, G, hd, bs, split_len, n_splits, T, nH,
    sq_t, sq_h, sq_d, sk_b, sk_o, sk_h, sk_d, sv_b, sv_o, sv_h, sv_d, sbt_b, sbt_m,
    so_t, so_h, so_d,
    PREC: tl.constexpr, SPLIT: tl.constexpr, BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, ROW_SPLIT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    z = pdl_enter(PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    b = tl.program_id(0) + z
    kvh = tl.program_id(1) + z
    if SPLIT:                      # axis 2 = query block x key range split
        qb = (tl.program_id(2) + z) // n_splits
        sp = (tl.program_id(2) + z) % n_splits
    else:
        qb = tl.program_id(2) + z
        sp = 0
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    i0 = qb * BLOCK_Q
    if i0 < q_len:
        seq_len = tl.load(sl_ptr + b)
        offs_m = tl.arange(0, BLOCK_M)
        qi = i0 + offs_m // G_PAD
        gh = offs_m % G_PAD
        mrow = (qi < q_len) & (gh < G)
        head = kvh * G + gh
        offs_d = tl.arange(0, BLOCK_D)
        md = offs_d < hd
        tok = (q_start + qi).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :] * sq_d,
                    mask=mrow[:, None] & md[None, :], other=0.0)                     # [M, D]
        qpos = seq_len - q_len + qi                                                 # [M]
        kv_end = seq_len - q_len + tl.minimum(i0 + BLOCK_Q, q_len)   # keys 0..kv_end-1 needed
        if SPLIT:
            if ROW_SPLIT:          # ranges of this row's own keys (its seq_len, not the batch bound)
                split_len = _row_split_len(seq_len, n_splits, BLOCK_N)
            kv_lo = sp * split_len
            kv_hi = tl.minimum(kv_end, kv_lo + split_len)
            # rows of this range's partials that the combine reads: with ROW_SPLIT only ranges
            # that start inside the row (no other is stored); otherwise every range, empty ones too
            mstore = mrow
            if ROW_SPLIT:
                mstore = mrow & (qi * 0 + kv_lo < seq_len)   # a [M] block (the interpreter's & of
                                                                # a block and a scalar gives ints)
        else:
            kv_lo = 0
            kv_hi = kv_end

        if KV_FP8:                 # scores = q . (code * k_scale) * scale
            qk_scale = qk_scale * tl.load(ks_ptr)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * sbt_b
        for s0 in range(kv_lo, kv_hi, BLOCK_N):
            offs_s = s0 + tl.arange(0, BLOCK_N)
            ms = offs_s < kv_hi
            blk = tl.load(bt_row + (offs_s // bs) * sbt_m, mask=ms, other=0).to(tl.int64)
            slot_off = offs_s % bs
            kt = tl.load(k_ptr + blk[None, :] * sk_b + slot_off[None, :] * sk_o + kvh * sk_h
                         + offs_d[:, None] * sk_d, mask=ms[None, :] & md[:, None],
                         other=0.0)                                                   # [D, N]
            if KV_FP8:
                kt = kt.to(q.dtype)
            sc = tl.dot(q, kt, input_precision=PREC) * qk_scale                      # [M, N]
            vis = (offs_s[None, :] <= qpos[:, None]) & ms[None, :] & mrow[:, None]
            sc = tl.where(vis, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(sc - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + blk[:, None] * sv_b + slot_off[:, None] * sv_o + kvh * sv_h
                        + offs_d[None, :] * sv_d, mask=ms[:, None] & md[None, :],
                        other=0.0)                                                    # [N, D]
            if KV_FP8:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
            m_i = m_new
        if KV_FP8:                 # sum_s p_s (code_s * v_scale) = v_scale * sum_s p_s code_s
            acc = acc * tl.load(vs_ptr)
        if SPLIT:
            # partials [n_splits, T, nH] (m, l: log2 domain) and [n_splits, T, nH, hd] (acc)
            pidx = (sp * T + tok) * nH + head                                       # [M] int64
            tl.store(pm_ptr + pidx, m_i, mask=mstore)
            tl.store(pl_ptr + pidx, l_i, mask=mstore)
            tl.store(po_ptr + pidx[:, None] * BLOCK_D + offs_d[None, :], acc,
                     mask=mstore[:, None] & md[None, :])
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_ptr + tok[:, None] * so_t + head[:, None] * so_h + offs_d[None, :] * so_d,
                     out.to(o_ptr.dtype.element_ty), mask=mrow[:, None] & md[None, :])
    # tokens outside every row get zeros, this program's heads of them (the output is not
    # zero-filled by a separate launch first): the graph padding (query_start_loc[B] <= t < T) from
    # the last row's first program, tokens before query_start_loc[0] (none in the engine) from the
    # first row's
    owner = qb == 0
    if SPLIT:
        owner = owner & (sp == 0)
    if owner & (b == tl.num_programs(0) - 1):
        _zero_tokens(o_ptr, tl.load(qsl_ptr + b + 1), T, kvh, G, hd, so_t, so_h, so_d, BLOCK_M, G_PAD, BLOCK_D)
    if owner & (b == 0):
        _zero_tokens(o_ptr, 0, tl.load(qsl_ptr), kvh, G, hd, so_t, so_h, so_d, BLOCK_M, G_PAD, BLOCK_D)


@triton.jit
def _zero_tokens(o_ptr, t_lo, t_hi, kvh, G, hd, so_t, so_h, so_d, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Zeros into out[t_lo:t_hi, kvh * G:(kvh + 1) * G, :hd], BLOCK_M / G_PAD tokens at a time."""
    offs_m = tl.arange(0, BLOCK_M)
    gh = offs_m % G_PAD
    offs_d = tl.arange(0, BLOCK_D)
    zero = tl.zeros([BLOCK_M, BLOCK_D], dtype=o_ptr.dtype.element_ty)
    for t0 in range(t_lo, t_hi, BLOCK_M // G_PAD):
        tok = (t0 + offs_m // G_PAD).to(tl.int64)
        m = ((tok < t_hi) & (gh < G))[:, None] & (offs_d < hd)[None, :]
        tl.store(o_ptr + tok[:, None] * so_t + (kvh * G + gh)[:, None] * so_h + offs_d[None, :] * so_d, zero, mask=m)


@triton.jit(do_not_specialize=["n_splits", "T"], do_not_specialize_on_alignment=["qsl_ptr", "sl_ptr"])
def _combine_splits_kernel(
    qsl_ptr, sl_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, n_splits, T, nH, hd, so_t, so_h, so_d,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
    ROW_SPLIT: tl.constexpr = False, BLOCK_N: tl.constexpr = 64, SPLITS_PAD: tl.constexpr = 0,
):
    # one program per (row, head, block of BLOCK_Q query tokens)
    z = pdl_enter(PDL)
    b = tl.program_id(0) + z
    h = tl.program_id(1) + z
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    n_used = n_splits
    if ROW_SPLIT:                  # only the ranges that start inside the row were stored
        seq_len = tl.load(sl_ptr + b)
        n_used = tl.minimum(n_splits, tl.cdiv(seq_len, _row_split_len(seq_len, n_splits, BLOCK_N)))
    offs_d = tl.arange(0, BLOCK_D)
    md = offs_d < hd
    if SPLITS_PAD > 0:
        # one query token (BLOCK_Q = 1) and every range's partial in one load, no loop over ranges
        tl.static_assert(BLOCK_Q == 1)
        i = tl.program_id(2) + z
        if i < q_len:
            tok = (q_start + i).to(tl.int64)
            sp = tl.arange(0, SPLITS_PAD)
            ms = sp < n_used
            pidx = (sp * T + tok) * nH + h                                             # [S] int64
            m = tl.load(pm_ptr + pidx, mask=ms, other=float("-inf"))
            m_all = tl.max(m, axis=0)
            w = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))            # 0 for empty ranges
            l_all = tl.sum(w * tl.load(pl_ptr + pidx, mask=ms, other=0.0), axis=0)
            o = tl.load(po_ptr + pidx[:, None] * BLOCK_D + offs_d[None, :], mask=ms[:, None] & md[None, :],
                        other=0.0)                                                     # [S, D]
            out = tl.sum(w[:, None] * o, axis=0) / tl.where(l_all == 0.0, 1.0, l_all)
            tl.store(o_ptr + tok * so_t + h * so_h + offs_d * so_d, out.to(o_ptr.dtype.element_ty), mask=md)
    else:
        offs_i = (tl.program_id(2) + z) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        mi = offs_i < q_len
        tok = (q_start + offs_i).to(tl.int64)
        m_all = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        for sp in range(0, n_used):
            m = tl.load(pm_ptr + (sp * T + tok) * nH + h, mask=mi, other=float("-inf"))
            m_all = tl.maximum(m_all, m)
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        l_all = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
        for sp in range(0, n_used):
            pidx = (sp * T + tok) * nH + h
            m = tl.load(pm_ptr + pidx, mask=mi, other=float("-inf"))
            w = tl.exp2(m - m_safe)                                  # 0 for empty splits
            l_all += w * tl.load(pl_ptr + pidx, mask=mi, other=0.0)
            o = tl.load(po_ptr + pidx[:, None] * BLOCK_D + offs_d[None, :],
                        mask=mi[:, None] & md[None, :], other=0.0)
            acc += w[:, None] * o
        out = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
        tl.store(o_ptr + tok[:, None] * so_t + h * so_h + offs_d[None, :] * so_d,
                 out.to(o_ptr.dtype.element_ty), mask=mi[:, None] & md[None, :])


def _combine_in_one_load(nqb: int, n_splits: int, BLOCK_D: int, Qm: int) -> bool:
    """Whether the split combine reads each query token's ranges in one load (one token a program)
    rather than one range a loop step (up to 32 tokens a program). One load for decode rows and
    for verify rows with more than 8 ranges, while the partials fit (16384 values: 128 registers a
    thread at 4 warps); the loop for prefill tiles (nqb > 1) and verify rows with few ranges (H200,
    2026-11-28, 8B, 4 query tokens, 8000 keys: batch 8 = 5 ranges 93.2 us looped against 97.2 in
    one load, batch 4 = 9 ranges 57.9 / 57.4, batch 1 = 33 ranges 30.2 / 21.9; one query token at
    batch 8: 91.6 / 92.3; benchmarks/results/2026-11-28-attn-decode-row-split-h200.md)."""
    return nqb == 1 and next_pow2(n_splits) * BLOCK_D <= 16384 and (Qm == 1 or n_splits > 8)


def triton_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                           max_query_len: int, max_seq_len: int, *, k_scale=None, v_scale=None,
                           block_n=None, num_warps=None, num_splits=None, num_stages=None, block_q=None):
    """Same arguments and result as ``paged_attention_ref`` (``k_scale`` / ``v_scale``: [] float32
    device tensors for an FP8 cache, read inside the kernel; None for a 16/32-bit cache).

    Decode / verify batches too small to fill the GPU (rows x kv heads < number of SMs) split
    each row's keys into up to 64 ranges of cdiv(its length, ranges) keys, rounded up to the key
    tile (at most one range per 128 positions of ``max_seq_len``; flash-decoding), and combine
    the partial softmax results in a second launch. A 16-bit prefill with fewer query tiles than
    SMs (one request's short chunk after a long context) splits each row's keys by the row's own
    length into at most 8 ranges and at most one per 512 positions of ``max_seq_len``.
    ``num_splits`` overrides the choice (1 = no split; a decode row's ranges are then cut from
    ``max_seq_len``); ``block_q`` (query tokens per tile), ``block_n``, ``num_warps`` and
    ``num_stages`` override the tile configuration (sweeps).
    """
    T, nH, hd = q.shape
    NB, bs, nkv, _ = k_cache.shape
    B = block_tables.shape[0]
    Qm = max(int(max_query_len), 0)
    Sm = int(max_seq_len)
    if T == 0 or B == 0 or Qm == 0 or Sm <= 0:
        return torch.zeros_like(q)
    # every token is written by the kernels, tokens outside the rows zeros (``_zero_tokens``): no
    # fill launch, a torch kernel that broke the PDL chain before each layer's attention. (A row
    # longer than max_query_len, which the contract rules out, would leave tokens unwritten)
    out = torch.empty_like(q)
    G = nH // nkv
    G_PAD = next_pow2(G)
    kv_fp8 = k_scale is not None
    BLOCK_D = max(16, next_pow2(hd))
    # 16-bit prefill tiles over a 16-bit cache, head dim <= 128: 128 query rows x heads by 32 keys,
    # 4 warps (H100 sweep, 2026-11-27, benchmarks/attn_prefill_sweep.py: 259 us against 287 us of
    # the 64 x 64 tiles for a 2352-token prompt; with key splits 71 against 113 us for 304 tokens
    # after 2048). FP8 caches and float32 keep the 64-row tiles they were checked with.
    wide = not kv_fp8 and q.dtype != torch.float32 and BLOCK_D <= 128 and Qm > 16
    if block_q is not None:
        BLOCK_Q = next_pow2(block_q)
    elif Qm <= 16:                     # decode / verify rows: one tile covers the whole row
        BLOCK_Q = next_pow2(Qm)
    else:                              # prefill chunks: 64 (128 when wide) query rows x heads per tile
        BLOCK_Q = max(1, (128 if wide else 64) // G_PAD)
    BLOCK_Q = max(BLOCK_Q, -(-16 // G_PAD))          # tl.dot needs M >= 16
    BLOCK_N = block_n or (32 if wide or BLOCK_D > 128 else 64)
    nw = num_warps or (4 if wide or BLOCK_Q * G_PAD <= 64 else 8)
    # FP8 tiles with 16-bit queries are converted in registers before each dot, so they miss the
    # 16-bit tiles' load pipelining; a 2-deep pipeline and twice the key-range splits at small
    # batches hide that best (H200 sweep, 2026-11-26, benchmarks/results/2026-11-26-fp8-kv-cache-h200.md).
    # float32 queries (tests and references, not serving) keep the default tiles: not swept.
    fp8_tiles = kv_fp8 and q.dtype != torch.float32
    if fp8_tiles and num_stages is None:
        num_stages = 2
    prec = F32_DOT_PRECISION if q.dtype == torch.float32 else "tf32"
    qsl = query_start_loc.to(q.device)
    sl = seq_lens.to(q.device)
    nqb = cdiv(Qm, BLOCK_Q)

    n_splits = 1
    programs = B * nkv * nqb
    sms = num_sms(q.device)
    if num_splits is not None:
        n_splits = max(1, int(num_splits))
    elif nqb == 1 and programs < sms:
        # about two programs per SM. float32 tiles take twice the shared memory (likely two fit an
        # SM; occupancy not measured), so they round down (a few programs more would wait a whole
        # range, the ranges being equal); 16-bit tiles round up (H200, 2026-11-28, batch 8, 8000 keys:
        # bench-large float32 137 us down / 160 up, 8B bf16 105 / 94;
        # benchmarks/results/2026-11-28-attn-decode-row-split-h200.md)
        two_per_sm = 2 * sms
        n_splits = max(1, min(two_per_sm // programs if q.dtype == torch.float32 else cdiv(two_per_sm, programs),
                              cdiv(Sm, 128), 64))
        if fp8_tiles and n_splits < 16:  # same sweep: twice the splits at 8 rows (5 -> 10)
            n_splits = min(2 * n_splits, cdiv(Sm, 128), 64)
    elif nqb > 1 and wide and programs < sms:
        # the most splits whose programs still fit two to an SM (same sweep: 3 splits for 80 tiles)
        n_splits = max(1, min(2 * sms // programs, cdiv(Sm, 512), 8))
    # the rule's ranges are cut from each row's own length (ROW_SPLIT, module docstring); explicit
    # counts on decode rows cut them from the bound (split_len, passed to the kernel)
    row_split = nqb > 1 or num_splits is None
    split_len = cdiv(cdiv(Sm, n_splits), BLOCK_N) * BLOCK_N
    if not row_split:
        n_splits = cdiv(Sm, split_len)
    split = n_splits > 1
    if split:
        pm = torch.empty((n_splits, T, nH), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        po = torch.empty((n_splits, T, nH, BLOCK_D), dtype=torch.float32, device=q.device)
    else:
        pm = pl = po = out
    grid = (B, nkv, nqb * n_splits)
    with device_ctx(q):
        _paged_attn_kernel[grid](
            q, k_cache, v_cache, qsl, sl, block_tables, out, po, pm, pl, k_scale, v_scale,
            float(scale) * 1.4426950408889634, G, hd, bs, split_len, n_splits, T, nH,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
            *out.stride(),
            PREC=prec, SPLIT=split, BLOCK_Q=BLOCK_Q, G_PAD=G_PAD, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D, KV_FP8=kv_fp8, ROW_SPLIT=split and row_split, num_warps=nw, **pdl_kwargs(q.device),
            **({} if num_stages is None else {"num_stages": num_stages}),
        )
        if split:
            pad = next_pow2(n_splits)
            one = _combine_in_one_load(nqb, n_splits, BLOCK_D, Qm)
            cq = 1 if one else min(next_pow2(Qm), 32)
            _combine_splits_kernel[(B, nH, cdiv(Qm, cq))](
                qsl, sl, out, po, pm, pl, n_splits, T, nH, hd, *out.stride(),
                BLOCK_Q=cq, BLOCK_D=BLOCK_D, ROW_SPLIT=row_split, BLOCK_N=BLOCK_N,
                SPLITS_PAD=pad if one else 0, num_warps=4,
                **pdl_kwargs(q.device),
            )
    return out
