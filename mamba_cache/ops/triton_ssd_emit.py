"""Prefix-cache emits of the Triton varlen SSD scan: the SSM state after chosen packed tokens,
from the chunk quantities the scan already computed (``triton_ssd.triton_ssd_scan_varlen``'s
``emit_at``). With c the token's chunk and i its offset there:

    h = exp(cuma[c, i]) h_in[c] + sum_{j<=i} exp(cuma[c, i] - cuma[c, j]) dt[c, j] x_j B_j^T

``emit_states`` is one launch for every (emit, head, head_dim block), with the token -> (chunk,
offset) arithmetic inside the kernel. A checkpoint-saving prefill step runs it in every Mamba
layer: as torch ops (``emit_states_ref``, its twin, which the tests compare it with) it was ~40
small launches per layer. No host sync: the emits and the chunk layout stay on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import F32_DOT_PRECISION, cdiv, device_ctx, next_pow2


@triton.jit
def emit_partial(x_ptr, B_ptr, dtc_ptr, cuma_ptr, row, tok0, i, h, g, p, n, mp, mn,
                 sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
                 BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                 PREC: tl.constexpr = "ieee"):
    """(sum_{j<=i} exp(cum_i - cum_j) dt_j x_j B_j^T [BLOCK_P, BLOCK_N], cum_i) over the first
    i + 1 tokens of the chunk starting at packed token tok0 (row = (c * H + h) * BLOCK_L indexes
    dtc / cuma): float32 operands, dots of precision PREC (``emit_precision``). Shared by
    ``_emit_kernel`` and the fused pass's in-kernel emits (``triton_ssd_fused_pass``)."""
    cum_i = tl.load(cuma_ptr + row + i)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, i + 1, BLOCK_K):                     # only the chunk's tokens up to i
        j = k0 + tl.arange(0, BLOCK_K)
        live = j <= i                                       # (masked lanes load nothing)
        tok = tok0 + j
        w = tl.exp(cum_i - tl.load(cuma_ptr + row + j, mask=live, other=0.0)) * \
            tl.load(dtc_ptr + row + j, mask=live, other=0.0)
        w = tl.where(live, w, 0.0)                          # [BLOCK_K]
        xs = tl.load(x_ptr + tok[:, None] * sx_t + h * sx_h + p[None, :] * sx_p,
                     mask=live[:, None] & mp[None, :], other=0.0).to(tl.float32) * w[:, None]
        bs = tl.load(B_ptr + tok[:, None] * sb_t + g * sb_g + n[None, :] * sb_n,
                     mask=live[:, None] & mn[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(tl.trans(xs), bs, acc, input_precision=PREC)     # [BLOCK_P, BLOCK_N]
    return acc, cum_i


@triton.jit(do_not_specialize=["nseq"],
            do_not_specialize_on_alignment=["qsl_ptr", "emit_ptr", "out_row_ptr"])
def _emit_kernel(
    x_ptr, B_ptr, qsl_ptr, cum_ptr, meta_ptr, dtc_ptr, cuma_ptr, hin_ptr, emit_ptr, out_ptr, out_row_ptr,
    nseq, H, P, N, heads_per_group, cs,
    sx_t, sx_h, sx_p, sb_t, sb_g, sb_n,
    BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    OUT_ROWS: tl.constexpr = False, PREC: tl.constexpr = "ieee",
):
    m = tl.program_id(0).to(tl.int64)
    orow = tl.load(out_row_ptr + m).to(tl.int64) if OUT_ROWS else m    # where state m is stored
    h = tl.program_id(1)
    pb = tl.program_id(2)
    t = tl.load(emit_ptr + m).to(tl.int64)                 # packed token index of the emit
    # its sequence: the number of sequence ends at or before t (nseq is small: a scalar loop)
    seq = tl.full([], 0, tl.int64)
    for b in range(1, nseq):
        seq += (tl.load(qsl_ptr + b).to(tl.int64) <= t).to(tl.int64)
    q0 = tl.load(qsl_ptr + seq).to(tl.int64)
    q1 = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    pos = t - q0
    c = tl.load(cum_ptr + seq).to(tl.int64) - (q1 - q0 + cs - 1) // cs + pos // cs   # its chunk
    i = pos % cs                                                                     # offset in it
    tok0 = tl.load(meta_ptr + c * 2).to(tl.int64)          # the chunk's first packed token
    row = (c * H + h) * BLOCK_L                             # dtc / cuma: [NC, H, BLOCK_L] contiguous
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    g = h // heads_per_group
    acc, cum_i = emit_partial(x_ptr, B_ptr, dtc_ptr, cuma_ptr, row, tok0, i, h, g, p, n, p < P, n < N,
                              sx_t, sx_h, sx_p, sb_t, sb_g, sb_n, BLOCK_K, BLOCK_P, BLOCK_N, PREC)
    mask = (p[:, None] < P) & (n[None, :] < N)
    tile = p[:, None] * N + n[None, :]
    h_in = tl.load(hin_ptr + (c * H + h) * P * N + tile, mask=mask, other=0.0)
    tl.store(out_ptr + (orow * H + h) * P * N + tile, tl.exp(cum_i) * h_in + acc, mask=mask)


def emit_output(emit_at, out, out_rows, H: int, P: int, N: int, device) -> torch.Tensor:
    """The emits' destination, checked: ``out`` (a contiguous float32 [M, H, P, N], or with
    ``out_rows`` [M] a contiguous float32 [R, H, P, N] whose rows ``out_rows`` receive them), or a
    new [M, H, P, N]. Shared by ``emit_states`` and the fused pass's in-kernel emits."""
    M = emit_at.numel()
    rows = out_rows is not None
    if out is None:
        if rows:
            raise ValueError("emits: out_rows needs out")
        return torch.empty((M, H, P, N), dtype=torch.float32, device=device)
    if out.shape[1:] != (H, P, N) or (not rows and out.shape[0] != M) or out.dtype != torch.float32 \
            or not out.is_contiguous():
        raise ValueError(f"emits: out must be a contiguous float32 {('R' if rows else M, H, P, N)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if rows and (out_rows.shape != (M,) or out_rows.stride(0) != 1):
        raise ValueError(f"emits: out_rows must be a contiguous [{M}], got {tuple(out_rows.shape)}")
    return out


def emit_states(x, B, qsl, cum, meta, dtc, cuma, h_in, emit_at, cs: int, out=None, out_rows=None) -> torch.Tensor:
    """The states after the packed tokens ``emit_at`` [M] -> [M, H, P, N] float32.

    x [T, H, P], B [T, G, N]: the scan's inputs; qsl [nseq + 1] and cum [nseq] (inclusive cumsum
    of each sequence's chunk count): its layout; meta [NC, 2] (chunk start token, length), dtc and
    cuma [NC, H, BLOCK_L] float32 (dt and the cumsum of dt * A inside each chunk) and h_in
    [NC, H, P, N] float32 (chunk-entry states): what its steps 1 and 3 computed. ``out``: a
    contiguous float32 [M, H, P, N] to write (default: a new one); with ``out_rows`` [M] int64 a
    contiguous float32 [R, H, P, N] whose rows ``out_rows`` receive the states (the checkpoint
    rows, written in place)."""
    M = emit_at.numel()
    H, P = x.shape[1:]
    G, N = B.shape[-2:]
    rows = out_rows is not None
    out = emit_output(emit_at, out, out_rows, H, P, N, x.device)
    if M == 0:
        return out
    if not (dtc.is_contiguous() and cuma.is_contiguous() and h_in.is_contiguous() and meta.is_contiguous()):
        raise ValueError("emit_states: dtc, cuma, h_in and meta must be contiguous")
    if h_in.dtype != torch.float32:
        raise ValueError(f"emit_states: h_in must be the float32 chunk-entry states, got {h_in.dtype}")
    BLOCK_L = cuma.shape[-1]
    BLOCK_P = min(32, max(16, next_pow2(P)))
    with device_ctx(x):
        _emit_kernel[(M, H, cdiv(P, BLOCK_P))](
            x, B, qsl, cum, meta, dtc, cuma, h_in, emit_at, out, out_rows if rows else emit_at,
            qsl.numel() - 1, H, P, N, H // G, cs, *x.stride(), *B.stride(),
            BLOCK_L=BLOCK_L, BLOCK_K=min(32, BLOCK_L), BLOCK_P=BLOCK_P, BLOCK_N=max(16, next_pow2(N)),
            OUT_ROWS=rows, PREC=emit_precision(x.dtype), num_warps=4,
        )
    return out


def emit_precision(dtype: torch.dtype) -> str:
    """The emits' dot precision: a float32 model's scan dots' (``triton_common.F32_DOT_PRECISION``),
    so that the state emitted after a chunk's last token sums like the state pass; IEEE for 16-bit
    models (their pass rounds its dot operands to the model dtype, the emits keep float32)."""
    return F32_DOT_PRECISION if dtype == torch.float32 else "ieee"


def emit_states_ref(x, B, qsl, cum, meta, dtc, cuma, h_in, emit_at, cs: int) -> torch.Tensor:
    """``emit_states`` as torch ops (device ops, no sync; reads only the emitting chunks' tokens)."""
    T, H, P = x.shape
    G, N = B.shape[-2:]
    BL = cuma.shape[-1]
    t = emit_at.long()
    q = qsl.long()
    seq = torch.searchsorted(q[1:].contiguous(), t, right=True)             # [M]
    pos = t - q[seq]
    cum64 = cum.long()
    first = cum64[seq] - (q[seq + 1] - q[seq] + cs - 1) // cs               # first chunk of the sequence
    c = first + pos // cs                                                   # [M] chunk
    i = pos % cs                                                            # [M] offset in it
    j = torch.arange(BL, device=x.device)
    tok = (meta[c, 0].long()[:, None] + j).clamp(max=T - 1)                 # [M, BL] packed tokens
    live = j[None, :] <= i[:, None]                                         # [M, BL]
    cum_i = cuma[c, :, i]                                                   # [M, H]
    w = torch.exp(cum_i[:, :, None] - cuma[c]) * dtc[c]                     # [M, H, BL]
    w = torch.where(live[:, None, :], w, 0.0)
    xs = torch.where(live[:, :, None, None], x[tok].float() * w.transpose(1, 2)[..., None], 0.0)  # [M, BL, H, P]
    Bs = B[tok].float().repeat_interleave(H // G, dim=2)                    # [M, BL, H, N]
    S_e = torch.einsum("mjhp,mjhn->mhpn", xs, Bs)
    return torch.exp(cum_i)[:, :, None, None] * h_in[c] + S_e
