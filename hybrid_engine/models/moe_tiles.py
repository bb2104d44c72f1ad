"""Tile choices of the fused MoE kernels (``triton_moe.py``), each from a sweep on the H100 / H200
with its benchmark named: the decode GEMV (``gemv_tiles``) and the prefill grouped GEMM
(``gemm_config``, by the rows per expert tile that ``moe_align.align_block_size`` picks)."""
from __future__ import annotations

import functools

import torch


def gemv_tiles(role: str, tokens: int, weight: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of ``_pair_gemv_kernel`` for ``role`` ("rowwise": one weight
    matrix, the router and the shared expert; "up" / "down": the routed experts) at ``tokens`` rows.
    From the H100 tile sweep on the Nano-30B-A3B widths (benchmarks/moe_gemv_sweep.py, results in
    benchmarks/results/2026-11-24-moe-gemv-sweep-h100.md): at one token, wide K tiles and few output
    rows per program, so that the expert spreads over enough SMs. The float32 router and the 16-bit
    shared expert (both "rowwise") have their own rules (below), from sweeps inside a chain of MoE
    layers, where the shared expert runs beside the router (and, since 2026-11-29, beside the
    routed experts too: ``moe_ops.start_beside``; an H200 re-sweep at one token just before that
    change found no better tile, benchmarks/results/2026-11-29-moe-late-join-h200.md; not re-swept
    since)."""
    wide = weight.element_size() == 4             # float32 weights: the router, or a float32 model
    if role == "rowwise":
        if wide and weight.shape[0] <= 1024:
            # the float32 router ([E, D]): one expert row per program, so that its 1.4 MB (Nano)
            # spreads over E programs instead of E / 4. In a CUDA graph of Nano MoE layers at 1 /
            # 4 / 8 tokens, 4.07 -> 2.17 / 4.16 -> 3.14 / 4.72 -> 4.05 us per router call, 74.6 ->
            # 70.6 us per MoE layer at one token (H100, benchmarks/moe_chain.py, results in
            # benchmarks/results/2026-11-26-pdl-h100.md). A float32 model's small rowwise weights
            # (N <= 1024) take it too; that was not measured.
            return 1, 2048, 4
        if wide:
            return 4, 256, 8
        # the 16-bit shared expert runs beside the router (moe_ops.start_beside), so its tiles come from
        # a sweep inside a chain of Nano MoE layers (benchmarks/moe_chain.py --shared-tiles, H100,
        # benchmarks/results/2026-11-27-moe-shared-tiles-h100.md): us per layer at 1 token
        # 67.2 (8, 512, 4) -> 65.2 (2, 1024, 4); at 4 tokens 201.6 (16, 128, 2) -> 194.9
        # (16, 256, 4); at 8 tokens (16, 128, 2) stayed best. 2 and 3 tokens were not swept: they
        # take the 4-token tile
        if tokens == 1:
            return 2, 1024, 4
        return (16, 256, 4) if tokens <= 4 else (16, 128, 2)
    if wide:
        return 8, 128, 4
    if tokens == 1:
        if role == "up":
            return 16, 256, 4
        # FP8 experts (one byte a weight): the down projection's 512-wide K tiles read as many
        # bytes a step as the 16-bit 256-wide ones. A chain of FP8 Nano MoE layers at one token,
        # four alternations: 44.9-45.2 (4, 256, 2) -> 42.6-42.9 us per layer (H100,
        # benchmarks/moe_chain.py --fp8 --expert-tiles, results in
        # benchmarks/results/2026-11-28-moe-fp8-down-tiles-h100.md); the 16-bit experts' candidates
        # there were within the run's noise of (4, 256, 2), which they keep
        return (8, 512, 4) if weight.element_size() == 1 else (4, 256, 2)
    return 8, 512, 4


def gemm_config(rows_per_expert_tile: int, dtype: torch.dtype, swiglu: bool = False,
                smem_bytes: int | None = None, w8a8: bool = False) -> dict:
    """Tile sizes for the grouped GEMM (by BLOCK_M, which align_block_size picks from the load).
    SwiGLU loads two weight tiles per step (gate and up rows): 128-row tiles keep BLOCK_N at 128
    and three stages there. ``smem_bytes``: the device's shared memory per block (None: no
    limit); a config whose pipelined tiles would not fit (the H100-tuned 128-row tiles need
    ~192 KiB: more than an A100 or an Ada card has) falls back to narrow tiles and two stages."""
    bm = rows_per_expert_tile
    if bm <= 16:
        cfg = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif bm <= 32:
        cfg = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    elif bm <= 64:
        cfg = dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    elif swiglu:
        cfg = dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    else:                             # the best of benchmarks/moe_gemm_sweep.py at 2048 and 8192 tokens
        cfg = dict(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4)
    if dtype == torch.float32:        # double the bytes per element: halve K tiles
        cfg.update(BLOCK_K=32, num_stages=2)
    if w8a8:                          # FP8 operands, one byte each: the same bytes per stage in twice the K
        cfg.update(BLOCK_K=2 * cfg["BLOCK_K"])
        if bm == 64:                  # the most rows moe_align.align_block_size gives W8A8: 4 stages
            cfg.update(num_stages=4)
    if smem_bytes is not None and gemm_smem_bytes(bm, cfg, dtype, swiglu, w8a8) > smem_bytes:
        cfg.update(BLOCK_N=64, BLOCK_K=128 if w8a8 else 32 if dtype == torch.float32 else 64, num_warps=4,
                   num_stages=2)
    if w8a8:                          # the FP8 dot's partial sums join the float32 sum every 128 products
        cfg.update(PROMOTE_K=min(128, cfg["BLOCK_K"]))
    return cfg


def gemm_smem_bytes(rows_per_expert_tile: int, cfg: dict, dtype: torch.dtype, swiglu: bool = False,
                    w8a8: bool = False) -> int:
    """Shared memory the grouped GEMM's pipelined tiles take: per stage an activation tile
    [BLOCK_M, BLOCK_K] and one weight tile [BLOCK_K, BLOCK_N] (two with SwiGLU) in the
    activations' dtype (weight-only FP8 weights are converted to it; W8A8: one byte each)."""
    elem = 1 if w8a8 else torch.finfo(dtype).bits // 8
    per_stage = rows_per_expert_tile * cfg["BLOCK_K"] + cfg["BLOCK_K"] * cfg["BLOCK_N"] * (2 if swiglu else 1)
    return cfg["num_stages"] * per_stage * elem


@functools.lru_cache(maxsize=None)
def max_shared_mem(device_index: int) -> int:
    """Shared memory per block the device allows a kernel (opt-in maximum), from Triton's driver."""
    import triton
    return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
