"""Step 3 of the chunked SSD scan (``triton_ssd``): the states passed between a sequence's chunks.

``_state_pass_kernel``: one program per (sequence, head, state tile), sequential over the
sequence's chunks: h_in(c) = h; h = exp(cum_last_c) h + S_c, starting from the initial state; the
final state is written out. ``POOLED``: the initial state is read at the sequence's pool slot
(zeros where it starts fresh) and the final state written back there (init and final are the
same pool view; the program reads its tile before it writes it, slots are distinct); a row on
NULL_SLOT starts from zeros and stores nothing (the pool contract). h_in is stored in the dtype the chunk-output dots take (in place over
S_c when that is float32); ``STORE32`` also keeps the float32 entry state in S for the prefix-cache
emits (``triton_ssd_emit``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv


@triton.jit
def start_state(init_ptr, slot_ptr, has_init_ptr, b, h, offs_p, offs_n, m2, si_b, si_h, si_p, si_n,
                BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, POOLED: tl.constexpr, NULL: tl.constexpr):
    """(state [BLOCK_P, BLOCK_N] float32, row, store mask) of sequence b's start: row b of
    init, or with ``POOLED`` (init a [S, H, P, N] pool view) its slot's state, zeros where it
    starts fresh or sits on NULL_SLOT (whose final state is then not stored: the mask).
    Shared by ``_state_pass_kernel`` and the fused pass (``triton_ssd_fused_pass``)."""
    m_out = m2
    if POOLED:      # [S, H, P, N] pool view: row b's slot
        row = tl.load(slot_ptr + b).to(tl.int64)
        m_out = m2 & ((tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.int64) + row) != NULL)
    else:
        row = b.to(tl.int64)
    st = tl.load(init_ptr + row * si_b + h * si_h + offs_p[:, None] * si_p
                 + offs_n[None, :] * si_n, mask=m2, other=0.0).to(tl.float32)
    if POOLED:      # a fresh start (or NULL_SLOT) is zeros, whatever the slot holds (a select: a stale NaN stays out)
        st = tl.where((tl.load(has_init_ptr + b) != 0) & (row != NULL), st, 0.0)
    return st, row, m_out


@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "has_init_ptr"])
def _state_pass_kernel(
    S_ptr, hin_ptr, cuma_ptr, cum_ptr, init_ptr, final_ptr, slot_ptr, has_init_ptr,
    H, P, N, n_nblocks,
    si_b, si_h, si_p, si_n, sf_b, sf_h, sf_p, sf_n,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE32: tl.constexpr = False, POOLED: tl.constexpr = False, NULL: tl.constexpr = 0,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2) // n_nblocks
    nb = tl.program_id(2) % n_nblocks
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    m2 = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    cum_b = tl.load(cum_ptr + b)
    first = tl.load(cum_ptr + b - 1, mask=b > 0, other=0)
    st, row, m_out = start_state(init_ptr, slot_ptr, has_init_ptr, b, h, offs_p, offs_n, m2, si_b, si_h, si_p,
                                 si_n, BLOCK_P, BLOCK_N, POOLED, NULL)
    tile = offs_p[:, None] * N + offs_n[None, :]
    # two-stage software pipeline: chunk c+1's partial state and decay are loaded while chunk c
    # is processed (the chain h -> h' is latency-bound otherwise)
    # (prefetch rows are clamped into [first, cum_b - 1], never masked: always valid memory)
    r0 = tl.maximum(tl.minimum(first, cum_b - 1), 0)
    prow = (r0 * H + h).to(tl.int64)
    s_nxt = tl.load(S_ptr + prow * P * N + tile, mask=m2, other=0.0)
    d_nxt = tl.load(cuma_ptr + prow * BLOCK_L + BLOCK_L - 1)
    for c in range(first, cum_b):
        crow = (c * H + h).to(tl.int64)
        s_c = s_nxt
        dec = tl.exp(d_nxt)     # chunk length >= 1; padded positions repeat the last cumsum
        nrow = (tl.minimum(c + 1, cum_b - 1) * H + h).to(tl.int64)
        s_nxt = tl.load(S_ptr + nrow * P * N + tile, mask=m2, other=0.0)
        d_nxt = tl.load(cuma_ptr + nrow * BLOCK_L + BLOCK_L - 1)
        # the state entering chunk c (hin may alias S: S_c is already in registers)
        tl.store(hin_ptr + crow * P * N + tile, st.to(hin_ptr.dtype.element_ty), mask=m2)
        if STORE32:     # prefix-cache emits: the float32 entry state too, in place over S_c (in registers)
            tl.store(S_ptr + crow * P * N + tile, st, mask=m2)
        st = dec * st + s_c
    tl.store(final_ptr + row * sf_b + h * sf_h + offs_p[:, None] * sf_p
             + offs_n[None, :] * sf_n, st, mask=m_out)


def launch_state_pass(S, hin, cuma, cum, initial_states, final, state_indices, has_init, Bn: int,
                      BLOCK_L: int, BLOCK_P: int, BLOCK_N: int, store32: bool, pooled: bool, null_slot: int):
    """Step 3 for every sequence (``fused_pass=False``): S [NC, H, P, N] the chunk states from
    zero (step 2), hin the chunk-entry states out (S itself when float32), the final states into
    ``final`` (the pool view with ``pooled``: state_indices / has_init [Bn] uint8)."""
    _, H, P, N = S.shape
    BN_PASS = min(BLOCK_N, 64)
    BP_PASS = max(1, min(BLOCK_P, 1024 // BN_PASS))
    nnb = cdiv(N, BN_PASS)
    _state_pass_kernel[(Bn, H, cdiv(P, BP_PASS) * nnb)](
        S, hin, cuma, cum, initial_states, final,
        state_indices if pooled else cum, has_init if pooled else cum, H, P, N, nnb,
        *initial_states.stride(), *final.stride(),
        BLOCK_L=BLOCK_L, BLOCK_P=BP_PASS, BLOCK_N=BN_PASS, STORE32=store32,
        POOLED=pooled, NULL=null_slot, num_warps=4,
    )
