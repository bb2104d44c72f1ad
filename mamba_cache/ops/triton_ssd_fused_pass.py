"""Steps 2 and 3 of the chunked SSD scan (``triton_ssd``) in one launch.

``_chunk_pass_kernel``: one program per (sequence, head, head_dim block) walks the sequence's
chunks in order; per chunk it stores the entry state h_in(c) = h, computes the state the chunk
produces from zero, S_c = sum_k (x_k w_k)^T B_k with w_k = exp(cum_last - cum_k) dt_k (the same
K steps and dots as ``triton_ssd_state._chunk_state_kernel``), and moves on with
h = exp(cum_last) h + S_c (as ``triton_ssd_pass._state_pass_kernel``). The final state is written
out (to the pool slot with ``POOLED``, with its NULL_SLOT and fresh-start rules).

Why: the two kernels wrote every chunk's float32 S_c to memory and read it back (4 MB a chunk at
the 8B shape's 128 heads x 64 x 128) and cost a second launch. Fused, S_c never leaves registers.
The chunks of one sequence are then computed one after another instead of in parallel, yet on an
H100 (8B shape, bf16, ``benchmarks/ssd_fused_pass.py``, 2026-11-28) the whole scan was faster
at every length measured, one sequence of 128 to 8192 tokens (1.00-1.15x; 64 chunks: 782 ->
682 us) and batches of 8 x 300, 32 x 200, 4 x 2048, 2 x 4096 (1.07-1.19x).

It is the default (``FUSED_PASS_DEFAULT``); ``fused_pass=False`` runs the two kernels. With fewer
heads (the Nano shape's 64, or the 8B shape over 2 GPUs) one sequence gives 128 programs of 32
columns, fewer than an H100's 132 SMs, and the default blocks were slower than the two kernels
there (Nano shape, one 8192-token sequence: 451.5-452.5 vs 412.9-424.2 us in two runs; 2048
tokens 141.9-142.8 vs 129.9-130.4);
such launches take 16-column blocks (``_FUSED_NARROW``), and their emits go to the emit kernel. Two or more sequences of 64 heads were
faster fused with the default blocks (2 x 4096 1.13x, 8 x 300 1.13x, 32 x 200 1.16x).

h_in is stored in the dtype the chunk-output dots take; ``STORE32`` also stores the float32 entry
state into ``h32`` for the prefix-cache emits (``triton_ssd_emit``). With ``EMITS``
(``fused_emits``) the kernel stores the emits itself instead, from the float32 entry state in its
registers, with the emit kernel's sums and K steps (bit-identical to it under the interpreter at
the default P block of 32). The kernel takes ``emit_at`` sorted (non-decreasing packed token
indices): each program binary-searches its sequence's first emit and walks the rest once.
``launch_chunk_pass`` sorts them on the device unless the caller says they are (``emits_sorted``: the
engine's checkpoint saves are).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, next_pow2, num_sms
from hybrid_engine.mamba_cache.ops.triton_ssd_emit import emit_partial, emit_precision
from hybrid_engine.mamba_cache.ops.triton_ssd_pass import start_state
from hybrid_engine.mamba_cache.ops.triton_ssd_state import chunk_state_tile

FUSED_PASS_DEFAULT = True
# the emits inside the fused pass (``fused_emits``), except on narrow launches (``_FUSED_NARROW``):
# with the default blocks faster than the emit kernel in every row measured on an H100 (2026-11-28, benchmarks/ssd_fused_pass.py, one 8B-shape layer, bf16: 1 x 256
# 64.1 -> 56.9 us, 8 x 300 287.0 -> 267.2, 32 x 200 857.7 -> 845.0, 1 x 8192 with an emit every
# 1024 tokens 741.7 -> 672.1; Nano shape 1 x 8192 452.5 -> 399.8). The emitting variant compiles
# to more registers (255 vs 167 for sm_90, 8B, bf16, pooled); each program finds its sequence's
# first emit by binary search and walks its emits once (a scan of all M emits a chunk had made
# 32 x 200 slower, 1015 us)
FUSED_EMITS_DEFAULT = True


@triton.jit(do_not_specialize=["num_emits"],
            do_not_specialize_on_alignment=["slot_ptr", "has_init_ptr", "emit_ptr", "erow_ptr"])
def _chunk_pass_kernel(
    x_ptr, B_ptr, meta_ptr, dtc_ptr, cuma_ptr, cum_ptr, hin_ptr, h32_ptr,
    init_ptr, final_ptr, slot_ptr, has_init_ptr, emit_ptr, eout_ptr, erow_ptr,
    H, P, N, nheads_per_group, num_emits,
    sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
    si_b, si_h, si_p, si_n, sf_b, sf_h, sf_p, sf_n,
    PREC: tl.constexpr, LOWP: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE32: tl.constexpr = False, POOLED: tl.constexpr = False, NULL: tl.constexpr = 0,
    EMITS: tl.constexpr = False, OUT_ROWS: tl.constexpr = False, EMIT_K: tl.constexpr = 32,
    EMIT_PREC: tl.constexpr = "ieee",
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
    cum_b = tl.load(cum_ptr + b)
    first = tl.load(cum_ptr + b - 1, mask=b > 0, other=0)
    st, row, m_out = start_state(init_ptr, slot_ptr, has_init_ptr, b, h, offs_p, offs_n, m2, si_b, si_h, si_p,
                                 si_n, BLOCK_P, BLOCK_N, POOLED, NULL)
    tile = offs_p[:, None] * N + offs_n[None, :]
    m = tl.zeros([], dtype=tl.int64)        # EMITS: the next emit to look at (emits are sorted by token)
    if EMITS:       # binary search for this sequence's first emit, then walk its emits once, chunk by chunk
        seq_start = tl.load(meta_ptr + first * 2, mask=first < cum_b, other=0).to(tl.int64)   # (no chunks: no loop)
        hi = tl.zeros([], dtype=tl.int64) + num_emits
        while m < hi:
            mid = (m + hi) // 2
            below = tl.load(emit_ptr + mid).to(tl.int64) < seq_start
            m = tl.where(below, mid + 1, m)
            hi = tl.where(below, hi, mid)
    for c in range(first, cum_b):
        crow = (c * H + h).to(tl.int64)
        tl.store(hin_ptr + crow * P * N + tile, st.to(hin_ptr.dtype.element_ty), mask=m2)
        if STORE32:
            tl.store(h32_ptr + crow * P * N + tile, st, mask=m2)
        clen = tl.load(meta_ptr + c * 2 + 1)
        cstart = tl.load(meta_ptr + c * 2).to(tl.int64)
        lrow = crow * BLOCK_L
        acc = chunk_state_tile(x_ptr, B_ptr, dtc_ptr, cuma_ptr, lrow, cstart, clen, h, g, offs_p, offs_n,
                               mp, mn, sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
                               PREC, LOWP, BLOCK_K, BLOCK_P, BLOCK_N)
        if EMITS:       # prefix-cache emits inside this chunk: h = exp(cum_i) h_in + the chunk's sum to i
            # the emits from m on that fall before the chunk's end are this chunk's (sorted; m is
            # past every earlier chunk's and sequence's); past the last emit, i is the chunk's end
            i = tl.load(emit_ptr + m, mask=m < num_emits, other=0).to(tl.int64) - cstart
            i = tl.where(m < num_emits, i, clen)
            while i < clen:
                part, cum_i = emit_partial(x_ptr, B_ptr, dtc_ptr, cuma_ptr, lrow, cstart, i, h, g, offs_p,
                                           offs_n, mp, mn, sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
                                           EMIT_K, BLOCK_P, BLOCK_N, EMIT_PREC)
                orow = m                                                    # where emit m is stored
                if OUT_ROWS:
                    orow = tl.load(erow_ptr + m).to(tl.int64)
                tl.store(eout_ptr + (orow * H + h) * P * N + tile, tl.exp(cum_i) * st + part, mask=m2)
                m += 1
                i = tl.load(emit_ptr + m, mask=m < num_emits, other=0).to(tl.int64) - cstart
                i = tl.where(m < num_emits, i, clen)
        # the chunk's total decay: cuma's padded positions repeat the last cumsum (step 1)
        st = tl.exp(tl.load(cuma_ptr + lrow + BLOCK_L - 1)) * st + acc
    tl.store(final_ptr + row * sf_b + h * sf_h + offs_p[:, None] * sf_p
             + offs_n[None, :] * sf_n, st, mask=m_out)


# lowp (16-bit dot operands) and float32 defaults: K step as the chunk-state kernel's, head_dim
# blocks of 32 (two programs a head at P = 64: 256 programs for one sequence of 128 heads). H100
# sweep at 304 tokens (12 configs of block_p 16/32/64, block_k 32/64, 4/8 warps): 66.3-68.6 us
# for the whole scan except 8 warps with 16-column blocks (71.9-75.4); no config stood out
_FUSED_DEFAULTS = dict(block_k=32, block_p=32, num_warps=4)
_FUSED_DEFAULTS_F32 = dict(_FUSED_DEFAULTS, block_k=64)
# lowp launches with fewer programs of 32 columns than the GPU has SMs (one sequence of 64 heads:
# the Nano shape, or the 8B shape over 2 GPUs; a prefill graph's pad row counts as a sequence):
# 16-column blocks double the programs. H100, Nano shape, one sequence, whole scan with one emit
# by the emit kernel (2026-11-28): 8192 tokens 454.6 -> 397.2 us (two kernels: 409.3), 2048
# tokens 140.7 -> 131.6 (129.2); of 12 configs these were the fastest at both lengths. Their
# emits are stored by the emit kernel by default (``triton_ssd``): inside these blocks they were
# slower (8192 tokens: 475.2 us, against 399.8 with the default blocks and the emits inside)
_FUSED_NARROW = dict(block_k=64, block_p=16, num_warps=8)


def narrow_launch(Bn: int, H: int, P: int, lowp: bool, device) -> bool:
    """True where the fused pass's default blocks are ``_FUSED_NARROW``'s (block options left at
    None take them; the emits then default to the emit kernel, whatever blocks are passed)."""
    return bool(lowp) and Bn * H * cdiv(P, 32) < num_sms(device)


def launch_chunk_pass(x, B, meta, dtc, cuma, cum, hin, h32, initial_states, final, state_indices,
                      has_init, Bn, prec, lowp, BLOCK_L, BLOCK_N, pooled, null_slot,
                      block_k=None, block_p=None, num_warps=None, emit_at=None, emit_out=None,
                      emit_rows=None, emits_sorted=False):
    """Steps 2 and 3 for every sequence: hin [NC, H, P, N] (the chunk-entry states in the dot
    dtype), h32 (the float32 entry states for the emits; None: not stored), the final states into
    ``final`` (the pool view with ``pooled``). With ``emit_at`` [M] the kernel also stores the
    state after each of those packed tokens into ``emit_out`` (rows ``emit_rows`` of it, or row m),
    from its float32 entry state in registers: no h32, no emit kernel; the kernel walks them in
    token order, so they are sorted here first (an argsort and gathers on the device) unless
    ``emits_sorted`` says they are. Options (None: the defaults above)."""
    H, P = x.shape[1:]
    G = B.shape[-2]
    emits = emit_at is not None and emit_at.numel() > 0
    if emits and not emits_sorted:      # the kernel walks them in token order; each keeps its row
        order = torch.argsort(emit_at, stable=True)
        emit_at, emit_rows = emit_at[order], order if emit_rows is None else emit_rows[order]
    # the blocks never depend on the emits: y and the final states of a step that saves
    # checkpoints are bit for bit those of the same step without saves
    d = _FUSED_NARROW if narrow_launch(Bn, H, P, lowp, x.device) else \
        _FUSED_DEFAULTS if lowp else _FUSED_DEFAULTS_F32
    BP = min(max(16, next_pow2(P)), max(16, next_pow2(block_p or d["block_p"])))
    BK = min(BLOCK_L, max(16, next_pow2(block_k or d["block_k"])))
    store32 = h32 is not None
    rows = emit_rows is not None
    _chunk_pass_kernel[(Bn, H, cdiv(P, BP))](
        x, B, meta, dtc, cuma, cum, hin, h32 if store32 else hin,
        initial_states, final, state_indices if pooled else cum, has_init if pooled else cum,
        emit_at if emits else cum, emit_out if emits else hin, emit_rows if (emits and rows) else cum,
        H, P, B.shape[-1], H // G, emit_at.numel() if emits else 0, *x.stride(), *B.stride(),
        *initial_states.stride(), *final.stride(),
        PREC=prec, LOWP=lowp, BLOCK_L=BLOCK_L, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=BLOCK_N,
        STORE32=store32, POOLED=pooled, NULL=null_slot, EMITS=emits, OUT_ROWS=emits and rows,
        EMIT_K=min(32, BLOCK_L), EMIT_PREC=emit_precision(x.dtype), num_warps=num_warps or d["num_warps"],
    )
