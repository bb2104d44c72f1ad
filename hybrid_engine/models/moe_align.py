"""Token-expert pairs grouped by expert, the fused MoE's grouped path's first step (``triton_moe``
and ``quantization/nvfp4_experts``): each expert's run padded to whole tiles of ``block_m`` rows,
in buffers whose sizes are a function of (T, k, E, block_m) only (no host sync, CUDA-graph safe).

- ``align_block_size``: the rows per tile, from the load per expert;
- ``align_pairs``: torch ops (any size, any device): the twin;
- ``align_pairs_triton``: the same result in one Triton program, for decode-sized work
  (``ALIGN_MAX_WORK``);
- ``align_pairs_chunked``: the same result in three Triton launches, for prefill-sized work;
- ``group_pairs``: the grouped kernels' choice between the two Triton forms.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import next_pow2


def align_block_size(num_pairs: int, num_experts: int, w8a8: bool = False) -> int:
    """Rows per grouped-GEMM tile: small tiles when experts get few tokens (decode batches), large
    for prefill. A function of static shapes only, so each CUDA-graph bucket fixes its own."""
    per_expert = num_pairs / num_experts
    # 128-row tiles from 64 pairs per expert up: on the Nano widths a 2048-token prefill (96 per
    # expert) ran its routed experts 1.11x faster than with 64-row tiles, an 8192-token one (384)
    # 1.27x (benchmarks/moe_gemm_sweep.py, H200, 2026-11-25). W8A8 (FP8 operands, their partial
    # sums promoted to float32, which holds a second accumulator) stops at 64 rows: at 2048 / 8192
    # tokens 1.57 / 2.57 ms against 1.58 / 3.00 for the best 128-row tiles (H200, 2026-11-29,
    # benchmarks/results/2026-11-29-moe-fp8-w8a8-h200.md)
    bm = 16 if per_expert <= 8 else 32 if per_expert <= 24 else 64 if per_expert <= 64 else 128
    return min(bm, 64) if w8a8 else bm


@dataclass(frozen=True)
class Alignment:
    """Pairs (token t, choice j; pair id p = t*k + j) grouped by expert, each expert's run padded
    to a multiple of ``block_m`` rows so every tile of BLOCK_M rows has one expert. Fixed sizes
    (a function of T, k, E, block_m only): no host sync, CUDA-graph safe."""
    sorted_pairs: torch.Tensor      # [max_rows] int32 pair ids; padding rows hold num_pairs
    block_expert: torch.Tensor      # [max_rows // block_m] int32 expert of each tile (E-1 past the end)
    num_rows: torch.Tensor          # [1] int32 rows in use (a multiple of block_m)
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def _max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted buffer: every pair, each expert's run padded up to whole tiles."""
    return -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """ids [T, k] -> Alignment (torch ops on ids' device, fixed shapes)."""
    dev = ids.device
    flat = ids.reshape(-1).long()
    P = flat.numel()
    max_rows = _max_rows(P, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).index_add_(
        0, flat, torch.ones_like(flat))                                      # bincount without a sync
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    cnt_start = counts.cumsum(0) - counts
    # pair ids by expert; the keys sorted as int16 (int32 past 32767 experts): a radix sort makes one
    # pass per key byte, so int64 keys took 8 passes (184 sort launches in a Nano prefill, 1.24 ->
    # 0.37 ms at 2048 tokens on an H100, benchmarks/results/2026-11-27-moe-nano-prefill-flops-h100.md); the
    # stable order is the same whatever the key width
    order = torch.sort(ids.reshape(-1).to(torch.int16 if num_experts <= 32767 else torch.int32), stable=True)[1]
    sorted_e = flat[order]
    dest = (pad_end - padded)[sorted_e] + torch.arange(P, device=dev) - cnt_start[sorted_e]
    sorted_pairs = torch.full((max_rows,), P, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, max_rows, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, starts, right=True).clamp_(max=num_experts - 1)
    return Alignment(sorted_pairs=sorted_pairs, block_expert=block_expert.to(torch.int32),
                     num_rows=pad_end[-1:].to(torch.int32), block_m=block_m)


# --------------------------------------------------------------------------------- the Triton form

ALIGN_MAX_WORK = 1 << 17      # P * next_pow2(E) up to this: the one-program align kernel


@triton.jit
def _padded_runs(counts, BM: tl.constexpr):
    """Per expert: its pairs rounded up to whole tiles of BM rows, and where its run ends."""
    padded = (counts + BM - 1) // BM * BM
    return padded, tl.cumsum(padded, axis=0)


