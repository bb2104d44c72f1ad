"""Greedy draft ids of a few logits rows in one launch: ``argmax_rows(logits)`` = ``logits.argmax(-1)``.

A model drafter's single-token steps end in an argmax over one logits row per request. torch's
reduction took 7.6 us of GPU time for one float32 row of 16,384 (bench-large, H100,
results/2026-11-28-spec-step-glue-h100.md), three times per MTP K = 3 step. One program per row
walking the vocabulary in 1024-wide blocks does it in one launch. torch's semantics, bit for bit:
the first index of the maximum, and a NaN counts above every number (the first NaN's index).
Vocabularies above ``MAX_VOCAB`` keep torch's multi-block reduction (one program would walk them
alone); CPU tensors always do.
"""
from __future__ import annotations

import torch

from hybrid_engine.mamba_cache.ops.triton_common import device_ctx, kernel_backend, triton_available

MAX_VOCAB = 32768
BLOCK = 1024

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["V", "s_row"])
    def _argmax_rows_kernel(logits_ptr, out_ptr, V, s_row, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        row = logits_ptr + r.to(tl.int64) * s_row
        best = float("-inf")
        best_i = V
        seen_nan = 0
        nan_i = V
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            m = offs < V
            x = tl.load(row + offs, mask=m, other=float("-inf")).to(tl.float32)
            isnan = (x != x) & m
            nan_i = tl.minimum(nan_i, tl.min(tl.where(isnan, offs, V), axis=0))
            seen_nan = tl.maximum(seen_nan, tl.max(isnan.to(tl.int32), axis=0))
            x = tl.where(isnan, float("-inf"), x)
            bm = tl.max(x, axis=0)
            bi = tl.min(tl.where((x == bm) & m, offs, V), axis=0)     # first index of the block's maximum
            take = bm > best                                          # earlier blocks win ties
            best_i = tl.where(take, bi, best_i)
            best = tl.maximum(best, bm)
        # a row of -inf only: index 0, as torch (best_i stays V only if no block had a finite max)
        best_i = tl.where(best_i == V, 0, best_i)
        tl.store(out_ptr + r, tl.where(seen_nan > 0, nan_i, best_i).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> [R] int64, equal to ``logits.argmax(-1)``."""
    R, V = logits.shape
    if (V > MAX_VOCAB or R == 0 or logits.stride(1) != 1
            or kernel_backend("argmax_rows", logits.device) != "triton"):
        return logits.argmax(-1)
    return argmax_rows_triton(logits)


def argmax_rows_triton(logits: torch.Tensor) -> torch.Tensor:
    """The kernel (any device Triton runs on: the interpreter's CPU tensors in the tests)."""
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    with device_ctx(logits):
        _argmax_rows_kernel[(R,)](logits, out, V, logits.stride(0), BLOCK=BLOCK, num_warps=4)
    return out
