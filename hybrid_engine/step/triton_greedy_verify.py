"""Greedy verification of a decode step's drafts in two Triton launches (the fused verify-step plans
of ``spec_graphs.py``).

The torch form (``greedy_verify_ref``, the same ops as ``spec.rejection._greedy`` plus the step's
bookkeeping) is ~20 small launches after the forward: argmax, compare, cumprod, sums, the
non-finite reduction, four copies into the step's buffers, a cat and a masked fill. On a small
model each costs 1-4 us of GPU time, as much as a layer. Here:

1. ``_argmax_chunks_kernel``, grid (rows, chunks): per logits row [V] and chunk of ``chunk``
   columns, the maximum (NaN counted as +inf) and its first index;
2. ``_verify_kernel``, grid (B,): per step row, the argmax of each of its 1+k positions from the
   chunks (the first index among equal maxima, as ``torch.argmax``), the accepted prefix of the
   drafts, and every output of the step written in place: tokens (-1 after the last valid one),
   valid counts, next starts and the D2H payload [tokens | verified drafts] with the row set to
   NONFINITE where any of its positions' logits has no finite maximum (NaN, +inf, or all -inf;
   ``sampler.nonfinite_rows``).

No host synchronisation; the chunk buffers are the caller's (fixed addresses under CUDA graphs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, device_ctx, next_pow2
from hybrid_engine.sampling import rng
from hybrid_engine.spec.rejection import FORCED_STREAM

from .step_io import NONFINITE

CHUNK = 4096          # logits columns per argmax program: one program per row at the small vocabularies


@triton.jit
def _argmax_chunks_kernel(logits_ptr, cmax_ptr, cidx_ptr, V, s_row, chunk, n_chunks, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, V)
    row = logits_ptr + r.to(tl.int64) * s_row
    best = float("-inf")
    best_i = V
    for v0 in range(lo, hi, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        m = offs < hi
        x = tl.load(row + offs, mask=m, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)                    # NaN: a non-finite maximum
        bm = tl.max(x, axis=0)
        bi = tl.min(tl.where((x == bm) & m, offs, V), axis=0)   # first index of the block's maximum
        take = (bm > best) | ((bm == best) & (bi < best_i))
        best_i = tl.where(take, bi, best_i)
        best = tl.maximum(best, bm)
    tl.store(cmax_ptr + r * n_chunks + c, best)
    tl.store(cidx_ptr + r * n_chunks + c, best_i)


@triton.jit
def _shr(z, S: tl.constexpr):
    """Logical right shift of int64 words, as ``sampling.rng._shr`` (arithmetic shift, then mask)."""
    return (z >> S) & ((1 << (64 - S)) - 1)


# sampling.rng's constants as int64 (one owner: rng; the forced stream: spec.rejection)
_RNG_M1 = tl.constexpr(rng._M1)
_RNG_M2 = tl.constexpr(rng._M2)
_RNG_GAMMA = tl.constexpr(rng._GAMMA)
_RNG_SEED_XOR = tl.constexpr(rng._SEED_XOR)
_FORCED_STREAM_GAMMA = tl.constexpr(rng._i64(FORCED_STREAM * rng._GAMMA))   # stream * G, wrapped
assert rng._BITS == 23, "_forced_coin_u keeps rng's top 23 bits (shift 41)"
_RNG_SCALE = tl.constexpr(rng._SCALE)


@triton.jit
def _mix(z):
    """``sampling.rng._mix`` (splitmix64's finaliser) in wrapping int64 arithmetic."""
    z = (z ^ _shr(z, 30)) * _RNG_M1
    z = (z ^ _shr(z, 27)) * _RNG_M2
    return z ^ _shr(z, 31)


@triton.jit
def _forced_coin_u(key, position):
    """``sampling.rng.uniform(key, position, 0, FORCED_STREAM, 1)``: the forced-acceptance coin's
    uniform (``spec.rejection.forced_accept_mask``), bit for bit."""
    row_key = _mix(key ^ _RNG_SEED_XOR)
    row_key = _mix(row_key + position * _RNG_GAMMA)
    row_key = _mix(row_key)                                     # step 0
    row_key = _mix(row_key + _FORCED_STREAM_GAMMA)
    z = _mix(row_key + _RNG_GAMMA)                              # element 0
    return (_shr(z, 41).to(tl.float32) + 0.5) * _RNG_SCALE


@triton.jit
def _verify_kernel(cmax_ptr, cidx_ptr, drafts_ptr, start_ptr, tok_ptr, nv_ptr, ns_ptr, pay_ptr, forced_key_ptr,
                   forced_rate,
                   k, n_chunks, V, s_dr, s_tok, s_pay, NONFINITE_ID: tl.constexpr,
                   KP1_PAD: tl.constexpr, NC_PAD: tl.constexpr, FORCED: tl.constexpr = False):
    b = tl.program_id(0)
    kp1 = k + 1
    j = tl.arange(0, KP1_PAD)                                   # positions of the row
    c = tl.arange(0, NC_PAD)
    mj = j < kp1
    mc = c < n_chunks
    pidx = (b * kp1 + j)[:, None] * n_chunks + c[None, :]       # [KP1_PAD, NC_PAD]
    mm = mj[:, None] & mc[None, :]
    cm = tl.load(cmax_ptr + pidx, mask=mm, other=float("-inf"))
    ci = tl.load(cidx_ptr + pidx, mask=mm, other=V)
    pos_max = tl.max(cm, axis=1)                                # [KP1_PAD]
    argmax = tl.min(tl.where((cm == pos_max[:, None]) & mm, ci, V), axis=1).to(tl.int64)
    finite = (pos_max != float("inf")) & (pos_max != float("-inf"))
    bad = tl.sum((mj & ~finite).to(tl.int32), axis=0) > 0
    md = j < k
    drafts = tl.load(drafts_ptr + b * s_dr + j, mask=md, other=-1)          # [KP1_PAD] int64
    if FORCED:      # benchmark only: a draft passes on its coin; a -1 draft emits the argmax
        u = _forced_coin_u(tl.load(forced_key_ptr + b).to(tl.int64), tl.load(start_ptr + b) + 1 + j)
        rejected = md & ~(u < forced_rate)
        emitted = tl.where(drafts >= 0, drafts, argmax)
    else:           # an accepted draft equals the argmax it is compared with
        rejected = md & (drafts != argmax)
        emitted = argmax
    num_acc = tl.min(tl.where(rejected | ~md, j, KP1_PAD), axis=0)         # first rejected (or k)
    sampled = tl.where(j < num_acc, emitted, tl.where(j == num_acc, argmax, -1))
    num_valid = num_acc + 1
    tl.store(tok_ptr + b * s_tok + j, sampled, mask=mj)
    tl.store(nv_ptr + b, num_valid.to(tl.int64))
    tl.store(ns_ptr + b, tl.load(start_ptr + b) + num_valid)
    tl.store(pay_ptr + b * s_pay + j, tl.where(bad, NONFINITE_ID, sampled), mask=mj)
    tl.store(pay_ptr + b * s_pay + kp1 + j, tl.where(bad, NONFINITE_ID, drafts), mask=md)


def chunk_buffers(max_logit_rows: int, vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax chunks' scratch for up to ``max_logit_rows`` rows of ``vocab_size``:
    ([rows * chunks] float32 maxima, [rows * chunks] int32 indices)."""
    n = max_logit_rows * cdiv(vocab_size, CHUNK)
    return (torch.empty(n, dtype=torch.float32, device=device),
            torch.empty(n, dtype=torch.int32, device=device))


def greedy_verify(logits: torch.Tensor, drafts: torch.Tensor, start: torch.Tensor, *, tokens_out: torch.Tensor,
                  num_valid_out: torch.Tensor, next_start_out: torch.Tensor, payload_out: torch.Tensor,
                  chunks: tuple[torch.Tensor, torch.Tensor], forced_rate: float | None = None,
                  forced_keys: torch.Tensor | None = None) -> None:
    """logits [B * (1+k), V] (row-major by step row, then position); drafts [B, k] int64 (-1 = none);
    start [B] int64 (the rows' first input positions). Writes tokens_out [B, 1+k] (the target's
    argmax up to and including the first rejected position, then -1; forced acceptance: below),
    num_valid_out [B],
    next_start_out [B] = start + num_valid, payload_out [B, 1+2k] = [tokens | drafts], NONFINITE
    for rows with a non-finite position. ``chunks``: ``chunk_buffers(>= B * (1+k), V)``.
    Same results as ``greedy_verify_ref`` except in NONFINITE rows, whose tokens, valid counts and
    next starts are unspecified (the kernel counts NaN as +inf, torch.argmax takes the first NaN;
    the host fails those rows either way). Inner dimensions must be unit-stride (checked).

    ``forced_rate`` with ``forced_keys`` [B] int64 (benchmark only, forced acceptance): draft j of
    row b passes on the coin ``spec.rejection.forced_accept_mask(forced_rate, forced_keys, start + 1,
    k)[b, j]``, drawn in the kernel (the torch form is ~60 launches), whatever the argmax; the
    output is ``spec.rejection.forced_output``'s (accepted columns emit the draft, or the argmax
    where the draft is -1)."""
    B, k = drafts.shape
    rows, V = logits.shape
    if rows != B * (1 + k):
        raise ValueError(f"logits has {rows} rows, expected B * (1 + k) = {B * (1 + k)}")
    if (logits.stride(1) != 1 or (k and drafts.stride(1) != 1) or tokens_out.stride(1) != 1
            or payload_out.stride(1) != 1 or start.stride(0) != 1 or num_valid_out.stride(0) != 1
            or next_start_out.stride(0) != 1):
        raise ValueError("greedy_verify: logits / drafts / tokens_out / payload_out need unit-stride rows and "
                         "start / num_valid_out / next_start_out unit strides")
    if (forced_rate is None) != (forced_keys is None):
        raise ValueError("greedy_verify: forced_rate and forced_keys go together")
    if forced_keys is not None and (tuple(forced_keys.shape) != (B,) or forced_keys.dtype != torch.int64
                                    or forced_keys.stride(0) != 1 or forced_keys.device != logits.device):
        raise ValueError(f"greedy_verify: forced_keys must be an int64 [B] = [{B}] unit-stride tensor on "
                         f"{logits.device}, got {forced_keys.dtype} {tuple(forced_keys.shape)} stride "
                         f"{tuple(forced_keys.stride())} on {forced_keys.device}")
    if B == 0:
        return
    n_chunks = cdiv(V, CHUNK)
    cmax, cidx = chunks
    if cmax.numel() < rows * n_chunks:
        raise ValueError(f"chunk buffers hold {cmax.numel()} entries, {rows * n_chunks} needed")
    with device_ctx(logits):
        _argmax_chunks_kernel[(rows, n_chunks)](logits, cmax, cidx, V, logits.stride(0), CHUNK, n_chunks,
                                                BLOCK=min(1024, next_pow2(V)), num_warps=4)
        _verify_kernel[(B,)](cmax, cidx, drafts, start, tokens_out, num_valid_out, next_start_out, payload_out,
                             start if forced_keys is None else forced_keys,     # (a dummy pointer unless forced)
                             0.0 if forced_rate is None else float(forced_rate),
                             k, n_chunks, V, drafts.stride(0), tokens_out.stride(0), payload_out.stride(0),
                             NONFINITE_ID=NONFINITE, KP1_PAD=next_pow2(k + 1), NC_PAD=next_pow2(n_chunks),
                             FORCED=forced_rate is not None and k > 0, num_warps=1)


def greedy_verify_ref(logits: torch.Tensor, drafts: torch.Tensor, start: torch.Tensor, *, tokens_out: torch.Tensor,
                      num_valid_out: torch.Tensor, next_start_out: torch.Tensor, payload_out: torch.Tensor,
                      chunks=None, forced_rate: float | None = None, forced_keys: torch.Tensor | None = None) -> None:
    """The torch twin of ``greedy_verify`` (same arguments; ``chunks`` unused)."""
    from hybrid_engine.sampling.sampler import nonfinite_rows
    from hybrid_engine.spec.rejection import _greedy, forced_accept_mask, forced_output
    B, k = drafts.shape
    if (forced_rate is None) != (forced_keys is None):
        raise ValueError("greedy_verify_ref: forced_rate and forced_keys go together")
    if forced_rate is None or not k:
        sampled = _greedy(logits.view(B, 1 + k, -1), drafts)                 # [B, 1+k]
    else:
        accept = forced_accept_mask(forced_rate, forced_keys, start + 1, k)      # [B, k]
        sampled = forced_output(logits.view(B, 1 + k, -1), drafts, accept)
    num_valid = (sampled != -1).sum(1)
    bad = nonfinite_rows(logits).view(B, 1 + k).any(1)                        # [B]
    tokens_out.copy_(sampled)
    num_valid_out.copy_(num_valid)
    next_start_out.copy_(start + num_valid)
    payload_out.copy_(torch.cat([sampled, drafts], 1).masked_fill(bad[:, None], NONFINITE))
