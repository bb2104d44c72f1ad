"""The second launch of the decode kernels that cut K into slices (NVFP4 persistent and dot, FP8
dot): each slice's program wrote its float32 sum to part [slices, rows * N]; this adds them in slice
order, so every run gives the same bits, plus the bias, in y's dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs


@triton.jit
def _sum_slices_kernel(part_ptr, b_ptr, y_ptr, N, NB, SLICES: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # y = the K slices' float32 sums part [SLICES, N], added in slice order (the same bits on every
    # run), plus the bias (period NB: N = rows * NB outputs), in y's dtype
    pid = tl.program_id(0) + pdl_enter(PDL)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SLICES):
        acc += tl.load(part_ptr + s * N + offs, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % NB, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=m)


def slice_tiles(total: int, k_slices: int, tile: int) -> tuple[int, int]:
    """(slice length, slices): ``total`` (K in the kernel's units) cut into at most ``k_slices``
    slices of whole ``tile``s; at least one slice of at least one tile (total 0: one empty slice)."""
    if k_slices < 1:
        raise ValueError(f"k_slices must be >= 1, got {k_slices}")
    length = max(tile, cdiv(cdiv(total, k_slices), tile) * tile)
    return length, max(1, cdiv(total, length))


def sum_slices(part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """part [slices, rows, N] float32 (contiguous) -> y [rows, N] (contiguous) = the slices' sum +
    bias [N]. ``pdl``: launched with programmatic dependent launch (``triton_pdl``)."""
    total, n = y.numel(), y.shape[-1]
    _sum_slices_kernel[(cdiv(total, 1024),)](part, bias if bias is not None else part, y, total, n,
                                             SLICES=part.shape[0], HAS_BIAS=bias is not None, BLOCK=1024,
                                             num_warps=4, **(pdl_kwargs(y.device) if pdl else {}))
    return y
