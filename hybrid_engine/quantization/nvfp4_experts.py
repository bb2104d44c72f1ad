"""NVFP4 routed experts in the fused MoE (weight-only, Hopper): the packed weights are read as
stored and decoded inside the kernels, so a step reads the chosen experts' 4.5 bits a weight
instead of 16 (``experts.Nvfp4Experts`` holds them; the torch twin is ``nvfp4_experts_ref``).

Merged layout per projection (the per-expert ModelOpt tensors stacked at load):
  ``w`` [E, N, K/2] uint8 (two e2m1 codes a byte, low nibble first), ``blocks`` [E, N, K/16]
  float8_e4m3fn (a scale per 16 inputs of a row), ``scale`` [E] float32 (each expert's
  ``weight_scale_2``). Real weight: e2m1 * blocks[e, n, k // 16] * scale[e].

- decode (``T <= GEMV_MAX_TOKENS``, 24): ``_nvfp4_pair_gemv_kernel``, one (token, choice) pair per
  grid row as the 16-bit ``_pair_gemv_kernel``, with the one-row NVFP4 projection kernel's
  arithmetic (``nvfp4_group_dot``: the weight read as int32 words, each 16-input group of x times
  a power of two, nibble pairs against x pairs in packed float16 FMAs, inline PTX on CUDA and a
  float32 twin in the interpreter; each group's sum times its block scale in float32); the
  expert's scale and the epilogue (relu² or SwiGLU; the routing weight is the combine's) as the
  16-bit kernel's. The float16 products keep ~4e-4 relative error against float32 sums (as the
  one-row kernel's).
- grouped (prefill): ``_nvfp4_grouped_gemm_kernel``, the 16-bit grouped GEMM's tiles with each
  [BLOCK_K, BLOCK_N] weight tile decoded to the rows' dtype (e2m1 times an e4m3 block scale has at
  most 6 significant bits and stays within float16's normal range, so the tile is exact in
  bfloat16 and float16) and fed to ``tl.dot`` as two halves: the low nibbles (even inputs) against
  the rows' even columns and the high nibbles against the odd ones (``tl.split`` of the rows' tile).
  Decoding bounds it: on the Nano experts it runs at 0.46-0.8x of bf16's grouped GEMM
  (``grouped_config``), so an NVFP4 MoE model prefills slower than its bf16 twin.
Every buffer has a size fixed by (T, k, E): no host sync, safe inside CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import F32_DOT_PRECISION, cdiv, kernel_backend
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs
from hybrid_engine.models.moe_align import align_block_size, group_pairs
from hybrid_engine.models.moe_ops import SideOutput, joined
from hybrid_engine.models.triton_moe import (_expert_epilogue, _expert_tile_rows, _store_expert_tile, combine_pairs,
                                             device_smem, pair_buffers)

from .nvfp4 import GROUP, dequantize_nvfp4
from .nvfp4_decode import _scaled_nibbles, _use_ptx
from .nvfp4_group_dot import _group_dot, _row_tile, _words, _x_scaled


@triton.jit
def _pair_group_sums(w_rows, s_rows, xs, undo, offs_g, mn, mg, BLOCK_N: tl.constexpr, PTX: tl.constexpr):
    """[BLOCK_N] float32: rows' sums over the tile's groups offs_g of e2m1 * x' (``_group_dot``),
    each group's sum times its block scale and the inverse power of two of x' (2^14 included)."""
    part = _group_dot(_words(w_rows, offs_g, mn, mg), xs, BLOCK_N, PTX)                     # [BN, BG]
    bs = tl.load(s_rows + offs_g[None, :], mask=mn[:, None] & mg[None, :], other=0.0).to(tl.float32)
    return tl.sum(part * (bs * undo[None, :]), axis=1)


@triton.jit
def _nvfp4_pair_gemv_kernel(a_ptr, w_ptr, b_ptr, gs_ptr, ids_ptr, out_ptr, N, KW, A_DIV,
                            s_am, s_we, s_wn, s_be, s_bn, s_om,
                            RELU2: tl.constexpr, SWIGLU: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, PTX: tl.constexpr = False,
                            PDL: tl.constexpr = False):
    """out[p, n] = epilogue(scale[e] * sum_k a[p // A_DIV, k] * W[e, n, k]), e = ids[p]: one pair
    per grid row, the one-row NVFP4 FMA kernel's arithmetic (``nvfp4_fma_kernels``: each 16-input
    group of the row times a power of two, nibble pairs against x pairs in packed float16 FMAs on
    CUDA, each group's sum times its block scale in float32). w as int32 words [E, N, KW] (strides
    in words), block scales [E, N, KW / 2]. SWIGLU: rows N + n are the up rows of gate row n."""
    z = pdl_enter(PDL)
    pid_n = tl.program_id(0) + z
    p = tl.program_id(1) + z
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_n, mn, w_rows, s_rows = _row_tile(pid_n, N, w_ptr + e * s_we, b_ptr + e * s_be, s_wn, s_bn, BLOCK_N)
    a_row = a_ptr + (p // A_DIV).to(tl.int64) * s_am
    offs_c = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g0 in range(0, KW // 2, BLOCK_G):
        offs_g = g0 + tl.arange(0, BLOCK_G)
        mg = offs_g < KW // 2
        xt = tl.load(a_row + offs_g[:, None] * 16 + offs_c[None, :], mask=mg[:, None], other=0.0).to(tl.float32)
        xs, undo = _x_scaled(xt)                                                              # [BG, 16], [BG]
        acc += _pair_group_sums(w_rows, s_rows, xs, undo, offs_g, mn, mg, BLOCK_N, PTX)
        if SWIGLU:
            acc_up += _pair_group_sums(w_rows + N * s_wn, s_rows + N * s_bn, xs, undo, offs_g, mn, mg, BLOCK_N, PTX)
    g = tl.load(gs_ptr + e)
    y = _expert_epilogue(acc * g, acc_up * g, a_ptr.dtype.element_ty, RELU2, SWIGLU)
    tl.store(out_ptr + p.to(tl.int64) * s_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _decoded_halves(w_rows, b_rows, b0, KB, mn, BLOCK_B: tl.constexpr, DT: tl.constexpr):
    """The weight tile [2 BLOCK_B, BLOCK_N] (inputs down, outputs across) as its even-input and
    odd-input halves [BLOCK_B, BLOCK_N] in DT: bytes b0 .. b0 + BLOCK_B of each output row, e2m1
    times the block scale (exact in DT). The bytes load as [groups, 8, BLOCK_N] and each group's
    scale once, broadcast over its 8 bytes (a scale gathered per byte doubled the tile's loads)."""
    offs_s = b0 // 8 + tl.arange(0, BLOCK_B // 8)                                           # 16-input groups
    offs_j = tl.arange(0, 8)
    ms = (offs_s < KB // 8)[:, None] & mn[None, :]                                           # [BG, BN]
    wb = tl.load(w_rows[None, :, :] + (offs_s[:, None] * 8 + offs_j[None, :])[:, :, None],
                 mask=ms[:, None, :], other=0).to(tl.int32)                                 # [BG, 8, BN]
    s = tl.load(b_rows + offs_s[:, None], mask=ms, other=0.0).to(tl.float32)
    lo, hi = _scaled_nibbles(wb, s[:, None, :], DT)
    return tl.reshape(lo, [BLOCK_B, w_rows.shape[1]]), tl.reshape(hi, [BLOCK_B, w_rows.shape[1]])


@triton.jit
def _dot(a, w, acc, F32: tl.constexpr, F32_PREC: tl.constexpr):
    if F32:
        return tl.dot(a, w, acc, input_precision=F32_PREC)
    else:
        return tl.dot(a, w, acc)


@triton.jit(do_not_specialize=["num_pairs"],
            do_not_specialize_on_alignment=["sorted_ptr", "block_e_ptr", "nrows_ptr"])
def _nvfp4_grouped_gemm_kernel(a_ptr, w_ptr, b_ptr, gs_ptr, out_ptr, sorted_ptr, block_e_ptr, nrows_ptr,
                               N, KB, num_pairs, A_DIV, s_am, s_we, s_wn, s_be, s_bn, s_om,
                               A_SORTED: tl.constexpr, OUT_SORTED: tl.constexpr, RELU2: tl.constexpr,
                               SWIGLU: tl.constexpr, F32: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               F32_PREC: tl.constexpr = F32_DOT_PRECISION):
    """One BLOCK_M x BLOCK_N tile of one expert's projection over its sorted pair rows, as the 16-bit
    ``triton_moe._grouped_gemm_kernel`` (same row and output conventions); the weight is packed
    bytes [E, N, KB] (KB = K / 2) with block scales [E, N, KB / 8], decoded per tile."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(nrows_ptr):
        return
    DT: tl.constexpr = a_ptr.dtype.element_ty
    BLOCK_B: tl.constexpr = BLOCK_K // 2
    e, pos, pair, mrow, a_rows = _expert_tile_rows(sorted_ptr, block_e_ptr, pid_m, num_pairs, A_DIV, A_SORTED,
                                                   BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    a_base = a_ptr + a_rows[:, None] * s_am
    w_rows = w_ptr + e * s_we + offs_n[None, :].to(tl.int64) * s_wn                        # [1, BN]
    b_rows = b_ptr + e * s_be + offs_n[None, :].to(tl.int64) * s_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b0 in range(0, KB, BLOCK_B):
        offs_k = 2 * b0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_base + offs_k[None, :], mask=mrow[:, None] & (offs_k < 2 * KB)[None, :], other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_B, 2]))                  # [BM, BB] each
        lo, hi = _decoded_halves(w_rows, b_rows, b0, KB, mn, BLOCK_B, DT)
        acc = _dot(a_even, lo, acc, F32, F32_PREC)
        acc = _dot(a_odd, hi, acc, F32, F32_PREC)
        if SWIGLU:                      # the up rows sit N rows below the gate rows
            lo, hi = _decoded_halves(w_rows + N * s_wn, b_rows + N * s_bn, b0, KB, mn, BLOCK_B, DT)
            acc_up = _dot(a_even, lo, acc_up, F32, F32_PREC)
            acc_up = _dot(a_odd, hi, acc_up, F32, F32_PREC)
    g = tl.load(gs_ptr + e)
    y = _expert_epilogue(acc * g, acc_up * g, DT, RELU2, SWIGLU)
    _store_expert_tile(out_ptr, y, pos, pair, mrow, offs_n, mn, s_om, OUT_SORTED)


# ------------------------------------------------------------------------------------ the ops

def check_nvfp4_experts(h, up, up_blocks, up_scale, down, down_blocks, down_scale, ids, weights, activation: str) -> None:
    """Shapes and dtypes of NVFP4 merged experts, rows h [T, D] and their choices ids / weights [T, k];
    a ValueError naming the tensor."""
    from hybrid_engine.models.moe_ops import EXPERT_ACTIVATIONS
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"expert activation must be one of {EXPERT_ACTIVATIONS}, got {activation!r}")
    swiglu = activation == "swiglu"
    if h.dim() != 2 or h.stride(-1) != 1:
        raise ValueError(f"NVFP4 experts: h must be [T, D] with a unit inner stride, got {tuple(h.shape)}")
    if ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != h.shape[0]:
        raise ValueError(f"NVFP4 experts: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
                         f"[T, k] with T = {h.shape[0]}, the rows of h")
    E, Fu, Db = up.shape
    F = Fu // 2 if swiglu else Fu
    D_out = down.shape[1]
    want = {"up": ((E, Fu, h.shape[1] // 2), torch.uint8, up), "down": ((E, D_out, F // 2), torch.uint8, down),
            "up_blocks": ((E, Fu, h.shape[1] // GROUP), torch.float8_e4m3fn, up_blocks),
            "down_blocks": ((E, D_out, F // GROUP), torch.float8_e4m3fn, down_blocks),
            "up_scale": ((E,), torch.float32, up_scale), "down_scale": ((E,), torch.float32, down_scale)}
    for name, (shape, dtype, t) in want.items():
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            got = "None" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise ValueError(f"NVFP4 experts for rows {tuple(h.shape)}: {name} must be {shape} {dtype}, got {got}")
        if t.dim() > 1 and t.stride(-1) != 1:
            raise ValueError(f"NVFP4 experts: {name} needs a unit inner stride")
    if h.shape[1] % GROUP or F % GROUP:
        raise ValueError(f"NVFP4 experts need widths that are multiples of {GROUP}, got D={h.shape[1]}, F={F}")


def dequantize_nvfp4_experts(w: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, N, K/2] packed, [E, N, K/16] block scales, [E] -> [E, N, K] float32, exactly."""
    return torch.stack([dequantize_nvfp4(w[e], blocks[e], scale[e]) for e in range(w.shape[0])])


def nvfp4_experts_ref(h, up, up_blocks, up_scale, down, down_blocks, down_scale, ids, weights,
                      activation: str = "relu2") -> torch.Tensor:
    """The torch twin: each expert over the tokens routed to it (``moe_ops.grouped_experts_ref``)
    on its exactly dequantized weights in h's dtype (float32 on CPU: exact up to summation order),
    dequantized when a token chose it (a CPU step pays for its chosen experts only)."""
    from hybrid_engine.models.moe_ops import grouped_experts_ref

    def expert(e: int):
        return (dequantize_nvfp4(up[e], up_blocks[e], up_scale[e]).to(h.dtype),
                dequantize_nvfp4(down[e], down_blocks[e], down_scale[e]).to(h.dtype))
    return grouped_experts_ref(h, up, down, ids, weights, activation, expert_weights=expert)


# up to this many tokens the pairs run as decode GEMVs (``nvfp4_path``), above as the grouped GEMM
# (the 16-bit experts switch above 8): decoding the grouped GEMM's tiles costs more than re-reading
# each expert per pair up to ~24 tokens. H200, Nano experts (benchmarks/moe_experts_quant.py --tokens
# 8 16 24 32 64 --nvfp4-paths gemv grouped, 2026-11-29), GEMVs against grouped: 185 / 277 us at 8
# tokens, 355 / 431 at 16, 526 / 553 at 24, 700 / 657 at 32, 1390 / 754 at 64
GEMV_MAX_TOKENS = 24
NVFP4_PATHS = ("gemv", "grouped")


def nvfp4_path(tokens: int) -> str:
    """The experts' path for a call of ``tokens`` rows (static shapes only: each CUDA-graph bucket
    fixes its own)."""
    return "gemv" if tokens <= GEMV_MAX_TOKENS else "grouped"


# (BLOCK_N, BLOCK_G 16-input groups, num_warps) of the decode kernel (tests and sweeps replace it).
# H200, the Nano experts (benchmarks/moe_experts_quant.py, 2026-11-29): 8 x 64 took 30.2 / 98.1 /
# 184.6 us at 1 / 4 / 8 tokens, the best of 8 tiles, ahead of 4 x 256 (39.9 / 141.9 / 273.2) and of
# a persistent kernel that prepares the pair's whole row of x once (34.8 / 116.3 / 221.5: a Nano
# row's 168 groups padded to 256 wasted a third of its lanes)
DECODE_TILES = (8, 64, 4)


def _decode_launch(a, w_words, blocks, scale, ids, out, N, K, a_div, *, relu2, swiglu, pdl) -> None:
    """One decode projection over every pair (rows of ``out``). Float32 rows take the float32 decode
    and FMAs (the interpreter's twin) on CUDA too: the packed float16 products would cost a
    float32 model its exactness."""
    bn, bg, warps = DECODE_TILES
    _nvfp4_pair_gemv_kernel[(cdiv(N, bn), out.shape[0])](
        a, w_words, blocks, scale, ids, out, N, K // 8, a_div, a.stride(0), w_words.stride(0),
        w_words.stride(1), blocks.stride(0), blocks.stride(1), out.stride(0), RELU2=relu2,
        SWIGLU=swiglu, BLOCK_N=bn, BLOCK_G=bg, PTX=_use_ptx(a) and a.dtype != torch.float32, num_warps=warps,
        **pdl)


def grouped_config(rows_per_expert_tile: int, dtype: torch.dtype, swiglu: bool = False,
                   smem_bytes: int | None = None) -> dict:
    """The grouped kernel's tiles: the 16-bit grouped GEMM's (``moe_tiles.gemm_config``), K steps
    of at least 32 inputs (two dots of K / 2 >= 16). H200, the Nano experts at 64 / 256 / 2048 tokens
    (``benchmarks/moe_experts_quant.py``, 2026-11-29): 763 / 893 / 1870 us with a block scale loaded
    per 16-input group (983 / 1196 / 1905 when it was gathered per byte), against 1093 / 1324 /
    3172 for the NVFP4 dot kernel's decode (packed scale FMAs, K permuted within each word, the
    weight on the MMA's M side) and bf16's 606 / 719 / 855: decoding the tiles bounds it."""
    from hybrid_engine.models.moe_tiles import gemm_config
    cfg = gemm_config(rows_per_expert_tile, dtype, swiglu, smem_bytes=smem_bytes)   # SwiGLU, small-smem GPUs
    assert cfg["BLOCK_K"] >= 32, cfg        # every gemm_config tile has it (32 at the least: float32)
    return cfg


def routed_experts_nvfp4_triton(h: torch.Tensor, up: torch.Tensor, up_blocks: torch.Tensor, up_scale: torch.Tensor,
                                down: torch.Tensor, down_blocks: torch.Tensor, down_scale: torch.Tensor,
                                ids: torch.Tensor, weights: torch.Tensor, add: "torch.Tensor | SideOutput | None" = None,
                                activation: str = "relu2", path: str | None = None) -> torch.Tensor:
    """The routed experts' weighted sum [T, D_out] in h.dtype (+ ``add``), as
    ``triton_moe.routed_experts_triton`` with NVFP4 weights (module docstring); checked. ``path``
    (tests, benchmarks): one of ``NVFP4_PATHS`` instead of ``nvfp4_path``'s choice."""
    check_nvfp4_experts(h, up, up_blocks, up_scale, down, down_blocks, down_scale, ids, weights, activation)
    if path is not None and path not in NVFP4_PATHS:
        raise ValueError(f"NVFP4 experts: path must be one of {NVFP4_PATHS} or None, got {path!r}")
    return _routed_triton(h, up, up_blocks, up_scale, down, down_blocks, down_scale, ids, weights, add,
                          activation, path)


def routed_experts_nvfp4(h, up, up_blocks, up_scale, down, down_blocks, down_scale, ids, weights, add=None,
                         activation: str = "relu2") -> torch.Tensor:
    """``moe_ops.routed_experts`` with NVFP4 weights: the Triton kernels on CUDA, else the exact twin
    (CPU), else every expert dequantized (CUDA without Triton: sync-free, slow)."""
    scales = (up, up_blocks, up_scale, down, down_blocks, down_scale)
    check_nvfp4_experts(h, *scales, ids, weights, activation)
    if not h.shape[0]:                      # no rows: nothing to dequantize
        out = h.new_zeros(0, down.shape[1])
        return out if add is None else out + joined(add)
    if kernel_backend("moe_experts_nvfp4", h.device) == "triton":
        return _routed_triton(h, *scales, ids, weights, add, activation, None)
    if h.device.type == "cpu":
        out = nvfp4_experts_ref(h, *scales, ids, weights, activation)
    else:
        from hybrid_engine.models.moe_ops import dense_experts_ref
        out = dense_experts_ref(h, dequantize_nvfp4_experts(up, up_blocks, up_scale).to(h.dtype),
                                dequantize_nvfp4_experts(down, down_blocks, down_scale).to(h.dtype),
                                ids, weights, activation)
    return out if add is None else out + joined(add)


def _routed_triton(h, up, up_blocks, up_scale, down, down_blocks, down_scale, ids, weights, add, activation, path):
    swiglu = activation == "swiglu"
    T, k = ids.shape
    E, Fu, _ = up.shape
    F = Fu // 2 if swiglu else Fu
    D_in, D_out = h.shape[1], down.shape[1]
    P = T * k
    dev = h.device
    ids, weights, pair_out = pair_buffers(ids, weights, D_out, h.dtype)
    pdl = pdl_kwargs(dev)
    path = path or nvfp4_path(T)
    if path == "gemv":
        up_w, down_w = up.view(torch.int32), down.view(torch.int32)          # 8 inputs a word
        inter = torch.empty(P, F, dtype=h.dtype, device=dev)
        _decode_launch(h, up_w, up_blocks, up_scale, ids, inter, F, D_in, k, relu2=not swiglu, swiglu=swiglu,
                       pdl=pdl)
        _decode_launch(inter, down_w, down_blocks, down_scale, ids, pair_out, D_out, F, 1, relu2=False,
                       swiglu=False, pdl=pdl)
    else:
        bm = align_block_size(P, E)
        al = group_pairs(ids, E, bm)
        cfg = grouped_config(bm, h.dtype, swiglu, device_smem(dev))
        f32 = h.dtype == torch.float32
        inter = torch.empty(al.sorted_pairs.shape[0], F, dtype=h.dtype, device=dev)   # sorted rows
        _nvfp4_grouped_gemm_kernel[(cdiv(F, cfg["BLOCK_N"]), al.max_blocks)](
            h, up, up_blocks, up_scale, inter, al.sorted_pairs, al.block_expert, al.num_rows,
            F, D_in // 2, P, k, h.stride(0), up.stride(0), up.stride(1), up_blocks.stride(0), up_blocks.stride(1),
            inter.stride(0), A_SORTED=False, OUT_SORTED=True, RELU2=not swiglu, SWIGLU=swiglu,
            F32=f32, BLOCK_M=bm, **cfg)
        _nvfp4_grouped_gemm_kernel[(cdiv(D_out, cfg["BLOCK_N"]), al.max_blocks)](
            inter, down, down_blocks, down_scale, pair_out, al.sorted_pairs, al.block_expert, al.num_rows,
            D_out, F // 2, P, 1, inter.stride(0), down.stride(0), down.stride(1), down_blocks.stride(0),
            down_blocks.stride(1), pair_out.stride(0), A_SORTED=True, OUT_SORTED=False, RELU2=False,
            SWIGLU=False, F32=f32, BLOCK_M=bm, **cfg)
    return combine_pairs(pair_out, weights, h.dtype, add)
