"""Causal depthwise conv1d over packed variable-length sequences, and its decode/verify update.

Contract: ``mamba_cache/ops/CONTRACT.md`` items 1 and 2.  Both ops read and write the pool tensor
``conv_state [S, C, W-1+K]`` in place; rows whose slot is ``NULL_SLOT`` never change it.
The torch references below are vectorised (no Python loop driven by device values, no host sync),
so they run unchanged on CUDA tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_engine.mamba_cache import NULL_SLOT


def token_seq_index(query_start_loc: torch.Tensor, num_tokens: int):
    """Map packed tokens to their sequence, without a host sync.

    query_start_loc [B+1] (non-decreasing; empty sequences allowed) -> (seq [T] int64 in 0..B-1,
    pos [T] int64 position inside its sequence, valid [T] bool).  Tokens at or past
    query_start_loc[B] (padding) get valid=False, seq clamped to B-1 and an unspecified pos.
    """
    qsl = query_start_loc.long()                                         # [B+1]
    t = torch.arange(num_tokens, device=qsl.device)                      # [T]
    seq = torch.searchsorted(qsl[1:].contiguous(), t, right=True)        # [T] in 0..B
    valid = seq < qsl.numel() - 1
    seq = seq.clamp(max=qsl.numel() - 2)
    pos = t - qsl[seq]
    return seq, pos, valid


def _conv_gather_index(seq, pos, qsl, num_seqs: int, width: int):
    """Rows of ``ext = cat(windows [B*(W-1), C], x [T, C])`` feeding each tap.

    seq, pos [M] (sequence and position of the output token; pos may be < 0 only down to -(W-1))
    -> idx [M, W]: tap w reads the input at position pos-(W-1)+w of that sequence; negative
    positions read column W-1+q of the sequence's initial window.
    """
    wm1 = width - 1
    q = pos[:, None] - wm1 + torch.arange(width, device=pos.device)      # [M, W] source position
    from_x = num_seqs * wm1 + qsl[seq][:, None] + q                      # packed token row
    from_win = seq[:, None] * wm1 + wm1 + q                              # window row
    return torch.where(q >= 0, from_x, from_win)                         # [M, W]


def _conv_apply(taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """taps [..., C, W] (any float dtype) -> silu(bias + sum_w weight[:, w] * taps[..., w]) f32."""
    out = (taps.float() * weight.float()).sum(-1)                        # [..., C]
    if bias is not None:
        out = out + bias.float()
    return F.silu(out)


def causal_conv1d_varlen_ref(
    x: torch.Tensor,                    # [T, C] packed tokens, model dtype
    weight: torch.Tensor,               # [C, W]
    bias: torch.Tensor | None,          # [C] or None
    conv_state: torch.Tensor,           # [S, C, W-1+K] pool, modified in place
    query_start_loc: torch.Tensor,      # [B+1] int32/int64
    state_indices: torch.Tensor,        # [B] pool slots (NULL_SLOT rows: no state write)
    has_initial_state: torch.Tensor,    # [B] bool: start from the cached window, else zeros
) -> torch.Tensor:                      # [T, C] in x.dtype
    """Prefill conv (CONTRACT item 1), fully vectorised (gather of W taps per token).

    Sequence b's inputs are xs = cat(window_b, x_b^T) with window_b = conv_state[slot_b, :, :W-1]
    (or zeros); out_b[t] = silu(bias + sum_w weight[:, w] xs[:, t+w]); afterwards
    conv_state[slot_b, :, :W-1] = xs[:, -(W-1):] (holds for sequences shorter than W-1 and for
    empty ones too).  Tokens past query_start_loc[B] get unspecified output.
    """
    T, Cdim = x.shape
    W = weight.shape[-1]
    wm1 = W - 1
    Bn = state_indices.shape[0]
    qsl = query_start_loc.to(x.device).long()
    slots = state_indices.long()                                         # [B]
    seq, pos, _ = token_seq_index(qsl, T)

    old_win = conv_state[slots, :, :wm1]                                 # [B, C, W-1] (a copy)
    win = torch.where(has_initial_state.bool()[:, None, None], old_win, torch.zeros_like(old_win))
    ext = torch.cat([win.transpose(1, 2).reshape(Bn * wm1, Cdim),
                     x.to(conv_state.dtype)], dim=0)                     # [B*(W-1)+T, C]

    idx = _conv_gather_index(seq, pos, qsl, Bn, W)                       # [T, W]
    out = _conv_apply(ext[idx].transpose(1, 2), weight, bias)            # [T, C]

    if wm1 > 0 and Bn > 0:
        # new window column j = input at position L_b-(W-1)+j of sequence b
        seq_b = torch.arange(Bn, device=qsl.device)
        lens = qsl[1:] - qsl[:-1]                                        # [B]
        sidx = _conv_gather_index(seq_b, lens - 1, qsl, Bn, W)[:, 1:]    # [B, W-1]
        new_win = ext[sidx].transpose(1, 2)                              # [B, C, W-1]
        keep = (slots == NULL_SLOT)[:, None, None]
        conv_state[slots, :, :wm1] = torch.where(keep, old_win, new_win)
    return out.to(x.dtype)


def conv_windows_at(
    x: torch.Tensor,                    # [T, C] packed conv inputs of the step's prefill rows
    initial_windows: torch.Tensor,      # [M, C, W-1] window each emit's sequence started from (zeros if none)
    query_start_loc: torch.Tensor,      # [B+1] int64
    seq: torch.Tensor,                  # [M] int64 sequence of each emit
    token: torch.Tensor,                # [M] int64 packed index of the last token before the boundary
) -> torch.Tensor:                      # [M, C, W-1] in initial_windows.dtype
    """The conv window after ``token`` (prefix-cache checkpoints): the W-1 inputs ending at it,
    taken from the packed inputs, or from the sequence's initial window where they precede the
    chunk. A gather of what the prefill conv reads anyway; no recomputation."""
    M, wm1 = token.numel(), initial_windows.shape[-1]
    qsl = query_start_loc.long()
    pos = token - qsl[seq]                                               # [M] position in its chunk
    src = pos[:, None] - (wm1 - 1) + torch.arange(wm1, device=pos.device)   # [M, W-1] source positions
    from_x = x[(qsl[seq][:, None] + src).clamp(min=0)].to(initial_windows.dtype)   # [M, W-1, C]
    from_win = initial_windows.gather(2, (wm1 + src).clamp(0, wm1 - 1)[:, None, :].expand(
        M, initial_windows.shape[1], wm1))                               # [M, C, W-1]
    return torch.where((src >= 0)[:, None, :], from_x.transpose(1, 2), from_win)


def causal_conv1d_update_ref(
    x: torch.Tensor,                    # [N, s, C] decode/verify tokens (s = 1 + drafts)
    weight: torch.Tensor,               # [C, W]
    bias: torch.Tensor | None,          # [C] or None
    conv_state: torch.Tensor,           # [S, C, W-1+K] pool, modified in place
    state_indices: torch.Tensor,        # [N] pool slots (NULL_SLOT rows: no state write)
    num_accepted: torch.Tensor,         # [N] accepted count of the previous step, >= 1
) -> torch.Tensor:                      # [N, s, C] in x.dtype
    """Decode / verify conv with the lazy shift (CONTRACT item 2).

    off = num_accepted-1; window = conv_state[slot, :, off:off+W-1]; xs = cat(window, x^T);
    out[t] = silu(bias + sum_w weight[:, w] xs[:, t+w]); then conv_state[slot, :, :W-2+s] = xs[:, 1:].
    The whole buffer row is read (copied) before anything is written.  Requires 1 <= s <= 1+K.
    """
    N, s, Cdim = x.shape
    W = weight.shape[-1]
    wm1 = W - 1
    ncols = conv_state.shape[-1]
    assert 1 <= s and W - 2 + s <= ncols, "need 1 <= s <= 1+K"
    slots = state_indices.long()                                         # [N]
    buf = conv_state[slots]                                              # [N, C, W-1+K] (a copy)

    off = num_accepted.long() - 1                                        # [N]
    cols = (off[:, None] + torch.arange(wm1, device=off.device)).clamp(0, ncols - 1)  # [N, W-1]
    window = buf.gather(2, cols[:, None, :].expand(N, Cdim, wm1))        # [N, C, W-1]
    xs = torch.cat([window, x.transpose(1, 2).to(buf.dtype)], dim=2)     # [N, C, W-1+s]

    out = _conv_apply(xs.unfold(2, W, 1).transpose(1, 2), weight, bias)  # [N, s, C]

    nw = W - 2 + s                                                       # columns written
    if nw > 0:
        keep = (slots == NULL_SLOT)[:, None, None]
        conv_state[slots, :, :nw] = torch.where(keep, buf[:, :, :nw], xs[:, :, 1:])
    return out.to(x.dtype)


def causal_conv1d_varlen(x, weight, bias, conv_state, query_start_loc, state_indices,
                         has_initial_state):
    """Public entry point (CONTRACT item 1): Triton kernel on CUDA, torch reference elsewhere."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("causal_conv1d_varlen", x.device) == "triton":
        from hybrid_engine.mamba_cache.ops.triton_conv import triton_causal_conv1d_varlen
        return triton_causal_conv1d_varlen(x, weight, bias, conv_state, query_start_loc,
                                           state_indices, has_initial_state)
    return causal_conv1d_varlen_ref(x, weight, bias, conv_state, query_start_loc, state_indices,
                                    has_initial_state)


