"""Prefix-cache conv windows in one Triton launch: the conv window after each saved boundary token
(its last W-1 conv inputs, reaching into the sequence's initial window in the pool where the
boundary is within W-2 tokens of the chunk's start). It reads the pool, so it runs before the
varlen conv rewrites the windows. ``conv1d.conv_windows_before_ref`` is its torch twin (a pool
gather plus ``conv_windows_at``: ~19 small launches in every Mamba layer of a saving step)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.conv1d import check_windows_out
from hybrid_engine.mamba_cache.ops.triton_common import cdiv, device_ctx, next_pow2


@triton.jit(do_not_specialize_on_alignment=["qsl_ptr", "slot_ptr", "init_ptr", "seq_ptr", "tok_ptr", "out_row_ptr"])
def _conv_windows_kernel(
    x_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr, seq_ptr, tok_ptr, out_ptr, out_row_ptr,
    Cdim, sx_t, sx_c, ss_s, ss_c, ss_k, so_m, so_c, so_k,
    WM1: tl.constexpr, BLOCK_C: tl.constexpr, OUT_ROWS: tl.constexpr = False,
):
    m = tl.program_id(0).to(tl.int64)
    orow = tl.load(out_row_ptr + m).to(tl.int64) if OUT_ROWS else m    # where window m is stored
    cb = tl.program_id(1)
    seq = tl.load(seq_ptr + m).to(tl.int64)
    q0 = tl.load(qsl_ptr + seq).to(tl.int64)
    pos = tl.load(tok_ptr + m).to(tl.int64) - q0            # the boundary token's position in its chunk
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < Cdim
    zero = tl.zeros([BLOCK_C], dtype=tl.int64)              # scalars broadcast to vectors for the masks
    init = (zero + tl.load(init_ptr + seq).to(tl.int64)) != 0   # the chunk continues a window in the pool
    for k in tl.static_range(WM1):
        src = zero + (pos - (WM1 - 1) + k)                  # < 0: before the chunk, in the old window
        from_x = tl.load(x_ptr + (q0 + src) * sx_t + c * sx_c, mask=mc & (src >= 0), other=0.0)
        from_w = tl.load(state_ptr + slot * ss_s + c * ss_c + (WM1 + src) * ss_k,
                         mask=mc & (src < 0) & init, other=0.0)
        val = tl.where(src >= 0, from_x.to(out_ptr.dtype.element_ty), from_w.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + orow * so_m + c * so_c + k * so_k, val, mask=mc)


def triton_conv_windows_before(x, conv_state, width: int, query_start_loc, state_indices,
                               has_initial_state, seq, token, out=None, out_rows=None) -> torch.Tensor:
    """Same arguments and result as ``conv_windows_before_ref`` (``out``: a [M, C, W-1] tensor of
    the pool's dtype to write, default a new one; with ``out_rows`` [M] int64, window m goes to
    ``out[out_rows[m]]`` of an [R, C, W-1] ``out``: the checkpoint rows, written in place)."""
    M, Cdim, wm1 = token.numel(), x.shape[-1], int(width) - 1
    rows = out_rows is not None
    check_windows_out(out, out_rows, conv_state.dtype, M, Cdim, wm1)
    if out is None:
        out = torch.empty((M, Cdim, wm1), dtype=conv_state.dtype, device=x.device)
    if M == 0 or wm1 == 0:
        return out
    BLOCK_C = min(1024, max(16, next_pow2(Cdim)))
    with device_ctx(x):
        _conv_windows_kernel[(M, cdiv(Cdim, BLOCK_C))](
            x, conv_state, query_start_loc, state_indices, has_initial_state, seq, token, out,
            out_rows if rows else token, Cdim, *x.stride(), *conv_state.stride(), *out.stride(),
            WM1=wm1, BLOCK_C=BLOCK_C, OUT_ROWS=rows, num_warps=4,
        )
    return out