@triton.jit
def _store_tile_experts(block_e_ptr, b, pad_end, E, max_blocks, BM: tl.constexpr):
    """The expert of each tile b (E - 1 past the last run)."""
    be = tl.sum((pad_end[None, :] <= (b * BM)[:, None]).to(tl.int32), axis=1)
    tl.store(block_e_ptr + b, tl.minimum(be, E - 1), mask=b < max_blocks)


@triton.jit
def _sorted_rows(e, e_offs, start):
    """Each pair's sorted row (its expert's ``start`` plus its rank among the same expert's pairs
    of this chunk; ``e`` -1 for none) and the [CH, BLOCK_E] hits."""
    hit = e[:, None] == e_offs[None, :]
    return tl.sum(tl.where(hit, start[None, :] + tl.cumsum(hit.to(tl.int32), axis=0) - 1, 0), axis=1), hit


@triton.jit(do_not_specialize=["P", "max_blocks"], do_not_specialize_on_alignment=["ids_ptr"])
def _align_kernel(ids_ptr, sorted_ptr, block_e_ptr, nrows_ptr, P, E, max_blocks, max_rows,
                  BM: tl.constexpr, BLOCK_E: tl.constexpr, CH: tl.constexpr, CB: tl.constexpr):
    """align_pairs in one program (decode-sized P): counts, padded offsets, tile experts,
    then each pair's sorted row (pairs of one expert keep their index order)."""
    e_offs = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, P, CH):
        offs = c0 + tl.arange(0, CH)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        counts += tl.sum((e[:, None] == e_offs[None, :]).to(tl.int32), axis=0)
    padded, pad_end = _padded_runs(counts, BM)
    tl.store(nrows_ptr, tl.sum(padded, axis=0))
    for b0 in range(0, max_blocks, CB):
        _store_tile_experts(block_e_ptr, b0 + tl.arange(0, CB), pad_end, E, max_blocks, BM)
    for r0 in range(0, max_rows, CB):
        r = r0 + tl.arange(0, CB)
        tl.store(sorted_ptr + r, tl.zeros([CB], tl.int32) + P, mask=r < max_rows)
    tl.debug_barrier()          # the padding fill above lands before the pair rows below
    next_row = pad_end - padded                         # per expert: its next free sorted row
    for c0 in range(0, P, CH):
        offs = c0 + tl.arange(0, CH)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        dest, hit = _sorted_rows(e, e_offs, next_row)
        tl.store(sorted_ptr + dest, offs, mask=offs < P)
        next_row += tl.sum(hit.to(tl.int32), axis=0)