def causal_conv1d_update(x, weight, bias, conv_state, state_indices, num_accepted):
    """Public entry point (CONTRACT item 2): Triton kernel on CUDA, torch reference elsewhere."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("causal_conv1d_update", x.device) == "triton":
        from hybrid_engine.mamba_cache.ops.triton_conv_update import triton_causal_conv1d_update
        return triton_causal_conv1d_update(x, weight, bias, conv_state, state_indices,
                                           num_accepted)
    return causal_conv1d_update_ref(x, weight, bias, conv_state, state_indices, num_accepted)


def conv_windows_before_ref(
    x: torch.Tensor,                    # [T, C] packed conv inputs of the step's prefill rows
    conv_state: torch.Tensor,           # [S, C, W-1+K] pool, before the varlen conv updates it
    width: int,                         # W, the conv kernel width
    query_start_loc: torch.Tensor,      # [B+1] prefill rows' token offsets
    state_indices: torch.Tensor,        # [B] pool slots of the prefill rows
    has_initial_state: torch.Tensor,    # [B] bool: the row continues the window in its slot
    seq: torch.Tensor,                  # [M] int64 prefill row of each emit
    token: torch.Tensor,                # [M] int64 packed index of the last token before the boundary
) -> torch.Tensor:                      # [M, C, W-1] in conv_state.dtype
    """``conv_windows_at`` with each emit's initial window read from the pool (zeros where its
    row starts fresh). Call it before ``causal_conv1d_varlen``, which rewrites those windows."""
    win0 = conv_state[state_indices[seq], :, :width - 1]
    win0 = torch.where(has_initial_state[seq].view(-1, 1, 1), win0, 0.0)   # stale NaN * 0 would be NaN
    return conv_windows_at(x, win0, query_start_loc, seq, token)


def check_windows_out(out, out_rows, dtype: torch.dtype, M: int, C: int, wm1: int) -> None:
    """``conv_windows_before``'s rules for ``out`` / ``out_rows`` (kernel and reference alike): out
    [M, C, W-1] in the pool's dtype, or with ``out_rows`` a contiguous [M] an [R, C, W-1] out."""
    rows = out_rows is not None
    if out is None:
        if rows:
            raise ValueError("conv_windows_before: out_rows needs out")
        return
    if out.shape[1:] != (C, wm1) or (not rows and out.shape[0] != M) or out.dtype != dtype:
        raise ValueError(f"conv_windows_before: out must be {dtype} {('R' if rows else M, C, wm1)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if rows and (out_rows.shape != (M,) or out_rows.stride(0) != 1):
        raise ValueError(f"conv_windows_before: out_rows must be a contiguous [{M}], got {tuple(out_rows.shape)}")


def conv_windows_before(x, conv_state, width, query_start_loc, state_indices, has_initial_state, seq, token,
                        out=None, out_rows=None):
    """Public entry point (CONTRACT item 3, prefix-cache windows): Triton kernel on CUDA, torch
    reference elsewhere. With ``out`` [R, C, W-1] and ``out_rows`` [M]: window m is written to
    ``out[out_rows[m]]`` (the checkpoint rows; the kernel stores there directly) and ``out`` is
    returned."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("conv_windows_before", x.device) == "triton":
        from hybrid_engine.mamba_cache.ops.triton_conv_windows import triton_conv_windows_before
        return triton_conv_windows_before(x, conv_state, width, query_start_loc, state_indices,
                                          has_initial_state, seq, token, out=out, out_rows=out_rows)
    check_windows_out(out, out_rows, conv_state.dtype, token.numel(), x.shape[-1], int(width) - 1)
    win = conv_windows_before_ref(x, conv_state, width, query_start_loc, state_indices, has_initial_state,
                                  seq, token)
    if out is None:
        return win
    if out_rows is None:
        return out.copy_(win)
    out[out_rows] = win
    return out
