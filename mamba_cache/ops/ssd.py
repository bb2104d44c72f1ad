"""Mamba2 SSD scan over packed variable-length sequences (CONTRACT item 3).

Recurrence per sequence, head h (group g = h // (H // G)), state [P, N]:
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T ;  y_t = h_t C_t + D x_t
``ssd_scan_varlen_ref`` evaluates it chunk by chunk (chunks of ``chunk_size`` counted from each
sequence's start): within a chunk the quadratic "segment-sum" form, across chunks a state pass.
``ssd_scan_naive`` is the plain sequential recurrence, kept as the oracle.  All math in float32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops.conv1d import token_seq_index


def process_dt(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_limit=(0.0, math.inf)):
    """dt = clamp(softplus(dt_raw + dt_bias), *dt_limit) in float32.  dt_raw [..., H], dt_bias [H]."""
    dt = F.softplus(dt_raw.float() + dt_bias.float())
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def expand_groups(t: torch.Tensor, num_heads: int, dim: int = -2) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h takes group h // (H // G)."""
    return t.repeat_interleave(num_heads // t.shape[dim], dim=dim)


def segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> seg [..., L, L] with seg[i, j] = sum_{k=j+1..i} a_k for j <= i, -inf above.

    Built with a masked cumsum (not cumsum differences) so it is exact for long chunks; computed
    as seg^T (cumsum along the contiguous last dim) and returned as a transposed view.
    """
    L = a.shape[-1]
    ones = torch.ones(L, L, dtype=torch.bool, device=a.device)
    rep = torch.where(ones.triu(1), a[..., None, :], 0.0)              # rep[..., j, i] = a_i, i > j
    seg_t = rep.cumsum(dim=-1).masked_fill_(~ones.triu(), -math.inf)  # seg_t[..., j, i], i >= j
    return seg_t.transpose(-1, -2)


def _grid_size(qsl: torch.Tensor, num_tokens: int, chunk_size: int, max_seqlen: int | None,
               exact: bool | None = None):
    """Host ints (max_len, NC): an upper bound on the longest sequence and on the number of
    chunks sum_b ceil(L_b / chunk_size).  Exact (default when query_start_loc lives on the CPU,
    where reading it is no device sync); otherwise from T, B and the caller's max_seqlen hint."""
    Bn = qsl.numel() - 1
    if exact is None:
        exact = qsl.device.type == "cpu"
    if exact:
        lens = qsl[1:].long() - qsl[:-1].long()
        max_len = int(lens.max()) if Bn > 0 else 0
        NC = int(((lens + chunk_size - 1) // chunk_size).sum())
    else:
        max_len = num_tokens                                   # no sequence is longer than T
        NC = num_tokens // chunk_size + Bn                     # sum ceil(L_b/cs) < T/cs + B
    if max_seqlen is not None:
        max_len = min(max_len, int(max_seqlen))
    return max_len, NC


def _chunk_layout(qsl: torch.Tensor, num_tokens: int, chunk_size: int, width: int, NC: int):
    """Place packed tokens into a [NC+1, width] chunk grid (row NC is a dump for padding tokens).

    -> (row [T], col [T], first_chunk [B], num_chunks [B]).  Chunk c of sequence b is row
    first_chunk[b] + c; NC must be >= sum_b ceil(L_b / chunk_size).
    """
    seq, pos, valid = token_seq_index(qsl, num_tokens)
    lens = qsl[1:] - qsl[:-1]                                         # [B]
    num_chunks = (lens + chunk_size - 1) // chunk_size                # [B]
    first_chunk = torch.cumsum(num_chunks, 0) - num_chunks            # [B] exclusive cumsum
    row = torch.where(valid, first_chunk[seq] + pos // chunk_size, NC)
    col = torch.where(valid, pos % chunk_size, 0).clamp(max=width - 1)
    return row, col, first_chunk, num_chunks


def _to_chunks(v: torch.Tensor, row, col, NC: int, width: int) -> torch.Tensor:
    """Scatter packed v [T, ...] (float32) into zeros [NC+1, width, ...]."""
    out = v.new_zeros((NC + 1, width) + tuple(v.shape[1:]))
    out[row, col] = v
    return out


def ssd_scan_varlen_ref(
    x: torch.Tensor,                    # [T, H, P] packed tokens
    dt_raw: torch.Tensor,               # [T, H] before softplus
    dt_bias: torch.Tensor,              # [H]
    A: torch.Tensor,                    # [H] float32, already -exp(A_log)
    B: torch.Tensor,                    # [T, G, N]
    C: torch.Tensor,                    # [T, G, N]
    D: torch.Tensor,                    # [H]
    query_start_loc: torch.Tensor,      # [B+1] int32/int64, non-decreasing
    initial_states: torch.Tensor,       # [B, H, P, N] float32
    chunk_size: int,
    dt_limit=(0.0, math.inf),
    *,
    max_seqlen: int | None = None,      # optional host-side upper bound on the longest sequence
    out_dtype: torch.dtype = torch.float32,
    emit_at: torch.Tensor | None = None,  # [M] int64 packed token indices: also return the state after each
):
    """Chunked SSD scan (CONTRACT item 3) -> (y [T, H, P] out_dtype, final_states [B, H, P, N] f32),
    plus, with ``emit_at``, the states after those tokens [M, H, P, N] f32 (prefix-cache
    checkpoints: read off the chunk the token lies in, from the chunk-entry state the state pass
    already computes and that chunk's decay row; no second pass over the sequence).

    Tokens go into a grid of chunks [NC, Lc] (chunk c of sequence b at row first_chunk[b] + c,
    Lc = min(chunk_size, longest sequence)); padding positions get dt = 0 and x = B = C = 0, so
    they leave the state alone.  Intra-chunk work is batched over all chunks; the inter-chunk
    state pass loops over the chunk index j < ceil(max_len / chunk_size), updating every sequence
    at once.  Grid sizes are host ints (see ``_grid_size``): exact if query_start_loc is a CPU
    tensor, else bounded by T and B, tightened by the optional ``max_seqlen`` hint (must be >=
    every sequence length; pass it on CUDA, it cuts padded work for batches of short sequences).
    Length-0 sequences return their initial state.  Tokens past query_start_loc[B] get
    unspecified output.  No device->host sync.
    """
    T, H, P = x.shape
    G, N = B.shape[-2:]
    max_len, NC = _grid_size(query_start_loc, T, chunk_size, max_seqlen)
    qsl = query_start_loc.to(x.device).long()
    Lc = max(1, min(chunk_size, max_len))                                 # chunk grid width
    row, col, first_chunk, num_chunks = _chunk_layout(qsl, T, chunk_size, Lc, NC)

    NC1, hpg = NC + 1, H // G
    dt = process_dt(dt_raw, dt_bias, dt_limit)                            # [T, H]
    xh = _to_chunks(x.float(), row, col, NC, Lc).permute(0, 2, 1, 3)      # [NC1, H, Lc, P]
    dth = _to_chunks(dt, row, col, NC, Lc).transpose(1, 2)                # [NC1, H, Lc]
    Bg = _to_chunks(B.float(), row, col, NC, Lc).permute(0, 2, 1, 3)      # [NC1, G, Lc, N]
    Cg = _to_chunks(C.float(), row, col, NC, Lc).permute(0, 2, 1, 3)      # [NC1, G, Lc, N]

    a = dth * A.float()[:, None]                                          # [NC1, H, Lc] log decay
    decay = torch.exp(segsum(a))                                         # [NC1, H, Lc, Lc] (i, j)
    cum_in = torch.exp(torch.cumsum(a, dim=-1))                           # [NC1, H, Lc] start->i

    # intra-chunk: y_i = sum_{j<=i} decay[i,j] (C_i . B_j) dt_j x_j   (C.B once per group)
    CB = Cg @ Bg.transpose(-1, -2)                                        # [NC1, G, Lc, Lc]
    M = (decay * dth[:, :, None, :]).reshape(NC1, G, hpg, Lc, Lc) * CB[:, :, None]
    y = M.reshape(NC1, H, Lc, Lc) @ xh                                    # [NC1, H, Lc, P]
    # state each chunk produces from a zero start: S = sum_j decay[last,j] dt_j x_j B_j^T
    xw = (xh * (decay[:, :, -1, :] * dth)[..., None]).transpose(-1, -2)   # [NC1, H, P, Lc]
    S = (xw.reshape(NC1, G, hpg, P, Lc) @ Bg[:, :, None]).reshape(NC1, H, P, N)
    total = cum_in[:, :, -1]                                              # [NC1, H] chunk decay

    # inter-chunk state pass: h_prev[c] = state entering chunk c
    h = initial_states.float().clone()                                    # [B, H, P, N]
    h_prev = torch.zeros_like(S)                                          # [NC1, H, P, N]
    for j in range(-(-max_len // chunk_size)):
        live = j < num_chunks                                             # [B]
        c = torch.where(live, first_chunk + j, NC)                        # [B] (NC = dump row)
        h_prev[c] = h
        h = torch.where(live[:, None, None, None], total[c][:, :, None, None] * h + S[c], h)

    # y_i += exp(cum a up to i) * h_prev C_i
    hp_t = h_prev.reshape(NC1, G, hpg, P, N).transpose(-1, -2)            # [NC1, G, hpg, N, P]
    y = y + (Cg[:, :, None] @ hp_t).reshape(NC1, H, Lc, P) * cum_in[..., None]
    y = y[row, :, col] + D.float()[:, None] * x.float()                  # [T, H, P]
    if emit_at is None:
        return y.to(out_dtype), h
    # the state after token i of chunk r: exp(cum a up to i) h_prev[r] + sum_{j<=i} decay[i, j] dt_j x_j B_j^T
    # (for i = the chunk's last token this is the state pass's own update, term for term)
    r, i = row[emit_at], col[emit_at]                                     # [M]
    M = r.numel()
    xw_e = (xh[r] * (decay[r, :, i, :] * dth[r])[..., None]).transpose(-1, -2)   # [M, H, P, Lc]
    S_e = (xw_e.reshape(M, G, hpg, P, Lc) @ Bg[r][:, :, None]).reshape(M, H, P, N)
    states = cum_in[r, :, i][:, :, None, None] * h_prev[r] + S_e
    return y.to(out_dtype), h, states


def ssd_scan_naive(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, initial_states,
                   chunk_size: int | None = None, dt_limit=(0.0, math.inf)):
    """Oracle: the sequential recurrence, one token at a time, float32 (chunk_size is ignored).

    Same arguments and results as ``ssd_scan_varlen_ref``.  Reads query_start_loc on the host
    (syncs): for tests only, never on the step path.
    """
    T, H, P = x.shape
    dt = process_dt(dt_raw, dt_bias, dt_limit)                            # [T, H]
    Bh, Ch = expand_groups(B.float(), H), expand_groups(C.float(), H)    # [T, H, N]
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    finals = initial_states.float().clone()                               # [B, H, P, N]
    qsl = query_start_loc.tolist()
    for b in range(len(qsl) - 1):
        h = finals[b]                                                     # [H, P, N]
        for t in range(qsl[b], qsl[b + 1]):
            dA = torch.exp(dt[t] * A.float())                             # [H]
            h = dA[:, None, None] * h + (dt[t][:, None] * x[t].float())[:, :, None] * Bh[t][:, None, :]
            y[t] = torch.einsum("hpn,hn->hp", h, Ch[t]) + D.float()[:, None] * x[t].float()
        finals[b] = h
    return y, finals


def check_pooled_emits(emit_at, emit_out, emit_rows) -> None:
    """The pooled scan writes its emits into checkpoint rows: ``emit_at`` needs both."""
    if emit_at is not None and (emit_out is None or emit_rows is None):
        raise ValueError("the pooled scan writes its emits into checkpoint rows: emit_at needs emit_out and emit_rows")


def ssd_scan_varlen_pooled_ref(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, states, state_indices,
                               has_initial_state, chunk_size, dt_limit=(0.0, math.inf), *,
                               max_seqlen: int | None = None, out_dtype: torch.dtype = torch.float32,
                               emit_at: torch.Tensor | None = None, emit_out: torch.Tensor | None = None,
                               emit_rows: torch.Tensor | None = None):
    """CONTRACT item 3, pooled form: ``ssd_scan_varlen_ref`` with row b starting from
    ``states[state_indices[b]]`` where ``has_initial_state[b]`` (zeros otherwise, whatever the slot
    holds) and its final state written back there. states [S, H, P, N] float32 (any strides: the
    pool's checkpoint-0 view ``ssm_state[:, 0]``); state_indices [B] int64, distinct; has_initial_state
    [B] bool. With ``emit_at`` [M], the state after each of those tokens goes to
    ``emit_out[emit_rows[m]]`` (emit_out [R, H, P, N] float32: a layer's checkpoint rows). A row on
    NULL_SLOT starts from zeros and writes nothing (its y is unspecified). -> y [T, H, P]."""
    check_pooled_emits(emit_at, emit_out, emit_rows)
    live = (state_indices != NULL_SLOT).view(-1, 1, 1, 1)
    old = states[state_indices]
    init = torch.where(has_initial_state.view(-1, 1, 1, 1) & live, old, 0.0)
    out = ssd_scan_varlen_ref(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, init, chunk_size, dt_limit,
                              max_seqlen=max_seqlen, out_dtype=out_dtype, emit_at=emit_at)
    # NULL rows write back what the slot held (every NULL row the same value: no sync, no mask)
    states[state_indices] = torch.where(live, out[1], old)
    if emit_at is not None:
        emit_out[emit_rows] = out[2]
    return out[0]


def ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, initial_states, chunk_size,
                    dt_limit=(0.0, math.inf), *, max_seqlen: int | None = None,
                    out_dtype: torch.dtype = torch.float32, emit_at: torch.Tensor | None = None):
    """Public entry point (CONTRACT item 3): Triton kernels on CUDA, torch reference elsewhere.
    ``emit_at`` [M] (prefix-cache checkpoints) adds the states after those packed tokens
    [M, H, P, N] float32 as a third result."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    kw = {} if emit_at is None else {"emit_at": emit_at}
    if kernel_backend("ssd_scan_varlen", x.device) == "triton":
        from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen
        return triton_ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, query_start_loc,
                                      initial_states, chunk_size, dt_limit, max_seqlen=max_seqlen,
                                      out_dtype=out_dtype, **kw)
    return ssd_scan_varlen_ref(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, initial_states,
                               chunk_size, dt_limit, max_seqlen=max_seqlen, out_dtype=out_dtype, **kw)


def ssd_scan_varlen_pooled(x, dt_raw, dt_bias, A, B, C, D, query_start_loc, states, state_indices,
                           has_initial_state, chunk_size, dt_limit=(0.0, math.inf), *,
                           max_seqlen: int | None = None, out_dtype: torch.dtype = torch.float32,
                           emit_at: torch.Tensor | None = None, emit_out: torch.Tensor | None = None,
                           emit_rows: torch.Tensor | None = None, chunk_layout=None, emits_sorted: bool = False):
    """Public entry point of the pooled form (``ssd_scan_varlen_pooled_ref``; what the mixer's
    prefill calls): on CUDA the state pass reads and writes the pool by slot, so the step spends
    no gather, select or scatter on the initial and final states. ``chunk_layout``: the Triton
    kernels' (query_start_loc int32, cumulative chunk counts int32), made once a step
    (``MambaMetadata.ssd_chunk_layout``); the reference makes its own. ``emits_sorted``: the
    caller promises emit_at is non-decreasing (the Triton path then skips sorting it); any order
    gives the same result."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    args = (x, dt_raw, dt_bias, A, B, C, D, query_start_loc, states, state_indices, has_initial_state, chunk_size,
            dt_limit)
    kw = dict(max_seqlen=max_seqlen, out_dtype=out_dtype, emit_at=emit_at, emit_out=emit_out, emit_rows=emit_rows)
    if kernel_backend("ssd_scan_varlen", x.device) == "triton":
        from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen_pooled
        return triton_ssd_scan_varlen_pooled(*args, **kw, chunk_layout=chunk_layout, emits_sorted=emits_sorted)
    return ssd_scan_varlen_pooled_ref(*args, **kw)