def _alignment_buffers(max_rows: int, block_m: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton forms' outputs, uninitialised: sorted pairs, tile experts, rows in use."""
    return (torch.empty(max_rows, dtype=torch.int32, device=dev),
            torch.empty(max_rows // block_m, dtype=torch.int32, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev))


def align_pairs_triton(ids: torch.Tensor, num_experts: int, block_m: int):
    """Same result as ``align_pairs`` in one launch; for P * next_pow2(E) <= ALIGN_MAX_WORK."""
    P = ids.numel()
    max_rows = _max_rows(P, num_experts, block_m)
    sorted_pairs, block_expert, num_rows = _alignment_buffers(max_rows, block_m, ids.device)
    be = next_pow2(num_experts)
    ch = max(2, min(64, 8192 // be))
    _align_kernel[(1,)](ids.reshape(-1).to(torch.int32), sorted_pairs, block_expert, num_rows, P, num_experts,
                        max_rows // block_m, max_rows, BM=block_m, BLOCK_E=be, CH=ch, CB=256, num_warps=8)
    return Alignment(sorted_pairs=sorted_pairs, block_expert=block_expert, num_rows=num_rows, block_m=block_m)


# ------------------------------------------------------------------------ the chunked Triton form

@triton.jit(do_not_specialize=["P", "max_rows"], do_not_specialize_on_alignment=["ids_ptr"])
def _chunk_counts_kernel(ids_ptr, cc_ptr, sorted_ptr, P, max_rows, BLOCK_E: tl.constexpr, CH: tl.constexpr,
                         FILL: tl.constexpr):
    """cc[c, e] = pairs of chunk c (CH pairs) that chose expert e; and sorted rows
    [c FILL, (c + 1) FILL) filled with P (padding; the scatter launched after overwrites the pairs')."""
    c = tl.program_id(0)
    offs = c * CH + tl.arange(0, CH)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    e_offs = tl.arange(0, BLOCK_E)
    tl.store(cc_ptr + c * BLOCK_E + e_offs, tl.sum((e[:, None] == e_offs[None, :]).to(tl.int32), axis=0))
    r = c * FILL + tl.arange(0, FILL)
    tl.store(sorted_ptr + r, tl.zeros([FILL], tl.int32) + P, mask=r < max_rows)


@triton.jit(do_not_specialize=["C"])
def _chunk_prefix_kernel(cc_ptr, before_ptr, counts_ptr, C, BLOCK_E: tl.constexpr, EB: tl.constexpr,
                         CC: tl.constexpr):
    """For EB experts a program: before[c, e] = pairs of e in the chunks before c; counts[e]."""
    e_offs = tl.program_id(0) * EB + tl.arange(0, EB)
    run = tl.zeros([EB], tl.int32)
    for c0 in range(0, C, CC):
        c = c0 + tl.arange(0, CC)
        at = c[:, None] * BLOCK_E + e_offs[None, :]
        cc = tl.load(cc_ptr + at, mask=(c < C)[:, None], other=0)
        tl.store(before_ptr + at, run[None, :] + tl.cumsum(cc, axis=0) - cc, mask=(c < C)[:, None])
        run += tl.sum(cc, axis=0)
    tl.store(counts_ptr + e_offs, run)


@triton.jit(do_not_specialize=["P", "max_blocks"], do_not_specialize_on_alignment=["ids_ptr"])
def _chunk_scatter_kernel(ids_ptr, before_ptr, counts_ptr, sorted_ptr, block_e_ptr, nrows_ptr, P, E, max_blocks,
                          BM: tl.constexpr, BLOCK_E: tl.constexpr, CH: tl.constexpr, CB: tl.constexpr):
    """sorted[run start of e + before[c, e] + rank of the pair among chunk c's pairs of e] = pair id;
    each program works out the runs (padded to BM rows) from the counts and stores the experts of
    tiles [c CB, (c + 1) CB) (CB: enough for the grid to cover every tile); program 0 also stores
    the rows in use."""
    c = tl.program_id(0)
    e_offs = tl.arange(0, BLOCK_E)
    padded, pad_end = _padded_runs(tl.load(counts_ptr + e_offs), BM)
    offs = c * CH + tl.arange(0, CH)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    dest, _ = _sorted_rows(e, e_offs, pad_end - padded + tl.load(before_ptr + c * BLOCK_E + e_offs))
    tl.store(sorted_ptr + dest, offs, mask=offs < P)
    if c == 0:
        tl.store(nrows_ptr, tl.sum(padded, axis=0))
    _store_tile_experts(block_e_ptr, c * CB + tl.arange(0, CB), pad_end, E, max_blocks, BM)


def align_pairs_chunked(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Same result as ``align_pairs`` in three launches whatever the size: per-chunk expert counts
    (one program per CH pairs; they also write the padding), each chunk's pairs per expert before
    it (one program per 16 experts), then the scatter (one program per chunk; pairs of an expert
    keep their index order). Replaced the torch ops' ~15 launches (a radix sort among them) on
    prefill batches."""
    P = ids.numel()
    max_rows = _max_rows(P, num_experts, block_m)
    dev = ids.device
    be = next_pow2(max(num_experts, 16))
    ch = max(16, min(128, 16384 // be))         # a chunk's [CH, BLOCK_E] compare in one program
    C = -(-P // ch)
    flat = ids.reshape(-1).to(torch.int32)
    chunk_counts = torch.empty(C, be, dtype=torch.int32, device=dev)
    chunk_before = torch.empty(C, be, dtype=torch.int32, device=dev)
    counts = torch.empty(be, dtype=torch.int32, device=dev)
    sorted_pairs, block_expert, num_rows = _alignment_buffers(max_rows, block_m, dev)
    fill = next_pow2(-(-max_rows // C))
    _chunk_counts_kernel[(C,)](flat, chunk_counts, sorted_pairs, P, max_rows, BLOCK_E=be, CH=ch, FILL=fill,
                               num_warps=4)
    _chunk_prefix_kernel[(be // 16,)](chunk_counts, chunk_before, counts, C, BLOCK_E=be, EB=16, CC=64, num_warps=2)
    max_blocks = max_rows // block_m
    _chunk_scatter_kernel[(C,)](flat, chunk_before, counts, sorted_pairs, block_expert, num_rows, P, num_experts,
                                max_blocks, BM=block_m, BLOCK_E=be, CH=ch, CB=max(2, next_pow2(-(-max_blocks // C))),
                                num_warps=4)
    return Alignment(sorted_pairs=sorted_pairs, block_expert=block_expert, num_rows=num_rows, block_m=block_m)


def group_pairs(ids: torch.Tensor, num_experts: int, block_m: int):
    """``Alignment`` of ids [T, k]: the one-program kernel for decode-sized work, the chunked
    kernels beyond."""
    if ids.numel() * next_pow2(num_experts) <= ALIGN_MAX_WORK:
        return align_pairs_triton(ids, num_experts, block_m)
    return align_pairs_chunked(ids, num_experts, block_m)
